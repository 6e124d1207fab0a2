"""`lab_utils.http` against a small local HTTP server: GET status and body,
JSON POST with the engine's key, and the ServerError an error status raises."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import lab_utils as lab
from lab_utils.errors import ServerError
from lab_utils.http import http_get, post_json


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, {"auth": self.headers.get("Authorization")})
        else:
            self._answer(404, {"error": "no such path"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions":
            self._answer(200, {"echo": body, "auth": self.headers.get("Authorization"),
                               "type": self.headers.get("Content-Type")})
        else:
            self._answer(400, {"error": {"message": "maximum context length is 4096 tokens"}})


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_get_returns_error_statuses(url):
    status, body = http_get(url + "/health", api_key="k")
    assert status == 200 and json.loads(body) == {"auth": "Bearer k"}
    status, body = http_get(url + "/nope")
    assert status == 404 and b"no such path" in body


def test_post_json_to_a_url_or_an_engine(url):
    out = post_json(url + "/", "/v1/completions", {"prompt": "hi"})
    assert out == {"echo": {"prompt": "hi"}, "auth": None, "type": "application/json"}
    engine = SimpleNamespace(base_url=url, api_key="secret")
    assert post_json(engine, "/v1/completions", {})["auth"] == "Bearer secret"
    assert post_json(engine, "/v1/completions", {}, api_key="other")["auth"] == "Bearer other"


def test_post_json_error_names_the_url_and_status(url):
    with pytest.raises(ServerError, match=rf"{url}/v1/chat answered HTTP 400: .*4096") as info:
        post_json(url, "/v1/chat", {"x": 1})
    assert isinstance(info.value, lab.ServerError)


def test_server_error_is_one_class_everywhere():
    from lab_utils.counters import ServerError as from_counters
    from lab_utils.server import ServerError as from_server
    assert from_server is from_counters is lab.ServerError is ServerError
