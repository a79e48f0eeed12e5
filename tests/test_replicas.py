"""A variant's steps spread over its replicas (quantgate.release.replicas) and the pool lending free slots for them
(quantgate.release.schedule.SlotPool.borrow). Real threads; the "servers" are stand-ins, since what is tested is the
hand-out: which server runs which step, when one more is started, and that every lent slot comes back. A real
release on two cores uses this (bench/release_time.py shows the servers and their slots)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from quantgate.plan.slots import Slot
from quantgate.release.replicas import Lending, Step, StepRunner, run_steps
from quantgate.release.schedule import SlotPool


def _slots(n: int) -> list[Slot]:
    return [Slot(index=i, kind="cpu", devices=[i], env={"VLLM_CPU_OMP_THREADS_BIND": str(i)}) for i in range(n)]


class Srv:
    def __init__(self, name: str):
        self.name, self.up = name, True

    def alive(self) -> bool:
        return self.up


def _recording(names: list[str], seconds: float, ran: dict[str, str], lock: threading.Lock) -> list[Step]:
    def run(srv, n):
        time.sleep(seconds)
        with lock:
            ran[n] = srv.name
    return [Step(n, lambda srv, n=n: run(srv, n)) for n in names]


def _starter(started: list[int]):
    @contextmanager
    def start(slot: Slot):
        started.append(slot.index)
        yield Srv(f"replica-{slot.index}")
    return start


def test_a_lone_variant_takes_the_free_slot_and_both_servers_run_steps():
    pool = SlotPool(_slots(2), log=lambda _: None)
    ran, lock, started = {}, threading.Lock(), []
    with pool.take("w4a16") as own:
        n = run_steps(_recording(["eval", "recall", "perf", "fidelity"], 0.3, ran, lock), Srv("first"), name="w4a16",
                      lending=Lending(pool, _starter(started), poll_s=0.02), log=lambda _: None)
        assert own.index == 0
    assert n == 2 and started == [1]
    assert set(ran) == {"eval", "recall", "perf", "fidelity"}
    assert set(ran.values()) == {"first", "replica-1"}  # both servers measured
    with pool.take("a"), pool.take("b"):  # every slot came back
        pass


def test_no_slot_is_lent_while_a_job_waits_or_is_announced():
    pool = SlotPool(_slots(2), log=lambda _: None)
    pool.announce("int8-w8a8")  # submitted, waiting for its quantization: it will need the free slot
    with pool.take("baseline"):
        assert pool.borrow() is None
        pool.withdraw("int8-w8a8")
        slot = pool.borrow()
        assert slot is not None and slot.index == 1 and pool.borrow() is None
        pool.give_back(slot)
    with pool.take("int8-w8a8"):
        pass


def test_a_job_that_takes_its_slot_is_no_longer_announced():
    pool = SlotPool(_slots(2), log=lambda _: None)
    pool.announce("baseline", "int8-w8a8")
    with pool.take("baseline"):
        assert pool.borrow() is None
        with pool.take("int8-w8a8"):
            assert pool.borrow() is None  # nothing free
        lent = pool.borrow()
        assert lent is not None
        pool.give_back(lent)


def test_one_step_starts_no_server():
    pool = SlotPool(_slots(2), log=lambda _: None)
    ran, lock, started = {}, threading.Lock(), []
    with pool.take("candidate"):
        n = run_steps(_recording(["recall"], 0.2, ran, lock), Srv("first"), name="c",
                      lending=Lending(pool, _starter(started), poll_s=0.02), log=lambda _: None)
    assert n == 1 and started == [] and ran == {"recall": "first"}  # below grow_at: not worth a server start


def test_extra_servers_start_beside_the_first_but_take_no_step_before_it_is_checked():
    pool = SlotPool(_slots(2), log=lambda _: None)
    ran, lock, started = {}, threading.Lock(), []
    with pool.take("baseline"):
        with StepRunner(_recording(["eval", "recall", "perf"], 0.1, ran, lock), name="baseline",
                        lending=Lending(pool, _starter(started), poll_s=0.02), log=lambda _: None) as runner:
            deadline = time.monotonic() + 5
            while not started and time.monotonic() < deadline:
                time.sleep(0.01)
            assert started == [1]  # started while the first server is still coming up (engine parity)
            time.sleep(0.1)
            assert ran == {}  # ... but it takes no step before work() opens the hand-out
            runner.work(Srv("first"))
    assert set(ran) == {"eval", "recall", "perf"} and runner.servers == 2


def test_a_failed_engine_check_lets_the_extra_server_go_without_a_step():
    pool = SlotPool(_slots(2), log=lambda _: None)
    ran, lock, started = {}, threading.Lock(), []
    with pool.take("baseline"):
        with pytest.raises(RuntimeError, match="parity"):
            with StepRunner(_recording(["eval", "recall"], 0.05, ran, lock), name="baseline",
                            lending=Lending(pool, _starter(started), poll_s=0.02), log=lambda _: None):
                time.sleep(0.1)
                raise RuntimeError("engine parity failed")
    assert started == [1] and ran == {}
    lent = pool.borrow()  # its slot came back
    assert lent is not None


def test_a_failing_step_is_raised_after_every_server_stopped_and_the_slot_is_back():
    pool = SlotPool(_slots(2), log=lambda _: None)
    started: list[int] = []

    def boom(srv):
        time.sleep(0.1)
        raise RuntimeError("eval failed")

    steps = [Step("eval", boom), *(Step(f"s{i}", lambda srv: time.sleep(0.2)) for i in range(3))]
    with pool.take("candidate"):
        with pytest.raises(RuntimeError, match="eval failed"):
            run_steps(steps, Srv("first"), name="c", lending=Lending(pool, _starter(started), poll_s=0.02),
                      log=lambda _: None)
    lent = pool.borrow()
    assert lent is not None
    pool.give_back(lent)


def test_a_step_on_an_extra_server_that_died_goes_back_to_the_others():
    pool = SlotPool(_slots(2), log=lambda _: None)
    ran, lock = {}, threading.Lock()
    dying = Srv("replica-1")

    @contextmanager
    def start(slot):
        yield dying

    def step(srv, n):
        if srv is dying:
            srv.up = False
            raise ConnectionError("server gone")
        time.sleep(0.1)
        with lock:
            ran[n] = srv.name

    steps = [Step(n, lambda srv, n=n: step(srv, n)) for n in ("a", "b", "c", "d")]
    with pool.take("candidate"):
        n = run_steps(steps, Srv("first"), name="c", lending=Lending(pool, start, poll_s=0.02), log=lambda _: None)
    assert set(ran) == {"a", "b", "c", "d"} and set(ran.values()) == {"first"} and n >= 2


def test_a_lone_quantization_takes_the_free_cores_and_gives_them_back():
    pool = SlotPool(_slots(2), log=lambda _: None)
    pool.announce("quantize w4a16-gptq", "w4a16-gptq")  # its own server waits for it: that does not hold it back
    with pool.take_for_quantize("quantize w4a16-gptq", then="w4a16-gptq") as slot:
        assert slot.devices == [0, 1] and slot.label == "slot 0 (cores 0-1)"
        assert pool.borrow(ignoring={"w4a16-gptq"}) is None  # both are in use
    with pool.take("w4a16-gptq") as own, pool.take("other") as other:  # both came back
        assert {own.index, other.index} == {0, 1}


def test_a_quantization_beside_a_waiting_variant_keeps_to_one_slot():
    pool = SlotPool(_slots(2), log=lambda _: None)
    pool.announce("quantize int8-w8a8", "int8-w8a8", "baseline")  # the baseline is still to take its slot
    with pool.take_for_quantize("quantize int8-w8a8", then="int8-w8a8") as slot:
        assert slot.devices == [0]
