"""API keys: an environment variable, or a Prefect Secret block read by the release layer (quantgate.release.secrets)
and handed to the serving adapters, which never import Prefect."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quantgate.base.errors import ConfigError, SettingError
from quantgate.release.secrets import endpoint_api_key, read_api_key, spec_api_key
from quantgate.serving.endpoint import EndpointConfig, EndpointServer


def test_an_environment_variable_key_is_read_and_both_sources_are_refused(monkeypatch):
    monkeypatch.setenv("QG_SECRETS_KEY", "k1")
    assert read_api_key("QG_SECRETS_KEY") == "k1" and read_api_key() is None
    with pytest.raises(SettingError, match="not both"):
        read_api_key("QG_SECRETS_KEY", "block")
    cfg = EndpointConfig(url="http://127.0.0.1:9/v1", name="m", api_key_env="QG_SECRETS_KEY", where="candidates.1")
    assert endpoint_api_key(cfg) == "k1"
    monkeypatch.delenv("QG_SECRETS_KEY")
    with pytest.raises(ConfigError) as err:
        endpoint_api_key(cfg)
    assert err.value.where == "release spec field 'candidates.1.api_key_env'" and "QG_SECRETS_KEY" in err.value.message


def test_the_endpoint_adapter_does_not_read_a_prefect_block_itself(tmp_path):
    cfg = EndpointConfig(url="http://127.0.0.1:9/v1", name="m", prefect_secret="prod-key", where="baseline")
    with pytest.raises(ConfigError) as err:
        EndpointServer(cfg, tmp_path / "endpoint.log").start()  # refused before any request (port 9 answers nothing)
    assert err.value.where == "release spec field 'baseline.prefect_secret'" and "prod-key" in err.value.message


SCRIPT = """
import json
from prefect.blocks.system import Secret
from quantgate.base.errors import ConfigError
from quantgate.release.secrets import spec_api_key
Secret(value="s3cret-value").save("qg-test-key", overwrite=True)
out = {"key": spec_api_key(None, "qg-test-key", "judge")}
try:
    spec_api_key(None, "qg-no-such-block", "judge")
except ConfigError as exc:
    out["error"] = [exc.where, exc.message]
print(json.dumps(out))
"""


@pytest.mark.slow  # a real Prefect server (the session's) and one Python start with Prefect (about 10 s)
def test_a_key_in_a_prefect_secret_block_is_read_from_the_server(prefect_api):
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["key"] == "s3cret-value"
    assert out["error"][0] == "release spec field 'judge.prefect_secret'" and "qg-no-such-block" in out["error"][1]
