"""Errors name a setting in the caller's terms: the library raises in the release spec's field names, the command
line shows the flag the user typed (quantgate.base.errors.SettingError, quantgate.cli.main.user_error)."""

from __future__ import annotations

import pytest

from quantgate.base.errors import ConfigError, QuantgateError, SettingError, as_flag
from quantgate.base.fileio import resolve_api_key
from quantgate.cli.main import user_error
from quantgate.recall.needle import check_lengths


@pytest.mark.parametrize("setting, flag", [
    ("recall.lengths", "--lengths"),
    ("api_key_env", "--api-key-env"),
    ("perf.concurrency", "--concurrency"),
    ("api_key_env / prefect_secret", "--api-key-env / --prefect-secret"),
])
def test_a_setting_becomes_its_flag(setting, flag):
    assert as_flag(setting) == flag


def test_library_errors_name_the_spec_field_and_the_cli_shows_the_flag():
    with pytest.raises(SettingError) as err:
        check_lengths([4096], max_model_len=2048, max_answer_tokens=32, source="served")
    assert isinstance(err.value, ConfigError)  # still caught where config errors are
    assert err.value.render().startswith("recall.lengths: length(s) 4096")  # the release spec's field
    cli = user_error(err.value)
    assert cli.where == "--lengths" and cli.message == err.value.message and cli.fix == err.value.fix
    assert cli.render().startswith("--lengths: length(s) 4096")


def test_other_errors_pass_through_the_cli_unchanged():
    plain = QuantgateError("boom", where="a.yaml:3", fix="edit it")
    assert user_error(plain) is plain


def test_an_unset_key_variable_is_named_as_a_setting(monkeypatch):
    monkeypatch.delenv("QG_ERRORS_UNSET_VAR", raising=False)
    with pytest.raises(SettingError) as err:
        resolve_api_key("QG_ERRORS_UNSET_VAR")
    assert err.value.setting == "api_key_env" and "QG_ERRORS_UNSET_VAR" in err.value.message
    assert user_error(err.value).where == "--api-key-env"
