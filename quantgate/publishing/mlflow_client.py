"""MLflow's REST API over httpx (adapter), so that quantgate needs no mlflow package: JSON calls under
/api/2.0/mlflow/ and artifact uploads through the tracking server's proxied artifact API.

A call is retried on connection errors, timeouts, HTTP 5xx and 429 with doubling delays (quantgate.base.http.Retry,
Retry-After honoured); then, or at once for any other refusal, MlflowError names the URL, the call and the server's
own error message (MLflow answers `{"error_code": ..., "message": ...}`). A caller may accept some error codes
(`allow`: RESOURCE_ALREADY_EXISTS where "already there" is fine); nothing else is swallowed.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

import httpx

from quantgate.base.errors import QuantgateError, SettingError
from quantgate.base.http import Retry

RETRY = Retry(timeout_s=60.0, max_attempts=4, backoff_s=0.5, backoff_max_s=4.0)
ARTIFACTS = "/api/2.0/mlflow-artifacts/artifacts"


class MlflowError(QuantgateError):
    """The MLflow server could not be reached or refused a call: `url` is the request's URL, `call` the API call
    (`POST /api/2.0/mlflow/runs/create`), `detail` what the server or the connection said."""

    def __init__(self, message: str, *, url: str, call: str, detail: str, fix: str):
        self.url, self.call, self.detail = url, call, detail
        super().__init__(message, where=url, fix=fix)


def base_url(tracking_uri: str) -> str:
    """The tracking server's URL without a trailing slash; SettingError for anything but http(s)."""
    uri = tracking_uri.strip()
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise SettingError(f"not an MLflow server URL: {tracking_uri!r}", setting="tracking_uri",
                           fix="give the tracking server's http(s) URL, e.g. http://127.0.0.1:5000 (file stores "
                               "and databricks:// URIs are not supported)")
    return uri.rstrip("/")


def shown(url: str) -> str:
    """`url` for messages: without a user and password it may carry (http://user:secret@host)."""
    parsed = urllib.parse.urlparse(url)
    return parsed._replace(netloc=parsed.netloc.rpartition("@")[2]).geturl() if "@" in parsed.netloc else url


def _error_text(resp: httpx.Response) -> tuple[str | None, str]:
    """(MLflow's error_code, its message) of a refused call; the body's start when it is not MLflow's JSON."""
    try:
        body = resp.json()
    except ValueError:
        return None, resp.text[:300].strip() or resp.reason_phrase
    if isinstance(body, dict):
        return body.get("error_code"), str(body.get("message") or body)[:500]
    return None, str(body)[:300]


def _fix(status: int) -> str:
    if status in (401, 403):
        return "set MLFLOW_TRACKING_TOKEN to a token the server accepts"
    if status == 404:
        return "check that the URL is an MLflow tracking server (>= 2.x) and, for artifacts, that it serves them"
    return "see the server's message; the run folder is unchanged, so export again once it is fixed"


def _error(url: str, call: str, detail: str, fix: str) -> MlflowError:
    return MlflowError(f"MLflow {call} failed: {detail}", url=shown(url), call=call, detail=detail, fix=fix)


