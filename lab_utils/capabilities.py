"""What this machine's vLLM build can run, measured rather than assumed.

vLLM's CPU wheel carries different kernels for different instruction sets: on
an AVX2-only x86 CPU there is no fp8 KV cache ("FP8 KV cache on CPU requires
x86 with AVX-512 or AMX") and no 4-bit GEMM (`cpu_gemm_wna16` is missing), and
bfloat16 falls back from oneDNN to torch's slow path. A table written on one
machine is wrong on the next, so each *candidate* (a dtype, a quantized
checkpoint format, the fp8 KV cache, a speculative method) is probed here: a
tiny engine start (512-token context, 64 MiB KV cache, the worker inside the
engine-core process) and a few requests —
one greedy question whose answer is checked, the next-token choices on a fixed
text against transformers' float32 ones (`verdict`: a right answer, or the same
numerics where a near tie flipped the answer), and timed requests for the
speed of the path. Results are cached per machine fingerprint (CPU model, ISA,
cores, vLLM and torch versions, `lab_utils.machine.fingerprint`) under
`<cache>/capabilities/`, so each candidate is probed once per machine.

    python -m lab_utils.capabilities                 # probe every candidate, print the table
    python -m lab_utils.capabilities kv_fp8 w4a16_bf16 --refresh

Notebooks call `probe(profile, names)` for the candidates their default arms
need; an arm whose candidate did not run is skipped with the probe's reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .paths import cache_dir, locked, write_atomic
from .profiles import ConfigError, Profile, load_profile

#: The question every candidate answers greedily, and what the answer must contain.
QUESTION = "What is the capital of France?"
EXPECT = "paris"
#: The numerics check beside the question: next-token choices on a fixed text
#: (the first shipped document's first AGREE_TOKENS tokens, teacher-forced)
#: against transformers' float32 ones for the full model. A candidate whose
#: answer misses Paris still runs right where at least AGREE_MIN of them agree:
#: the question's first token is a near tie for the embedded model (float32
#: logits "The" 25.33, "L" 25.24), which bfloat16 rounding can flip; a broken
#: kernel's choices do not agree.
AGREE_TOKENS, AGREE_MIN = 128, 0.8
#: Timed requests per candidate: prompt tokens, output tokens, how many.
TIMED_PROMPT_TOKENS, TIMED_OUTPUT_TOKENS, TIMED_REQUESTS = 256, 16, 3
#: Engine flags of every probe on top of the profile's: small and quick.
PROBE_FLAGS = {"max_model_len": 512, "kv_cache_memory_bytes": 64 * 2**20}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One thing a vLLM build may or may not run. `model` is a profile model
    reference (None = the profile's main model; "quantized:<recipe>" and
    "embedded-<N>L" are built offline by the lab); `draft` likewise names the
    draft model of a speculative candidate."""
    name: str
    kind: str                       # dtype | quantization | kv_cache | speculative
    title: str
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model: str | None = None
    draft: str | None = None


_BF16 = {"dtype": "bfloat16"}
_F32 = {"dtype": "float32"}

CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("float32", "dtype", "float32 weights and activations", dict(_F32)),
    Candidate("bfloat16", "dtype", "bfloat16 weights and activations", dict(_BF16)),
    Candidate("w8a8", "quantization", "W8A8-INT8 checkpoint (compressed-tensors), float32",
              dict(_F32), model="quantized:w8a8"),
    Candidate("w8a8_bf16", "quantization", "W8A8-INT8 checkpoint (compressed-tensors), bfloat16",
              dict(_BF16), model="quantized:w8a8"),
    Candidate("w4a16", "quantization", "W4A16-INT4 checkpoint (compressed-tensors), float32",
              dict(_F32), model="quantized:w4a16"),
    Candidate("w4a16_bf16", "quantization",
              "W4A16-INT4 checkpoint (compressed-tensors), bfloat16", dict(_BF16),
              model="quantized:w4a16"),
    Candidate("gptq_w4_bf16", "quantization", "GPTQ-format INT4 checkpoint, bfloat16",
              {**_BF16, "quantization": "gptq"}, model="quantized:gptq_w4"),
    Candidate("awq_w4_bf16", "quantization", "AWQ-format INT4 checkpoint, bfloat16",
              {**_BF16, "quantization": "awq"}, model="quantized:awq_w4"),
    Candidate("gptq_w8_bf16", "quantization", "GPTQ-format INT8 checkpoint, bfloat16",
              {**_BF16, "quantization": "gptq"}, model="quantized:gptq_w8"),
    Candidate("w8a16_bf16", "quantization", "W8A16-INT8 checkpoint (compressed-tensors), bfloat16",
              dict(_BF16), model="quantized:w8a16"),
    Candidate("int8_online_bf16", "quantization",
              "online INT8 weight-only (int8_per_channel_weight_only), bfloat16",
              {**_BF16, "quantization": "int8_per_channel_weight_only"}),
    Candidate("fp8_online_bf16", "quantization", "online FP8 per channel, bfloat16",
              {**_BF16, "quantization": "fp8_per_channel"}),
    Candidate("kv_fp8", "kv_cache", "fp8 KV cache (--kv-cache-dtype fp8), float32",
              {**_F32, "kv_cache_dtype": "fp8"}),
    Candidate("ngram", "speculative", "n-gram speculative decoding (k=4)",
              {**_F32, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 4, "prompt_lookup_min": 2}}),
    Candidate("draft", "speculative", "draft-model speculative decoding (6-layer cut, k=2)",
              dict(_F32), draft="embedded-6L"),
)}


def candidate(name: str) -> Candidate:
    try:
        return CANDIDATES[name]
    except KeyError:
        raise ConfigError(f"unknown capability {name!r}; choose from {sorted(CANDIDATES)}") from None


# --------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------

def compiled(profile: Profile | None) -> bool:
    """Whether `profile`'s engines compile their model (no `enforce_eager`)."""
    return profile is not None and not profile.engine.get("enforce_eager", False)


def cache_path(fingerprint: str | None = None, profile: Profile | None = None) -> Path:
    """`<cache>/capabilities/<machine fingerprint>.json`, `...-compiled.json` for
    a profile whose engines compile: what runs right can differ between the two
    (on a CPU without AVX512-BF16, bfloat16 gave garbage text compiled and ran
    right eager), so each is probed."""
    from .machine import fingerprint as machine_fingerprint
    suffix = "-compiled" if compiled(profile) else ""
    return cache_dir() / "capabilities" / f"{fingerprint or machine_fingerprint()}{suffix}.json"


def load_cache(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text()).get("results", {})
    except (OSError, ValueError):
        return {}


def save_cache(path: Path, results: Mapping[str, dict]) -> None:
    from .machine import machine_info, summary_line
    # a probe interrupted mid-write keeps the previous file
    write_atomic(path, json.dumps({"machine": summary_line(machine_info()),
                                   "results": dict(results)}, indent=2))


# --------------------------------------------------------------------------
# One probe
# --------------------------------------------------------------------------

