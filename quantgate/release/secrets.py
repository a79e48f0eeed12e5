"""API keys named in a release spec or on the command line: an environment variable, or a Prefect Secret block.

Prefect is read here, in the release layer, and nowhere below it (the layer test enforces it): the serving and judge
adapters take the key itself. `read_api_key` is the one lookup; `spec_api_key` re-scopes its error to the spec
field (`judge.api_key_env`, `candidates.1.prefect_secret`); `endpoint_api_key` reads an endpoint's.
"""

from __future__ import annotations

from quantgate.base.errors import ConfigError, SettingError
from quantgate.base.fileio import resolve_api_key
from quantgate.serving.endpoint import EndpointConfig


def read_api_key(api_key_env: str | None = None, prefect_secret: str | None = None) -> str | None:
    """The key from the environment variable or the Prefect Secret block (None: neither is named)."""
    if api_key_env and prefect_secret:
        raise SettingError("give either an environment variable or a Prefect Secret block, not both",
                           setting="api_key_env / prefect_secret")
    if not prefect_secret:
        return resolve_api_key(api_key_env)
    try:
        from prefect.blocks.system import Secret

        # Prefect types Block.load as sync-or-async (sync_compatible); called from sync code it returns the block
        return Secret.load(prefect_secret).get()  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - import error, unknown block, unreachable Prefect API
        raise SettingError(f"cannot read Prefect Secret block {prefect_secret!r}: {exc}", setting="prefect_secret",
                           fix="create it (prefect block create secret) and check PREFECT_API_URL") from None


def spec_api_key(api_key_env: str | None, prefect_secret: str | None, section: str) -> str | None:
    """The key named in a release spec section (`judge`, `baseline`, `candidates.0`); the error names the field."""
    try:
        return read_api_key(api_key_env, prefect_secret)
    except ConfigError as exc:
        field = "api_key_env" if api_key_env else "prefect_secret"
        raise ConfigError(exc.message, where=f"release spec field '{section}.{field}'", fix=exc.fix) from None


def endpoint_api_key(config: EndpointConfig) -> str | None:
    """An endpoint's key, from the spec field its config came from."""
    return spec_api_key(config.api_key_env, config.prefect_secret, config.where)