class Api:
    """One tracking server: `post`/`get` of its JSON API, `request` for anything (an artifact PUT)."""

    def __init__(self, base: str, token: str | None, retry: Retry = RETRY):
        self.base, self.retry = base, retry
        self.http = httpx.Client(timeout=retry.timeout_s, headers={"Authorization": f"Bearer {token}"} if token else {})

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None,
                upload: tuple[bytes, str] | None = None, allow: Iterable[str] = ()) -> dict[str, Any] | None:
        """The JSON answer of one call (`path` below the server's URL, or a whole URL); None when the server
        refused it with an error code in `allow`. `upload`: raw bytes and their content type (an artifact)."""
        url = path if path.startswith(("http://", "https://")) else self.base + path
        call = f"{method} {urllib.parse.urlparse(url).path}"
        content, headers = (upload[0], {"Content-Type": upload[1]}) if upload else (None, None)
        attempts = 0
        while True:
            attempts += 1
            retry_after = None
            try:
                resp = self.http.request(method, url, json=body, params=params, content=content, headers=headers)
            except httpx.TransportError as exc:  # connect, read and write errors, timeouts
                error = f"{type(exc).__name__}: {exc}".rstrip(": ")
            else:
                if resp.status_code == 200:
                    return self._answer(resp, url, call)
                code, message = _error_text(resp)
                if code is not None and code in allow:
                    return None
                error = f"HTTP {resp.status_code}" + (f" {code}" if code else "") + f": {message}"
                if resp.status_code < 500 and resp.status_code != 429:
                    raise _error(url, call, error, _fix(resp.status_code))
                retry_after = resp.headers.get("retry-after")
            if attempts >= self.retry.max_attempts:
                raise _error(url, call, f"{error} (after {attempts} attempts)",
                             f"check that an MLflow server answers at {shown(self.base)} (`mlflow server ...`), "
                             "then export again: an export is idempotent")
            time.sleep(self.retry.delay(attempts, retry_after))

    @staticmethod
    def _answer(resp: httpx.Response, url: str, call: str) -> dict[str, Any]:
        try:
            answer = resp.json() if resp.content else {}
        except ValueError:
            raise _error(url, call, f"HTTP 200 whose body is not JSON: {resp.text[:200]}",
                         "check that the URL is an MLflow tracking server") from None
        return answer if isinstance(answer, dict) else {}

    def post(self, endpoint: str, body: dict[str, Any], allow: Iterable[str] = ()) -> dict[str, Any] | None:
        return self.request("POST", f"/api/2.0/mlflow/{endpoint}", body=body, allow=allow)

    def get(self, endpoint: str, params: dict[str, str], allow: Iterable[str] = ()) -> dict[str, Any] | None:
        return self.request("GET", f"/api/2.0/mlflow/{endpoint}", params=params, allow=allow)

    def must(self, endpoint: str, answer: dict[str, Any] | None, *keys: str) -> Any:
        """answer[keys[0]][keys[1]]... of a call to `endpoint`: a 200 without them is not an MLflow server's."""
        value: Any = answer
        for k in keys:
            if not isinstance(value, dict) or k not in value:
                raise _error(f"{self.base}/api/2.0/mlflow/{endpoint}", endpoint,
                             f"the answer has no {'.'.join(keys)}: {str(answer)[:300]}",
                             "check that the URL is an MLflow tracking server")
            value = value[k]
        return value


def artifact_url(base: str, artifact_uri: str, path: str) -> str:
    """The URL to PUT a run's artifact to, through the server's proxied artifact API. A run's `artifact_uri` is
    `mlflow-artifacts:/<root>` (or `mlflow-artifacts://host:port/<root>`, or already an http(s) URL under
    /api/2.0/mlflow-artifacts/artifacts/): the file goes to /api/2.0/mlflow-artifacts/artifacts/<root>/<path> of
    the tracking server, the mapping of MLflow's own MlflowArtifactsRepository.resolve_uri. Any other scheme (s3://,
    a local path) means the server does not proxy artifacts: QuantgateError."""
    parsed = urllib.parse.urlparse(artifact_uri)
    quoted = urllib.parse.quote(path)
    if parsed.scheme in ("http", "https") and ARTIFACTS in parsed.path:
        return artifact_uri.rstrip("/") + "/" + quoted
    if parsed.scheme != "mlflow-artifacts":
        raise QuantgateError(f"the server keeps this run's artifacts at {artifact_uri}, which it does not serve",
                             where=shown(base), fix="start the MLflow server with artifact serving (the default, "
                                                    "--artifacts-destination DIR), not --no-serve-artifacts")
    host = f"{urllib.parse.urlparse(base).scheme}://{parsed.netloc}" if parsed.netloc else base
    return f"{host}{ARTIFACTS}/{urllib.parse.quote(parsed.path.strip('/'))}/{quoted}"