def probe_profile(profile: Profile, c: Candidate) -> Profile:
    """The profile a candidate's probe engine uses: the profile's flags and env,
    the candidate's model as role "probe", small context and KV cache, and
    vLLM's worker inside the engine-core process (`cpu_tuning.in_process_env`):
    the same kernels, one process fewer importing vLLM and torch. On the Zen 4
    guest (2 cores, 2026-12-04, two rounds of `python -m lab_utils.capabilities
    float32 w8a8_bf16 --refresh` each way) the probe engines started in 22.0-28.1 s
    against 33.1-35.1 s with a worker process of their own, with the same
    kernels and TPOT within 10% (43.0-43.8 vs 46.4 ms for float32)."""
    models = dict(profile.models)
    if c.model is not None:
        models["probe"] = c.model
    if c.draft is not None:
        models["probe_draft"] = c.draft
    env = {k: v for k, v in profile.env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return dataclasses.replace(profile, models=models, env=env,
                               engine={**profile.engine, **PROBE_FLAGS},
                               cpu_binding={**profile.cpu_binding, "in_process": True})


def _flags(profile: Profile, c: Candidate) -> dict[str, Any]:
    flags = dict(c.flags)
    if c.draft is not None:
        flags["speculative_config"] = {"model": profile.model_for("probe_draft"),
                                       "num_speculative_tokens": 2}
    return flags


def probe_one(profile: Profile, c: Candidate, log_dir: Path) -> dict[str, Any]:
    """Start the candidate's engine, ask the question, time a few requests.

    Status: "ok" (right answer), "wrong answer", "fails" (the engine did not
    start or a request failed: `reason` is the root cause from its log) or
    "refused" (the lab's own flag checks stop it before launch)."""
    from .client import Client, Load
    from .http import post_json
    from .machine import parse_engine_binding
    from .server import EnginePool, ServerError
    from .vllm_logs import parse_server_log, root_cause
    from .workloads import chat, local_tokenizer, synthetic_specs

    row: dict[str, Any] = {"title": c.title, "kind": c.kind,
                           "probed": _dt.datetime.now().isoformat(timespec="seconds")}
    t0 = time.perf_counter()
    p = probe_profile(profile, c)
    pool = EnginePool(p, log_dir=log_dir / c.name)
    pool.shared = False  # a probe starts its own engine: its start is what it measures
    try:
        flags = _flags(p, c)
        engine = pool.get("probe" if c.model else None, **flags)
        row["startup_s"] = round(engine.server.startup_s, 1)
        client = Client.for_engine(engine, timeout_s=120)
        answer = post_json(engine, "/v1/chat/completions", {
            "model": engine.model, "messages": chat(QUESTION), "max_tokens": 12,
            "temperature": 0.0}, timeout=120)["choices"][0]["message"]["content"]
        tok = local_tokenizer(profile.model_for())
        specs = synthetic_specs(tok, TIMED_REQUESTS, TIMED_PROMPT_TOKENS,
                                max_tokens=TIMED_OUTPUT_TOKENS, seed=7)
        run = client.run(specs, Load.sequential(), progress=False)
        failed = [r for r in run.records if not r.ok]
        if failed:
            raise ServerError(failed[0].error or "request failed")
        s = run.summary()
        row.update(answer=answer.strip(), ttft_ms=s["ttft_ms_median"], tpot_ms=s["tpot_ms_median"],
                   **numerics_check(profile, engine))
        row.update(verdict(row))
        log = engine.server.log_path.read_text(errors="replace")
        info = parse_server_log(log)
        row.update(kernels=info.get("kernels", []), quantization=info.get("quantization"),
                   dtype=info.get("dtype"), executor=parse_engine_binding(log).get("executor"))
    except ConfigError as exc:
        row.update(status="refused", reason=str(exc).splitlines()[-1].lstrip("- "))
    except (ServerError, OSError, RuntimeError, ValueError, KeyError) as exc:
        logs = sorted((log_dir / c.name).glob("*.log"), key=lambda f: f.stat().st_mtime)
        text = logs[-1].read_text(errors="replace") if logs else ""
        row.update(status="fails", reason=(root_cause(text) or str(exc).splitlines()[0])[:300])
    finally:
        pool.close()
    row["probe_s"] = round(time.perf_counter() - t0, 1)
    return row


_REFERENCE: dict[tuple, dict] = {}


def numerics_check(profile: Profile, engine) -> dict[str, Any]:
    """The engine's next-token choices on the fixed text against transformers'
    float32 ones for the profile's model: top-1 agreement, perplexity change
    and tokens scored; {} when the reference cannot be computed here (the
    model is not a local folder transformers loads)."""
    from .errors import ServerError
    from .quality import compare_logprobs, prompt_logprobs, reference_scores, text_windows, \
        token_logprobs
    from .workloads import local_tokenizer
    model_dir = profile.model_for()
    if not Path(model_dir).is_dir():
        return {}
    ids = text_windows(local_tokenizer(model_dir), 1, AGREE_TOKENS)[0]
    key = (model_dir, tuple(ids))
    if key not in _REFERENCE:
        try:
            _REFERENCE[key] = reference_scores(model_dir, ids)
        except (ImportError, OSError, ValueError) as exc:
            print(f"numerics check left out: transformers could not run {model_dir}: {exc}",
                  file=sys.stderr)
            return {}
    try:
        logprobs, top1 = token_logprobs(ids, prompt_logprobs(engine, ids))
    except (ServerError, OSError, ValueError, KeyError) as exc:  # the answer alone decides
        print(f"numerics check left out: the engine gave no prompt log-probs: {exc}",
              file=sys.stderr)
        return {}
    c = compare_logprobs(_REFERENCE[key], {"logprobs": logprobs, "top1": top1})
    return {"top1_agreement": round(c["top1_agreement"], 4),
            "ppl_change_pct": round(c["ppl_change_pct"], 2), "agreement_tokens": c["tokens"]}


def verdict(row: Mapping[str, Any]) -> dict[str, str]:
    """Status and reason of a probe that served: "ok" when the answer names
    Paris or the next-token choices agree with float32 transformers on at
    least AGREE_MIN of the fixed text (a near tie flipped by rounding, said in
    `note`), else "wrong answer" with both facts."""
    answer = str(row.get("answer", ""))
    right = EXPECT in answer.lower()
    agree = row.get("top1_agreement")
    numerics = ("" if agree is None else
                f"next-token choices agree with float32 transformers on {agree:.0%} of "
                f"{row.get('agreement_tokens')} tokens of a fixed text")
    if right:
        return {"status": "ok", "reason": ""}
    if agree is not None and agree >= AGREE_MIN:
        return {"status": "ok", "reason": "",
                "note": f"answered {answer!r}, not Paris, yet its {numerics} (at least "
                        f"{AGREE_MIN:.0%} expected): rounding flipped a near tie"}
    return {"status": "wrong answer",
            "reason": f"answered {answer!r}" + (f"; its {numerics} (at least {AGREE_MIN:.0%} "
                                                "expected)" if numerics else "")}


# --------------------------------------------------------------------------
# The table notebooks read
# --------------------------------------------------------------------------

class Capabilities:
    """Probe results for this machine: `ok(name)`, `reason(name)`, `table()`."""

    def __init__(self, results: Mapping[str, dict], device: str = "cpu", machine: str = ""):
        self.results = dict(results)
        self.device = device
        self.machine = machine

    def probed(self, name: str) -> bool:
        return name in self.results

    def ok(self, name: str) -> bool:
        """True only for a candidate probed here that served a right answer."""
        return self.results.get(name, {}).get("status") == "ok"

    def status(self, name: str) -> str:
        return self.results.get(name, {}).get("status", "not probed")

    def reason(self, name: str) -> str:
        """Why a candidate cannot be used here ("" if it can)."""
        r = self.results.get(name)
        if r is None:
            return f"{name!r} was not probed on this machine (python -m lab_utils.capabilities {name})"
        if r.get("status") == "ok":
            return ""
        return f"{r.get('status')} on this machine: {r.get('reason') or '?'}"

    def describe(self, name: str) -> str:
        """One cell of a support table: "ok: <kernels>" or the reason."""
        r = self.results.get(name)
        if r is None:
            return "not probed here"
        if r.get("status") == "ok":
            kernels = ", ".join(r.get("kernels") or [])
            return ("ok" + (f": {kernels}" if kernels else "")
                    + (f" ({r['note']})" if r.get("note") else ""))
        return self.reason(name)

    def fastest(self, names: Iterable[str]) -> str | None:
        """Of the candidates that run here, the one with the lowest time for the
        probe's timed request (TTFT + output tokens x TPOT)."""
        timed = []
        for n in names:
            r = self.results.get(n, {})
            if r.get("status") == "ok" and r.get("ttft_ms") is not None and r.get("tpot_ms") is not None:
                timed.append((r["ttft_ms"] + TIMED_OUTPUT_TOKENS * r["tpot_ms"], n))
        return min(timed)[1] if timed else None

    def table(self, names: Iterable[str] | None = None):
        import pandas as pd
        names = list(names) if names is not None else list(CANDIDATES)
        rows = []
        for n in names:
            r = self.results.get(n, {})
            rows.append({"candidate": n, "title": candidate(n).title, "status": self.status(n),
                         "here": self.describe(n), "ttft_ms": r.get("ttft_ms"),
                         "tpot_ms": r.get("tpot_ms"), "startup_s": r.get("startup_s"),
                         "top1_agreement": r.get("top1_agreement")})
        frame = pd.DataFrame(rows).set_index("candidate")
        frame.attrs["machine"] = self.machine
        return frame


def _claimed(path: Path, names: Sequence[str]) -> Iterator[str]:
    """Each of `names` while this process holds its candidate lock
    (`<cache file>.<name>.lock`). A candidate no other process is probing comes
    first; one another process holds is waited for last. So `make test`'s two
    streams, each wanting some candidates, probe different ones at once, and
    neither probes what the other just did (the caller reads the cache again)."""
    pending = list(names)
    while pending:
        # each pending one without waiting; if all are held elsewhere, wait for the first
        for n, wait in [*((m, False) for m in pending), (pending[0], True)]:
            with locked(path.with_name(f"{path.name}.{n}"), wait=wait) as held:
                if held:
                    pending.remove(n)
                    yield n
                    break


def probe(profile: Profile | str = "cpu", names: Sequence[str] | None = None, *,
          refresh: bool = False, progress: bool = True) -> Capabilities:
    """Probe `names` (default: every candidate) on this machine, reusing cached
    results unless `refresh`. Only local CPU profiles are probed: on `gpu` and
    `remote` the result says so and `ok()` is False for every candidate."""
    from .machine import machine_info, summary_line
    profile = load_profile(profile) if isinstance(profile, str) else profile
    names = list(names) if names is not None else list(CANDIDATES)
    for n in names:
        candidate(n)
    if profile.is_remote or profile.device != "cpu":
        return Capabilities({n: {"status": "not probed",
                                 "reason": f"the probe runs on the cpu profile; profile "
                                           f"{profile.name!r} runs on {profile.device}"}
                             for n in names}, profile.device)
    path = cache_path(profile=profile)
    todo = [n for n in names if refresh or _stale(load_cache(path).get(n))]
    if todo:
        from tqdm.auto import tqdm
        # a bar in a terminal; in a log (CI, make run's output) one line per candidate,
        # not a bar's every redraw
        tty = sys.stderr.isatty()
        bar = tqdm(total=len(todo), desc="probing what this vLLM build runs",
                   disable=not progress or not tty)
        for n in _claimed(path, todo):
            bar.set_postfix_str(n)
            # a process that waited for this candidate reads what the other one probed
            if refresh or _stale(load_cache(path).get(n)):
                row = probe_one(profile, CANDIDATES[n], path.parent / "logs")
                with locked(path):  # after each: an interrupted probe keeps the others
                    results = load_cache(path)
                    results[n] = row
                    save_cache(path, results)
                if progress and not tty:
                    print(f"probed what this vLLM build runs: {n}: {row.get('status')} "
                          f"({row.get('probe_s')} s)", file=sys.stderr, flush=True)
            bar.update()
        bar.close()
    results = load_cache(path)
    return Capabilities({n: results[n] for n in results}, "cpu", summary_line(machine_info()))


def candidate_for(model: str | None, dtype: str, flags: Mapping[str, Any]) -> str | None:
    """The dtype or quantization candidate an engine of `model` (a profile
    model reference, None = the profile's main model) computing in `dtype`
    with `flags` needs: same model, same dtype and the candidate's other flags
    (e.g. `quantization`) equal to the engine's; None when no candidate
    describes it (other models, speculative and KV-cache flags have their own)."""
    for c in CANDIDATES.values():
        if c.kind not in ("dtype", "quantization") or c.model != model or c.draft is not None:
            continue
        extra = {k: v for k, v in c.flags.items() if k != "dtype"}
        if c.flags.get("dtype") == dtype and all(flags.get(k) == v for k, v in extra.items()) \
                and flags.get("quantization") == extra.get("quantization"):
            return c.name
    return None


def arm_why_not(profile: Profile, role: str | None, flags: Mapping[str, Any]) -> str:
    """"" unless an engine of model `role` with `flags` needs a candidate the
    probe found not running on this machine (then the probe's reason, probed
    now if not cached). The main model is checked in another dtype only (e.g.
    bfloat16, which gave garbage text compiled on a CPU without AVX512-BF16):
    in the profile's own it is what every notebook starts, and arms that
    quantize it online name their own candidate (05's `probe`)."""
    if (role is not None and role not in profile.models) or profile.is_remote \
            or profile.device != "cpu":
        return ""
    own = str(profile.engine.get("dtype", "float32"))
    dtype = str(flags.get("dtype", own))
    if role is None and (dtype == own or flags.get("quantization")):
        return ""
    if "enforce_eager" in flags:   # probed the way the arm runs: eager or compiled
        profile = dataclasses.replace(
            profile, engine={**profile.engine, "enforce_eager": bool(flags["enforce_eager"])})
    return why_not(profile, candidate_for(profile.models[role] if role else None, dtype, flags))


def _stale(row: Mapping[str, Any] | None) -> bool:
    """A candidate to probe (again): never probed, or judged "wrong answer" by
    an earlier probe that did not check the numerics (`verdict`)."""
    return row is None or (row.get("status") == "wrong answer" and "top1_agreement" not in row)


def why_not(profile: Profile, name: str | None, caps: Capabilities | None = None) -> str:
    """"" if candidate `name` may run on `profile` (always, off the cpu profile,
    or when there is no candidate), else the probe's reason: from `caps` when
    it probed `name`, else probed once on this machine if it is not cached
    yet. What notebooks call to skip an arm."""
    if name is None or profile.is_remote or profile.device != "cpu":
        return ""
    if caps is not None and caps.probed(name):
        return caps.reason(name)
    return probe(profile, [name]).reason(name)


#: The plan checker's estimates a support table shows off the CPU.
ESTIMATE_COLUMNS = {"model": "model", "checkpoint_format": "checkpoint_format", "dtype": "dtype",
                    "weights_gib": "weights_gib_estimate", "kv_tokens": "kv_tokens_estimate"}


def support_table(arms: Mapping[str, tuple[str, str | None]],
                  caps: Capabilities | None = None, *, profile: Profile | None = None,
                  facts=None):
    """What this machine's vLLM build did with each arm's candidate, for
    `arms` {arm: (title, candidate or None)}: the probe's cached results
    (`caps`, or this machine's cache), "not probed here" for the rest; a
    DataFrame whose `attrs["machine"]` names the machine.

    On a `profile` other than a local cpu one nothing was probed (the probe
    runs on the cpu profile; this machine's CPU results say nothing of a GPU):
    every arm says so, beside the plan checker's estimates `facts` where the
    caller has them (`lab_utils.plan.engine_facts` of the arms' engines: model,
    checkpoint format, weights, KV tokens), and `attrs["machine"]` says where
    those come from."""
    import pandas as pd

    from .machine import machine_info, summary_line
    if profile is not None and (profile.is_remote or profile.device != "cpu"):
        frame = pd.DataFrame({"title": [t for t, _ in arms.values()]},
                             index=pd.Index(list(arms), name="arm"))
        frame.attrs["machine"] = f"profile {profile.name!r}: a server the lab does not start"
        if facts is not None and not profile.is_remote:
            frame = frame.join(facts[[c for c in ESTIMATE_COLUMNS if c in facts]].rename(
                columns=ESTIMATE_COLUMNS))
            frame.attrs["machine"] = facts.attrs["source"]
        frame["on this device"] = (f"not probed on {profile.device} (the probe runs on the cpu "
                                   "profile); the engine's start-up log names the kernel vLLM "
                                   "picks")
        return frame
    if caps is None:
        caps = Capabilities(load_cache(cache_path(profile=profile)))
    rows = [{"arm": name, "title": title, "candidate": cand or "",
             "on this machine": caps.describe(cand) if cand else
             "(no probe candidate: the lab's flag checks decide)"}
            for name, (title, cand) in arms.items()]
    frame = pd.DataFrame(rows).set_index("arm")
    frame.attrs["machine"] = summary_line(machine_info())
    return frame


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"candidates (default: all): {', '.join(CANDIDATES)}")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--refresh", action="store_true", help="probe again even if cached")
    args = ap.parse_args(argv)
    try:
        caps = probe(args.profile, args.names or None, refresh=args.refresh)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"machine: {caps.machine}\ncache: {cache_path(profile=load_profile(args.profile))}\n")
    table = caps.table(args.names or None)[["status", "ttft_ms", "tpot_ms", "here"]]
    print(table.to_string(float_format=lambda v: f"{v:.1f}", max_colwidth=110))
    return 0


if __name__ == "__main__":
    sys.exit(main())
