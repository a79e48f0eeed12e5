"""The work-pools executor (`executor: pools`): each variant measured in a child flow run on a Prefect work pool,
its evidence shared through a results store (`executor` is the parent's side, `child` the flow a worker runs)."""

from quantgate.pools import executor
from quantgate.release.executors import register

register("pools", executor)
