"""An OpenAI-compatible server that quantgate neither starts nor stops (adapter): a production baseline or a remote
candidate, measured through the same steps as a served variant.

    with EndpointServer(EndpointConfig(url="https://host/v1", name="served-name", api_key_env="VAR"), log_path) as srv:
        client(srv.base_url, srv.api_key)

It has VLLMServer's surface (base_url, api_key, config with the served name, log_path, command, alive,
raise_if_dead, context manager), but entering it starts nothing: it checks that `GET /v1/models` lists the model
(quantgate.base.http.model_entry) and records what the endpoint reports. Leaving it stops nothing: it asks again and
raises when the endpoint now reports something else (it was redeployed while it was measured). Every check is
written to `log_path`. The API key is given (the release reads it from the spec's environment variable or Prefect
Secret block: quantgate.release.secrets), else read from `api_key_env` when the server is entered; an error names the
release spec field (`where`).

What `/v1/models` reports is the endpoint's fingerprint: id, root, parent, max_model_len and owned_by, never
`created` (vLLM stamps every answer with the current time). An endpoint can change under the same URL and name
without changing these, so its results are cached for one run only (quantgate.release.cachelayout).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base import http
from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.fileio import resolve_api_key

STABLE_FIELDS = ("id", "root", "parent", "max_model_len", "owned_by")


class EndpointConfig(BaseModel):
    """Where an endpoint answers and how to reach it; `where` names the spec field it came from (for errors)."""
    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://", description="the endpoint's base URL, e.g. https://host/v1")
    name: str = Field(min_length=1, description="the model name it serves (requests' `model`)")
    api_key_env: str | None = None
    prefect_secret: str | None = None
    where: str = Field("endpoint", description="the spec field, e.g. `baseline` or `candidates.1`")
    python: Path | None = Field(None, description="serving interpreter for vLLM's benchmark client (perf probe)")
    args: list[str] = Field(default_factory=list, description="none: quantgate passes the endpoint no arguments")
    env: dict[str, str] = Field(default_factory=dict)
    dtype: None = Field(None, description="unknown: the endpoint is served elsewhere")


def env_api_key(config: EndpointConfig) -> str | None:
    """The endpoint's key from its environment variable; a Prefect Secret block is read by the caller (the release)."""
    if config.prefect_secret:
        raise ConfigError(f"the key of {config.url} is in Prefect Secret block {config.prefect_secret!r}, which this "
                          "caller did not read", where=f"release spec field '{config.where}.prefect_secret'",
                          fix="give the key (quantgate.release.secrets.endpoint_api_key reads the block)")
    try:
        return resolve_api_key(config.api_key_env)
    except ConfigError as exc:
        raise ConfigError(exc.message, where=f"release spec field '{config.where}.api_key_env'", fix=exc.fix) from None


def fingerprint(entry: dict) -> str:
    """A digest of the stable part of a `/v1/models` entry (STABLE_FIELDS)."""
    stable = {k: entry.get(k) for k in STABLE_FIELDS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def describe(config: EndpointConfig, key: str | None = None, timeout_s: float = 30.0) -> dict:
    """{url, model, reported (the stable entry), fingerprint}: what the endpoint says about the model now."""
    entry = http.model_entry(http.Endpoint(config.url, config.name, key if key is not None else env_api_key(config)),
                             timeout_s, where=f"release spec field '{config.where}.endpoint' ({config.url})")
    return {"url": http.api_base(config.url), "model": config.name,
            "reported": {k: entry.get(k) for k in STABLE_FIELDS}, "fingerprint": fingerprint(entry)}


class EndpointServer:
    """A running server someone else runs; see the module docstring."""

    death_grace_s = 0.0  # nothing of ours can be dying: an endpoint that does not answer is reported at once

    def __init__(self, config: EndpointConfig, log_path: Path, api_key: str | None = None):
        self.config = config
        self.log_path = Path(log_path)
        self.api_key = api_key
        self.seen: dict | None = None  # describe() at entry

    @property
    def base_url(self) -> str:
        return http.api_base(self.config.url)

    @property
    def endpoint(self) -> http.Endpoint:
        """The served model as its clients address it."""
        return http.Endpoint(self.base_url, self.config.name, self.api_key)

    @property
    def command(self) -> list[str]:
        """No command: quantgate starts nothing. The evidence names the endpoint instead."""
        return []

    def _log(self, what: str, info: dict) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"{stamp} {what} {json.dumps(info, sort_keys=True, default=str)}\n")

    def start(self) -> EndpointServer:
        """Start nothing: read the key (unless given) and check that /v1/models lists the model."""
        if self.api_key is None:
            self.api_key = env_api_key(self.config)
        self.seen = describe(self.config, self.api_key)
        self._log("entry: not started by quantgate; /v1/models lists it", self.seen)
        return self

    def stop(self, raising: bool = True) -> None:
        """Stop nothing: check that the endpoint still reports what it reported at entry."""
        if self.seen is None:
            return
        try:
            now = describe(self.config, self.api_key)
        except QuantgateError as exc:
            self._log("exit: no answer", {"error": exc.message})
            if raising:
                raise
            return
        self._log("exit: not stopped by quantgate", now)
        if now["fingerprint"] != self.seen["fingerprint"] and raising:
            raise QuantgateError(f"the endpoint {self.base_url} now reports {now['reported']} for {self.config.name}, "
                                 f"not {self.seen['reported']}: it changed while it was measured",
                                 where=f"release spec field '{self.config.where}'",
                                 fix="re-run the release once the endpoint's deployment is stable")

    def alive(self) -> bool:
        """Whether the endpoint still lists the model."""
        try:
            http.model_entry(self.endpoint, 10.0)
            return True
        except QuantgateError:
            return False

    def raise_if_dead(self) -> None:
        """An error when the endpoint no longer lists the model (unreachable, refused, or not served)."""
        http.model_entry(self.endpoint, 10.0,
                         where=f"release spec field '{self.config.where}.endpoint' ({self.config.url})")

    def __enter__(self) -> EndpointServer:
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(raising=exc_type is None)
