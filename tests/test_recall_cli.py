"""`quantgate recall` bad input: clear errors before any chat request reaches the server."""

from __future__ import annotations

import json

import pytest
import typer
from _fake_openai import FakeServer
from typer.testing import CliRunner

from quantgate.base.errors import QuantgateError
from quantgate.cli.main import user_error
from quantgate.cli.recall import recall

_app = typer.Typer()
_app.command()(recall)


@pytest.fixture
def server(tmp_path):
    with FakeServer(max_model_len=1024) as s:
        s.out = tmp_path / "out"
        yield s
        assert not s.out.exists()  # a refused run writes nothing


def invoke(server, tokenizer, *extra: str, model: str = "fake-model"):
    args = ["--endpoint", server.url, "--model", model, "--tokenizer", str(tokenizer), "--out",
            str(server.out), "--no-progress", *extra]
    return CliRunner().invoke(_app, args)


def error_of(result) -> QuantgateError:
    assert isinstance(result.exception, QuantgateError), (result.exception, result.output)
    return user_error(result.exception)  # as `quantgate` prints it: the library's setting names become flags


def test_recall_is_registered_on_the_main_cli():
    from quantgate.cli.main import COMMANDS

    assert COMMANDS["recall"].target() is recall


@pytest.mark.parametrize("extra,where,words", [
    (["--kinds", "number,names"], "--kinds", ["names", "number,name,multilingual,multi"]),
    (["--depths", "0,50,120"], "--depths", ["120", "0..100"]),
    (["--lengths", "1024,4096", "--max-model-len", "2048"], "--lengths", ["4096 + 32 answer tokens", "2048", "--max-model-len"]),
    (["--lengths", "2000", "--max-model-len", "2048", "--max-answer-tokens", "64"], "--lengths", ["2000 + 64", "up to 1984"]),
    (["--api-key-env", "QG_TEST_UNSET_KEY_VAR"], "--api-key-env", ["QG_TEST_UNSET_KEY_VAR"]),
    (["--ask", "pairs"], "--ask", ["pairs", "single, turns, together"]),
])
def test_bad_options_fail_before_any_request(server, demo_model, extra, where, words, monkeypatch):
    monkeypatch.delenv("QG_TEST_UNSET_KEY_VAR", raising=False)
    err = error_of(invoke(server, demo_model, *extra))
    assert err.where.startswith(where) and all(w in err.render() for w in words), err.render()
    assert server.requests == []


def test_missing_baseline_run_is_refused(server, demo_model, tmp_path):
    err = error_of(invoke(server, demo_model, "--baseline", str(tmp_path / "nothing")))
    assert "requests.jsonl" in err.message and server.requests == []


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_a_folder_without_a_tokenizer_is_refused(server, tmp_path, make):
    folder = tmp_path / "tok"
    if make == "empty":
        folder.mkdir()
    err = error_of(invoke(server, folder))
    assert err.where == "--tokenizer" and str(folder) in err.message and server.requests == []


@pytest.mark.slow  # imports transformers (about 8 s here)
def test_a_tokenizer_that_cannot_be_loaded_is_refused(server, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{not json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    err = error_of(invoke(server, folder))
    assert err.message.startswith("cannot load a tokenizer") and server.requests == []


@pytest.mark.slow  # imports transformers (about 8 s here)
@pytest.mark.parametrize("extra,words", [
    (["--lengths", "1024,9000"], ["9000 + 32 answer tokens exceed the context of 8192", "max_position_embeddings"]),
    (["--lengths", "512,2048"], ["2048 + 32 answer tokens exceed the context of 1024", "max_model_len served at"]),
])
def test_lengths_beyond_the_model_or_served_context_are_refused(server, demo_model, extra, words):
    err = error_of(invoke(server, demo_model, *extra))
    assert all(w in err.message for w in words), err.message
    assert server.requests == []


@pytest.mark.slow  # imports transformers (about 8 s here)
def test_a_model_the_server_does_not_serve_is_refused(server, demo_model):
    err = error_of(invoke(server, demo_model, "--lengths", "256", model="other"))
    assert "'other' is not served" in err.message and server.requests == []
