"""Prompts: the shipped datasets, synthetic prompts of exact token lengths, and
the unmeasured warm-up requests an engine gets before it is timed.

Exact lengths use the served model's tokenizer: the local one (transformers)
when the lab started the engine, or the server's `/tokenize` endpoint when it
is remote, so "a 512-token prefix" means 512 tokens to the engine.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .client import Client, Load, RequestSpec
from .paths import DATASETS_DIR

# --------------------------------------------------------------------------
# A schedule: requests and when each is sent
# --------------------------------------------------------------------------

@dataclass
class Schedule:
    """Requests and their send times (s from the run start), sorted by time
    (stable: requests due at the same moment keep their order). `load`
    releases them (`Load.at`), so every arm that gets the same schedule
    receives the same requests at the same moments."""
    specs: list[RequestSpec]
    offsets: list[float]
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.specs) != len(self.offsets):
            raise ValueError(f"{len(self.specs)} requests but {len(self.offsets)} offsets")
        order = sorted(range(len(self.specs)), key=lambda i: self.offsets[i])
        self.specs = [self.specs[i] for i in order]
        self.offsets = [float(self.offsets[i]) for i in order]

    @property
    def load(self) -> Load:
        return Load.at(self.offsets)

    def count(self, tag: str) -> int:
        return sum(s.tag == tag for s in self.specs)

    def only(self, tag: str) -> Schedule:
        """The requests of one class, at their own times."""
        keep = [i for i, s in enumerate(self.specs) if s.tag == tag]
        return Schedule([self.specs[i] for i in keep], [self.offsets[i] for i in keep],
                        f"{self.description} ({tag} only)" if self.description else "")

    def with_priority(self, by_tag: dict[str, int | None]) -> Schedule:
        """The same requests with vLLM's `priority` field set per class (a tag
        missing from `by_tag`, or None, leaves the field out)."""
        return Schedule([dataclasses.replace(s, priority=by_tag.get(s.tag)) for s in self.specs],
                        list(self.offsets), self.description)

    def frame(self):
        import pandas as pd
        return pd.DataFrame({"arrival_s": self.offsets, "tag": [s.tag for s in self.specs],
                             "max_tokens": [s.max_tokens for s in self.specs],
                             "priority": [s.priority for s in self.specs]})


# --------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------

def dataset_path(name: str) -> Path:
    path = DATASETS_DIR / name
    if not path.is_file():
        have = sorted(p.name for p in DATASETS_DIR.glob("*.json*"))
        raise FileNotFoundError(f"no dataset {name!r} in {DATASETS_DIR}; available: {have}")
    return path


@functools.cache
def _load(name: str) -> Any:
    path = dataset_path(name)
    if path.suffix == ".jsonl":
        return tuple(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return json.loads(path.read_text())


def chat_questions() -> list[dict]:
    return list(_load("chat_questions.jsonl"))


def long_documents() -> list[dict]:
    return list(_load("long_documents.jsonl"))


def code_edit_prompts() -> list[dict]:
    return list(_load("code_edit_prompts.jsonl"))


def quality_questions() -> list[dict]:
    return list(_load("quality_questions.jsonl"))


def answer_is_correct(answer: str | None, expected: Sequence[str]) -> bool:
    """quality_questions.jsonl's rule: the lower-cased answer contains one of
    the expected strings."""
    text = (answer or "").lower()
    return any(e.lower() in text for e in expected)


def system_prompts() -> dict:
    return dict(_load("system_prompts.json"))


def warmup_prefixes() -> list[str]:
    return list(_load("warmup_prefixes.json")["prefixes"])


def chat(question: str, system: str | None = None) -> list[dict[str, str]]:
    """OpenAI chat messages for one question, with an optional system prompt."""
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": question}]


def chat_specs(n: int, *, max_tokens: int = 32, system: str | None = None, seed: int = 0,
               tag: str = "chat", **kw: Any) -> list[RequestSpec]:
    """`n` short chat requests drawn (seeded, cycling) from chat_questions.jsonl."""
    qs = chat_questions()
    random.Random(seed).shuffle(qs)
    return [RequestSpec(messages=chat(qs[i % len(qs)]["question"], system), max_tokens=max_tokens,
                        tag=tag, **kw) for i in range(n)]


def document_specs(n: int, *, max_tokens: int = 32, seed: int = 0, tag: str = "long",
                   question: str = "Summarize the document above in two sentences.",
                   **kw: Any) -> list[RequestSpec]:
    """`n` long-prompt chat requests (one shipped document each, cycling)."""
    docs = long_documents()
    random.Random(seed).shuffle(docs)
    return [RequestSpec(messages=chat(f"{docs[i % len(docs)]['text']}\n\n{question}"),
                        max_tokens=max_tokens, tag=tag, **kw) for i in range(n)]


def code_edit_specs(n: int, *, max_tokens: int = 256, tag: str = "code_edit",
                    **kw: Any) -> list[RequestSpec]:
    """Code-editing requests whose answers repeat much of their input."""
    items = code_edit_prompts()
    return [RequestSpec(messages=chat(f"{it['instruction']}\n\n```{it['language']}\n"
                                      f"{it['code']}\n```"),
                        max_tokens=max_tokens, tag=tag, **kw)
            for it in (items[i % len(items)] for i in range(n))]


# --------------------------------------------------------------------------
# Tokenizers and exact-length synthetic prompts
# --------------------------------------------------------------------------

class Tokenizer:
    """encode/decode with the served model's tokenizer (no special tokens)."""

    def __init__(self, encode, decode, name: str):
        self.encode, self.decode, self.name = encode, decode, name

    def count(self, text: str) -> int:
        return len(self.encode(text))


