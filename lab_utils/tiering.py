"""Model tiering: send each request to a small, fast model or to the large one.

The article's "模型分层" (model tiering) routes easy requests to a smaller
model. `Router` decides per request with one documented rule, applied in order:

1. **Task type.** A request whose tag (`RequestSpec.tag`) is one of
   `TierRule.large_tasks` (by default "code" and "document") goes to the large
   model: these are the tasks a small model gets wrong first.
2. **Prompt length.** A prompt longer than `TierRule.max_small_prompt_tokens`
   goes to the large model (long context is where small models fall apart, and
   where the large model's prefill is the cost being avoided, so the threshold
   is the knob that trades quality for TTFT).
3. **Everything else goes to the small model.** If `TierRule.min_confidence`
   is set, the small model's answer must also earn its place: the router holds
   back its first `probe_tokens` tokens and computes their mean log-probability
   (vLLM returns it per token with `logprobs: true`). At or above the
   threshold the held tokens are released and the stream continues; below it
   the router hangs up (vLLM aborts the generation) and asks the large model,
   so that request pays the probe's time on top of the large model's TTFT.

`TieredClient` is a `lab_utils.Client` that applies the router to every
request it sends, so every load shape (`Load`) works unchanged. Its records
are what the *user* sees: for a request escalated after a probe, TTFT counts
from the original send to the large model's first token; for a probed request
that stays small, TTFT is when the probe's tokens are released. Each record's
`route` says which model answered and why.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from .client import Client, RequestRecord, RequestSpec
from .profiles import ConfigError

SMALL, LARGE = "small", "large"


@dataclass(frozen=True)
class TierRule:
    """The router's rule (see the module docstring for the order)."""
    large_tasks: tuple[str, ...] = ("code", "document")
    max_small_prompt_tokens: int = 256
    min_confidence: float | None = None   # mean log-prob per token; None: no probe
    probe_tokens: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.large_tasks, str):
            raise ConfigError(f"large_tasks must be a sequence of task tags, not the string "
                              f"{self.large_tasks!r}: write large_tasks=({self.large_tasks!r},)")
        object.__setattr__(self, "large_tasks", tuple(self.large_tasks))
        if not isinstance(self.max_small_prompt_tokens, int) or self.max_small_prompt_tokens < 0:
            raise ConfigError("max_small_prompt_tokens must be an int >= 0 (0 sends every "
                              f"prompt to the large model), got {self.max_small_prompt_tokens!r}")
        if self.min_confidence is not None and not (
                isinstance(self.min_confidence, (int, float)) and self.min_confidence <= 0):
            raise ConfigError("min_confidence is a mean log-probability, so <= 0 (e.g. -0.5), "
                              f"or None for no probe; got {self.min_confidence!r}")
        if not isinstance(self.probe_tokens, int) or self.probe_tokens < 1:
            raise ConfigError(f"probe_tokens must be an int >= 1, got {self.probe_tokens!r}")

    @property
    def probes(self) -> bool:
        return self.min_confidence is not None

    def describe(self) -> str:
        text = (f"tasks {', '.join(self.large_tasks) or '(none)'} -> large; prompts over "
                f"{self.max_small_prompt_tokens} tokens -> large; the rest -> small")
        if self.probes:
            text += (f", escalated to large when the mean log-prob of its first "
                     f"{self.probe_tokens} tokens is below {self.min_confidence:g}")
        return text


@dataclass(frozen=True)
class Decision:
    tier: str       # SMALL or LARGE, before any probe
    reason: str


def confidence(logprobs: Sequence[float], n: int | None = None) -> float:
    """Mean log-probability of the first `n` (default all) sampled tokens;
    nan if there are none. exp() of it is the geometric-mean token probability."""
    values = list(logprobs)[:n] if n else list(logprobs)
    return sum(values) / len(values) if values else math.nan


def prompt_text(spec: RequestSpec) -> str:
    """The text a router measures: the messages' contents (or the prompt)."""
    if spec.messages is not None:
        return "\n".join(str(m.get("content", "")) for m in spec.messages)
    return spec.prompt if isinstance(spec.prompt, str) else ""


class Router:
    """Routes `RequestSpec`s with a `TierRule`; `count_tokens(text)` measures
    prompts (the large model's tokenizer, e.g. `lab.tokenizer_for(engine).count`)."""

    def __init__(self, rule: TierRule, count_tokens: Callable[[str], int]):
        self.rule, self.count_tokens = rule, count_tokens

    def prompt_tokens(self, spec: RequestSpec) -> int:
        if spec.prompt is not None and not isinstance(spec.prompt, str):
            return len(spec.prompt)  # already token ids
        return self.count_tokens(prompt_text(spec))

    def route(self, spec: RequestSpec) -> Decision:
        if spec.tag in self.rule.large_tasks:
            return Decision(LARGE, f"task {spec.tag}")
        n = self.prompt_tokens(spec)
        if n > self.rule.max_small_prompt_tokens:
            return Decision(LARGE, f"prompt {n} > {self.rule.max_small_prompt_tokens} tokens")
        return Decision(SMALL, f"prompt {n} tokens")

    def confident(self, logprobs: Sequence[float]) -> bool:
        """The probe's verdict (True when there is no probe)."""
        if not self.rule.probes:
            return True
        c = confidence(logprobs, self.rule.probe_tokens)
        return not math.isnan(c) and c >= self.rule.min_confidence


