"""A stand-in for a vLLM server started by hand with default flags, for the
remote-profile tests: every notebook's smoke parameters run against it and
must end without a traceback (tests/test_remote_notebooks.py).

It answers what notebooks ask a real server, in vLLM's shapes: /v1/models
(with max_model_len), /version, /tokenize and /detokenize (word pieces,
`encode`), streaming and non-streaming chat and text completions (as many
tokens as `max_tokens` asks, up to MAX_TOKENS; logprobs and prompt_logprobs
when asked), and /metrics with the families the lab reads: the cache config
(prefix caching on, 16-token blocks), prefix-cache queries and hits (counted:
full 16-token blocks of a prompt that an earlier prompt with the same
`cache_salt` began with), requests running and waiting, request successes,
token totals and the TTFT histogram. Like a default vLLM server it schedules
first-come-first-served (vLLM 0.32 takes a request's `priority` there and
ignores it), and it refuses what vLLM refuses: another model's name (404), an
unknown role, a request longer than the context (400).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from typing import Any

from aiohttp import web
from fake_openai import FakeOpenAI

MODEL = "fake-model"
MAX_MODEL_LEN = 4096
BLOCK = 16
MAX_TOKENS = 64           # longest answer, whatever max_tokens asks
TOKEN_GAP_S = 0.002
FIRST_S = 0.005
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


#: A word-piece tokenizer, like BPE in what notebooks rely on: a space joins
#: the piece after it, long words are cut in pieces of at most 6 characters;
#: ids are handed out on first sight (one vocabulary per process).
PIECE = re.compile(r"\s?[^\s]{1,6}|\s")
_VOCAB: dict[str, int] = {}
_PIECES: list[str] = []


def encode(text: str) -> list[int]:
    out = []
    for piece in PIECE.findall(text):
        if piece not in _VOCAB:
            _VOCAB[piece] = len(_PIECES)
            _PIECES.append(piece)
        out.append(_VOCAB[piece])
    return out


def decode(ids: list[int]) -> str:
    return "".join(_PIECES[int(i)] if 0 <= int(i) < len(_PIECES) else "?" for i in ids)


class FakeVLLM(FakeOpenAI):
    def __init__(self, prompt_tokens_details: bool = False) -> None:
        super().__init__()
        #: usage's cached-token count, which vLLM sends only when started with
        #: --enable-prompt-tokens-details (not by default)
        self.prompt_tokens_details = prompt_tokens_details
        self.blocks: set[str] = set()
        self.counts = {"queries": 0, "hits": 0, "prompt": 0, "generation": 0, "success": 0}
        self.ttfts: list[float] = []
        self.running = 0

    def add_routes(self, router: web.UrlDispatcher) -> None:
        super().add_routes(router)
        router.add_get("/version", self._version)
        router.add_get("/metrics", self._metrics)
        router.add_post("/tokenize", self._tokenize)
        router.add_post("/detokenize", self._detokenize)

    # -- endpoints -------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "root": MODEL, "max_model_len": MAX_MODEL_LEN}]})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fake"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or self._messages_text(body.get("messages") or [])
        ids = encode(text)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": decode(body.get("tokens") or [])})

    async def _metrics(self, request: web.Request) -> web.Response:
        c, m = self.counts, f'model_name="{MODEL}",engine="0"'
        lines = [
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{BLOCK}",cache_dtype="auto",'
            'enable_prefix_caching="True",num_gpu_blocks="4096",'
            f'kv_cache_size_tokens="{4096 * BLOCK}",engine="0"}} 1.0',
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{m}}} {float(self.running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{m}}} 0.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{m}}} 0.0"]
        for name, key in (("prefix_cache_queries", "queries"), ("prefix_cache_hits", "hits"),
                          ("prompt_tokens", "prompt"), ("generation_tokens", "generation")):
            # prometheus_client (vLLM's) names a counter's TYPE line with _total
            lines += [f"# TYPE vllm:{name}_total counter",
                      f"vllm:{name}_total{{{m}}} {float(c[key])}"]
        lines += ["# TYPE vllm:request_success_total counter",
                  f'vllm:request_success_total{{finished_reason="length",{m}}} {float(c["success"])}',
                  "# TYPE vllm:time_to_first_token_seconds histogram"]
        for le in (*TTFT_BUCKETS, float("inf")):
            n = sum(1 for t in self.ttfts if t <= le)
            label = "+Inf" if le == float("inf") else repr(le)
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{le="{label}",{m}}} {float(n)}')
        lines += [f"vllm:time_to_first_token_seconds_count{{{m}}} {float(len(self.ttfts))}",
                  f"vllm:time_to_first_token_seconds_sum{{{m}}} {float(sum(self.ttfts))}"]
        return web.Response(text="\n".join(lines) + "\n",
                            content_type="text/plain", charset="utf-8")

    # -- completions -------------------------------------------------------------
    @staticmethod
    def _messages_text(messages: list[dict]) -> str:
        return "".join(f"<{m.get('role')}>{m.get('content') or ''}" for m in messages)

    def _prompt_ids(self, body: dict) -> list[int]:
        if "messages" in body:
            return encode(self._messages_text(body["messages"]))
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            return [int(i) for i in prompt] if prompt and isinstance(prompt[0], int) else \
                encode("".join(map(str, prompt)))
        return encode(str(prompt))

    def _cached(self, ids: list[int], salt: str) -> int:
        """Prefix-cache bookkeeping: the prompt's full blocks that an earlier
        prompt (same salt) began with count as hits; all are remembered."""
        hits, h, still = 0, hashlib.sha1(salt.encode()), True
        for start in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            h.update(json.dumps(ids[start:start + BLOCK]).encode())
            key = h.hexdigest()
            if still and key in self.blocks:
                hits += BLOCK
            else:
                still = False
            self.blocks.add(key)
        self.counts["queries"] += len(ids)
        self.counts["hits"] += hits
        return hits

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"path": request.path, "body": body, "time": time.perf_counter(),
                              "authorization": request.headers.get("Authorization")})
        if body.get("model") != MODEL:
            return self._error(f"The model `{body.get('model')}` does not exist.", 404,
                               "NotFoundError")
        roles = {m.get("role") for m in body.get("messages") or []}
        if roles - {"system", "user", "assistant", "tool", "developer"}:
            return self._error(f"unknown role(s) {sorted(roles)}", 400)
        ids = self._prompt_ids(body)
        asked = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if len(ids) + asked > MAX_MODEL_LEN or asked < 1:
            return self._error(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                               f"However, you requested {len(ids) + asked} tokens "
                               f"({len(ids)} in the messages, {asked} in the completion).", 400)
        cached = self._cached(ids, str(body.get("cache_salt") or ""))
        n = max(1, min(asked, MAX_TOKENS))
        chat = request.path.endswith("/chat/completions")
        self.running += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        t0 = time.perf_counter()
        try:
            if body.get("stream"):
                return await self._stream(request, body, ids, cached, n, chat, t0)
            return await self._whole(body, ids, cached, n, chat, t0)
        finally:
            self.running -= 1
            self.in_flight -= 1
            self.counts["success"] += 1
            self.counts["prompt"] += len(ids)
            self.counts["generation"] += n

    @staticmethod
    def _error(message: str, code: int, kind: str = "BadRequestError") -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                            "code": code}}, status=code)

    def _usage(self, ids: list[int], cached: int, done: int) -> dict:
        usage = {"prompt_tokens": len(ids), "completion_tokens": done,
                 "total_tokens": len(ids) + done}
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    @staticmethod
    def _logprobs(chat: bool, piece: str) -> dict:
        if chat:
            return {"content": [{"token": piece, "logprob": -0.5, "bytes": list(piece.encode()),
                                 "top_logprobs": [{"token": piece, "logprob": -0.5}]}]}
        return {"tokens": [piece], "token_logprobs": [-0.5], "text_offset": [0],
                "top_logprobs": [{piece: -0.5}]}

    async def _stream(self, request, body, ids, cached, n, chat, t0) -> web.StreamResponse:
        resp, send = await self._open(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage_each = (body.get("stream_options") or {}).get("continuous_usage_stats")
        await asyncio.sleep(FIRST_S)
        if chat:
            await send({"id": "c", "object": kind, "created": 0, "model": MODEL, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]})
        for i in range(1, n + 1):
            if i > 1:
                await asyncio.sleep(TOKEN_GAP_S)
            else:
                self.ttfts.append(time.perf_counter() - t0)
            piece = f" w{i}"
            choice = {"index": 0, "logprobs": self._logprobs(chat, piece)
                      if body.get("logprobs") else None,
                      "finish_reason": "length" if i == n else None}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            chunk = {"id": "c", "object": kind, "created": 0, "model": MODEL, "choices": [choice]}
            if usage_each:
                chunk["usage"] = self._usage(ids, cached, i)
            await send(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": "c", "object": kind, "created": 0, "model": MODEL, "choices": [],
                        "usage": self._usage(ids, cached, n)})
        await send("[DONE]")
        return resp

    async def _whole(self, body, ids, cached, n, chat, t0) -> web.Response:
        await asyncio.sleep(FIRST_S + TOKEN_GAP_S * (n - 1))
        self.ttfts.append(FIRST_S)
        text = "".join(f" w{i}" for i in range(1, n + 1))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": -1.0, "rank": 1, "decoded_token": decode([t])}}
                for t in ids[1:]]
        return web.json_response({"id": "c", "object": "chat.completion" if chat else
                                  "text_completion", "created": 0, "model": MODEL,
                                  "choices": [choice], "usage": self._usage(ids, cached, n)})


__all__ = ["FakeVLLM", "MODEL"]
if __name__ == "__main__":  # python tests/fake_vllm.py: serve until Ctrl-C
    fake = FakeVLLM().start()
    print(json.dumps({"base_url": fake.base_url}), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        fake.stop()