@functools.lru_cache(maxsize=8)
def local_tokenizer(model_path: str) -> Tokenizer:
    """The tokenizer of a local model folder: its `tokenizer.json` read by the
    `tokenizers` library (what transformers' fast tokenizer wraps) where that
    gives what transformers gives, else transformers' AutoTokenizer. Loading
    transformers takes ~4 s of a notebook kernel (2-core AMD EPYC); `tokenizers`
    ~0.1 s. tests/test_workloads.py checks both give the same ids and text."""
    fast = _tokenizer_json(Path(model_path))
    if fast is not None:
        return Tokenizer(lambda t: fast.encode(t, add_special_tokens=False).ids,
                         lambda ids: fast.decode(list(ids), skip_special_tokens=False),
                         model_path)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    return Tokenizer(lambda t: tok(t, add_special_tokens=False).input_ids,
                     lambda ids: tok.decode(ids), model_path)


def _tokenizer_json(folder: Path):
    """`folder/tokenizer.json` as a `tokenizers.Tokenizer`, or None where
    transformers would change what it gives: no such file, or a
    tokenizer_config.json asking for the clean-up of spaces after decoding
    (transformers' default is none) or naming another tokenizer class than the
    fast one."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    cls = str(config.get("tokenizer_class") or "TokenizersBackend")
    if config.get("clean_up_tokenization_spaces") or not (
            cls == "TokenizersBackend" or cls.endswith("Fast")):
        return None
    from tokenizers import Tokenizer as RustTokenizer
    return RustTokenizer.from_file(str(path))


def server_tokenizer(base_url: str, model: str, api_key: str | None = None) -> Tokenizer:
    """vLLM's /tokenize and /detokenize endpoints, for remote targets."""
    import urllib.request

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(base_url.rstrip("/") + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    return Tokenizer(
        lambda t: post("/tokenize", {"model": model, "prompt": t, "add_special_tokens": False})["tokens"],
        lambda ids: post("/detokenize", {"model": model, "tokens": list(ids)})["prompt"],
        f"{base_url} /tokenize")


def served_tokenizer(ctx) -> Tokenizer:
    """The tokenizer of a notebook's main model, without starting an engine
    on local profiles (every arm of a notebook serves the same tokenizer);
    on a remote one, the server's (/tokenize)."""
    if not ctx.profile.is_remote:
        return local_tokenizer(ctx.profile.model_for())
    return tokenizer_for(ctx.engine())


def tokenizer_for(engine) -> Tokenizer:
    if engine.model_path and Path(engine.model_path).exists():
        return local_tokenizer(engine.model_path)
    if engine.model_path and engine.server is not None:  # a hub id served locally
        return local_tokenizer(engine.model_path)
    return server_tokenizer(engine.base_url, engine.model, engine.api_key)


@functools.lru_cache(maxsize=1)
def _corpus_text() -> str:
    return "\n\n".join(d["text"] for d in long_documents())


def exact_text(tok: Tokenizer, n_tokens: int, *, offset: int = 0) -> str:
    """Text that encodes to exactly `n_tokens` tokens, cut from the shipped
    documents starting near token `offset` (different offsets = different text)."""
    if n_tokens <= 0:
        return ""
    ids = _corpus_ids(tok)
    need = n_tokens + 8
    for shift in range(0, 64, 3):  # a cut inside a word can re-tokenize differently
        start = (offset + shift) % max(1, len(ids) - need)
        window = (ids * (1 + (start + need) // len(ids)))[start:start + need]
        for extra in range(8):
            for take in (n_tokens + extra, n_tokens - extra):
                if take <= 0:
                    continue
                text = tok.decode(window[:take])
                if tok.count(text) == n_tokens:
                    return text
    raise ValueError(f"could not build a {n_tokens}-token text at offset {offset}")


_IDS_CACHE: dict[str, list[int]] = {}


def _corpus_ids(tok: Tokenizer) -> list[int]:
    if tok.name not in _IDS_CACHE:
        _IDS_CACHE[tok.name] = list(tok.encode(_corpus_text()))
    return _IDS_CACHE[tok.name]


def shared_prefix_prompts(tok: Tokenizer, n: int, prefix_tokens: int, suffix_tokens: int,
                          *, seed: int = 0) -> list[str]:
    """`n` prompts that share their first `prefix_tokens` tokens exactly and
    differ after it (each `suffix_tokens` long). Checked by re-tokenizing."""
    prefix = exact_text(tok, prefix_tokens, offset=seed * 7919) if prefix_tokens else ""
    prefix_ids = tok.encode(prefix)
    cut = len(prefix_ids)
    prompts: list[str] = []
    next_tokens: set[int] = set()
    rng = random.Random(seed)
    attempts = 0
    while len(prompts) < n:
        attempts += 1
        if attempts > 20 * n:
            raise ValueError("could not build prompts whose shared prefix survives tokenization")
        # A space (not a newline) joins them: BPE tokenizers fold it into the
        # suffix's first token, so it is not one more shared token.
        suffix = exact_text(tok, suffix_tokens, offset=rng.randrange(1, 10**6))
        text = prefix + " " + suffix.lstrip() if prefix else suffix
        ids = tok.encode(text)
        # The prefix must survive tokenization, and the first token after it must
        # differ between prompts, so exactly `prefix_tokens` tokens are shared.
        if ids[:cut] != prefix_ids or abs(len(ids) - (prefix_tokens + suffix_tokens)) > 2:
            continue
        if cut and (len(ids) <= cut or ids[cut] in next_tokens):
            continue
        if cut:
            next_tokens.add(ids[cut])
        prompts.append(text)
    return prompts


def synthetic_specs(tok: Tokenizer, n: int, input_tokens: int, *, max_tokens: int = 32,
                    prefix_tokens: int = 0, seed: int = 0, tag: str = "synthetic",
                    ignore_eos: bool = True, **kw: Any) -> list[RequestSpec]:
    """Completions requests of (about) `input_tokens` prompt tokens, the first
    `prefix_tokens` of them shared; `ignore_eos` fixes the output length."""
    if prefix_tokens > input_tokens:
        raise ValueError(f"prefix_tokens ({prefix_tokens}) > input_tokens ({input_tokens})")
    prompts = shared_prefix_prompts(tok, n, prefix_tokens, input_tokens - prefix_tokens, seed=seed)
    return [RequestSpec(prompt=p, max_tokens=max_tokens, tag=tag, ignore_eos=ignore_eos, **kw)
            for p in prompts]


def count_chat_tokens(tok: Tokenizer, texts: Sequence[str]) -> list[int]:
    return [tok.count(t) for t in texts]


# --------------------------------------------------------------------------
# Warming engines up before anything is timed
# --------------------------------------------------------------------------

#: The warm-up prompt (`{i}`: the request's index). Not from the datasets: a
#: measured prompt finds no more of it in the prefix cache than the opening of
#: the chat template, which any earlier request would have left there too.
WARM_UP_PROMPT = "Warm-up {i}: count from one to twenty in words."

#: A ramp: 16 short requests 50 ms apart, so the number running rises and
#: falls through the batch sizes a concurrent workload reaches (a fresh CPU
#: engine can stall for seconds the first time it meets a larger batch).
WARM_UP_RAMP = {"requests": 16, "max_tokens": 12, "spacing_s": 0.05}

_WARMED: set[str] = set()


def warm_up(engines: Any, requests: int = 1, *, max_tokens: int = 4, spacing_s: float = 0.0,
            prompt: str = WARM_UP_PROMPT, api: str = "chat", once: bool = False) -> None:
    """Send `requests` unmeasured requests to each engine (one engine, or an
    iterable of them), `spacing_s` apart, each decoding exactly `max_tokens`
    tokens: the first requests through a fresh engine pay one-time costs
    (on the CPU backend also the first time it meets a larger batch) that
    would land on whichever arm happened to meet them first. `prompt` is sent
    as a chat message (`api="chat"`) or as a completions prompt
    (`api="completions"`); with `once`, an engine warmed up before (same URL)
    is skipped. Not the article's start-up routine that 03 measures."""
    if api not in ("chat", "completions"):
        raise ValueError(f"api must be 'chat' or 'completions', got {api!r}")
    if hasattr(engines, "base_url"):
        engines = [engines]
    for engine in engines:
        if once and engine.base_url in _WARMED:
            continue
        specs = []
        for i in range(requests):
            text = prompt.format(i=i)
            body = {"messages": chat(text)} if api == "chat" else {"prompt": text}
            specs.append(RequestSpec(**body, max_tokens=max_tokens, ignore_eos=True,
                                     tag="warm-up"))
        Client.for_engine(engine).run(specs, Load.at([i * spacing_s for i in range(requests)]),
                                      label="warm-up", progress=False)
        _WARMED.add(engine.base_url)