def held_until(rec: RequestRecord, tokens: int) -> float | None:
    """Seconds from send until the record had `tokens` output tokens (or
    finished with fewer): when a probe of that many tokens can be judged."""
    for t, n in zip(rec.chunk_times, rec.chunk_tokens):
        if n >= tokens:
            return t
    return rec.e2e


def released(rec: RequestRecord, tokens: int) -> RequestRecord:
    """The user-seen record of a probed answer that stays: its first `tokens`
    tokens appear together when the probe is judged."""
    t = held_until(rec, tokens)
    if t is None or rec.ttft is None:
        return rec
    keep = [i for i, ct in enumerate(rec.chunk_times) if ct > t]
    itl = [rec.chunk_times[keep[0]] - t] if keep else []
    itl += [rec.chunk_times[b] - rec.chunk_times[a] for a, b in itertools.pairwise(keep)]
    return dataclasses.replace(rec, ttft=t, itl=itl)


def escalated(probe: RequestRecord, final: RequestRecord, offset_s: float) -> RequestRecord:
    """The user-seen record of a request answered by the large model after a
    failed probe: `final`'s stream, shifted by `offset_s` (send of the probe to
    send of the large request)."""
    def shift(x: float | None) -> float | None:
        return None if x is None else x + offset_s

    return dataclasses.replace(
        final, index=probe.index, label=probe.label, send_time=probe.send_time,
        start=probe.start, ttft=shift(final.ttft), e2e=shift(final.e2e),
        chunk_times=[t + offset_s for t in final.chunk_times])


class TieredClient(Client):
    """A `Client` whose every request goes through a `Router` to one of two
    OpenAI-compatible servers (see the module docstring)."""

    def __init__(self, small: Client, large: Client, router: Router, **kw):
        super().__init__(large.base_url, large.model, api_key=large.api_key, **kw)
        if small.api_key != large.api_key:
            raise ConfigError("the two tiers need the same API key (the client sends one "
                              "Authorization header per session)")
        self.small, self.large, self.router = small, large, router

    @classmethod
    def for_engines(cls, small_engine, large_engine, router: Router, **kw) -> TieredClient:
        return cls(Client.for_engine(small_engine), Client.for_engine(large_engine), router, **kw)

    async def send(self, session: aiohttp.ClientSession, spec: RequestSpec,
                   index: int = 0, label: str = "", *, stop_when=None) -> RequestRecord:
        decision = self.router.route(spec)
        if decision.tier == LARGE:
            rec = await self.large.send(session, spec, index, label, stop_when=stop_when)
            rec.route = f"{LARGE} ({decision.reason})"
            return rec
        rule = self.router.rule
        if not rule.probes:
            rec = await self.small.send(session, spec, index, label, stop_when=stop_when)
            rec.route = f"{SMALL} ({decision.reason})"
            return rec
        probed = dataclasses.replace(spec, extra={**spec.extra, "logprobs": True})
        verdict: dict[str, bool] = {}

        def judge(r: RequestRecord) -> bool:
            if "keep" not in verdict and len(r.logprobs) >= rule.probe_tokens:
                verdict["keep"] = self.router.confident(r.logprobs)
            return verdict.get("keep") is False  # hang up on a failed probe

        rec = await self.small.send(session, probed, index, label, stop_when=judge)
        c = confidence(rec.logprobs, rule.probe_tokens)
        if not rec.ok:
            rec.route = f"{SMALL} ({decision.reason}; failed)"
            return rec
        if "keep" not in verdict:  # finished before the probe was full: judge what there is
            verdict["keep"] = self.router.confident(rec.logprobs)
        if verdict["keep"]:
            out = released(rec, rule.probe_tokens)
            out.route = f"{SMALL} ({decision.reason}; confidence {c:.2f})"
            return out
        offset = time.perf_counter() - rec.start
        final = await self.large.send(session, spec, index, label, stop_when=stop_when)
        out = escalated(rec, final, offset)
        out.route = (f"{SMALL}->{LARGE} ({decision.reason}; confidence {c:.2f} < "
                     f"{rule.min_confidence:g})")
        return out


def tier_of(rec: RequestRecord) -> str:
    """"small", "large" or "small->large" from a record's `route`."""
    return rec.route.split(" ", 1)[0] if rec.route else ""


__all__ = ["LARGE", "SMALL", "Decision", "Router", "TierRule", "TieredClient", "confidence",
           "escalated", "held_until", "prompt_text", "released", "tier_of"]
