"""Plain (non-streaming) HTTP to the servers the lab talks to: a GET that
returns the status and body, and a JSON POST to an OpenAI-compatible API.

Streamed, timed requests go through `lab_utils.client`; these are for
health checks, /metrics, /version, one-off answers (prompt logprobs), vLLM's
control endpoints (an empty POST) and a
look at a response's raw bytes (`fetch_raw`: a wire format as it is sent).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from .errors import ServerError


def _request(url: str, data: bytes | None, api_key: str | None) -> urllib.request.Request:
    req = urllib.request.Request(url, data)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    return req


def http_get(url: str, timeout: float = 5.0, api_key: str | None = None) -> tuple[int, bytes]:
    """(HTTP status, body) of a GET: an error status is returned, not raised
    (a connection that fails raises OSError)."""
    try:
        with urllib.request.urlopen(_request(url, None, api_key), timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_empty(url: str, timeout: float = 30.0) -> int:
    """HTTP status of a POST without a body (vLLM's /reset_prefix_cache,
    /start_profile, /stop_profile): an error status is returned, not raised
    (a connection that fails raises OSError)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"),
                                    timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def post_json(base_url_or_engine: Any, path: str, body: Mapping[str, Any],
              timeout: float = 600, api_key: str | None = None) -> dict:
    """The decoded JSON answer of a POST of `body` to `path` of a server, given
    by its URL or by an engine (whose `base_url` and `api_key` are used; an
    explicit `api_key` wins). An HTTP error status raises `ServerError`
    naming the URL, the status and the start of the body."""
    base_url = base_url_or_engine
    if not isinstance(base_url_or_engine, str):
        base_url = base_url_or_engine.base_url
        api_key = api_key or getattr(base_url_or_engine, "api_key", None)
    url = base_url.rstrip("/") + path
    req = _request(url, json.dumps(body).encode(), api_key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url} answered HTTP {exc.code}: {exc.read()[:500]!r}") from exc


def fetch_raw(url: str, body: Mapping[str, Any], timeout: float = 120.0,
              ssl_context=None) -> tuple[dict, bytes]:
    """POST `body` as JSON and return (headers, the whole body's bytes) as they
    came, whatever the status: for looking at wire formats (SSE framing)."""
    import httpx
    with httpx.Client(timeout=timeout, verify=ssl_context or True) as client:
        resp = client.post(url, json=dict(body))
        return dict(resp.headers), resp.content
