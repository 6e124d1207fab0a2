"""Experiments of `06_fp8_kv_cache`: what `--kv-cache-dtype fp8` does to KV-cache
capacity, to single-request latency, to latency under memory pressure, and to
the model's log-probabilities.

The arms differ in `kv_cache_dtype` only. Every arm gets the same KV-cache
*byte* budget through vLLM's `--kv-cache-memory-bytes`, so an fp8 cache holds
more tokens in the same bytes: 4x on the cpu profile, whose model runs in
float32 (4 bytes per KV element against 1).

Why the lab's profile cannot simply pass `--kv-cache-memory-bytes`: on vLLM's
CPU build, `VLLM_CPU_KVCACHE_SPACE` (set to 1 GiB in the cpu profile's env)
overwrites `cache_config.kv_cache_memory_bytes` in `platforms/cpu.py`, so the
flag is silently ignored while the variable is set, and the variable takes
whole GiB only (`int(...)`; an empty value crashes the worker, which parses it
in `envs.py`). :func:`use_kv_budget` therefore gives the notebook an engine
pool whose profile leaves the variable out, and the budget is the real vLLM
flag, the same in every arm.

The CPU attention backend (`vllm/v1/attention/backends/cpu_attn.py`) accepts
`auto`, `fp8`, `fp8_e4m3` and `fp8_e5m2` (fp8 needs AVX-512 or AMX and a head
size divisible by 32); `fp8` is stored as e4m3. Its attention always reads K
and V back from the cache (`cpu_attention_with_kv_cache`), prefill included,
so the quantised cache shows in prompt log-probabilities too.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .. import arms
from ..client import Load
from ..counters import GaugeSampler, kv_capacity_of
from ..host import EngineCPU, host_load
from ..figures.fp8_kv_cache import plot_capacity, plot_latencies, plot_logprobs, plot_pressure
from ..kv_memory import (CPU_KV_ENV, ELEMENT_BYTES, GIB, byte_budget_profile,
                         decode_step_traffic, default_block_size, expected_capacity_tokens,
                         gib_to_bytes, kv_element_bytes, kv_geometry, predicted_capacity,
                         requests_that_fit, safetensors_parameters)
from ..metrics import ms
from ..profiles import ConfigError, Profile
from ..quality import (answer_summary, answer_table, compare_logprobs, greedy_answers,
                       prompt_logprobs, text_windows, token_logprobs)
from ..results import Results, measure
from ..vllm_code import vllm_source
from ..vllm_logs import parse_kv_log
from ..workloads import synthetic_specs, tokenizer_for, warm_up

#: What vLLM's CPU attention backend accepts (`CPUAttentionBackend.supported_kv_cache_dtypes`).
CPU_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: The reference arm every other arm is compared with.
BASELINE = "auto"


def arm_flags(kv_cache_dtype: str, budget_bytes: int | None,
              max_model_len: int | None = None) -> dict[str, Any]:
    """The engine flags of one arm: the KV dtype (the knob), plus the byte
    budget and context length that every arm shares."""
    flags: dict[str, Any] = {"kv_cache_dtype": str(kv_cache_dtype)}
    if budget_bytes:
        flags["kv_cache_memory_bytes"] = int(budget_bytes)
    if max_model_len:
        flags["max_model_len"] = int(max_model_len)
    return flags


def pressure_row(arm: str, run, gauges: pd.DataFrame, *, capacity_tokens: float,
                 block_size: int, prompt_tokens: int, output_tokens: int,
                 concurrency: int) -> dict[str, Any]:
    """The numbers of one pressure run: latency tails and throughput (client),
    preemptions and queue time (server counters), sampled queue depth."""
    s, c = run.summary(), run.counters or {}
    fits = (requests_that_fit(capacity_tokens, block_size, prompt_tokens, output_tokens)
            if capacity_tokens and math.isfinite(capacity_tokens) else math.nan)
    waiting = gauges.requests_waiting if len(gauges) else pd.Series(dtype=float)
    running = gauges.requests_running if len(gauges) else pd.Series(dtype=float)
    return {"arm": arm, "requests": s["requests"], "failed": s["failed"],
            "concurrency": concurrency, "kv_cache_tokens": capacity_tokens,
            "requests_that_fit": fits,
            "preemptions": c.get("preemptions", math.nan),
            "ttft_ms_median": s["ttft_ms_median"], "ttft_ms_p90": s["ttft_ms_p90"],
            "ttft_ms_p99": s["ttft_ms_p99"], "tpot_ms_median": s["tpot_ms_median"],
            "tpot_ms_p99": s["tpot_ms_p99"], "e2e_ms_p99": s["e2e_ms_p99"],
            "output_tok_s": s["output_throughput"], "duration_s": s["duration_s"],
            "server_queue_ms_mean": ms(c.get("server_queue_s_mean")),
            "server_queue_ms_p99": ms(c.get("server_queue_s_p99")),
            "running_max": float(running.max()) if len(running) else math.nan,
            "waiting_max": float(waiting.max()) if len(waiting) else math.nan,
            "kv_usage_max_pct": float(gauges.kv_cache_usage.max() * 100) if len(gauges)
            else math.nan}


# --------------------------------------------------------------------------
# Talking to the engine
# --------------------------------------------------------------------------


def use_kv_budget(ctx, kv_cache_gib: float) -> int:
    """Give `ctx` an engine pool in which `--kv-cache-memory-bytes` is obeyed
    (the profile without VLLM_CPU_KVCACHE_SPACE, `kv_memory.byte_budget_profile`)
    and return the budget in bytes. Stops any engine of the old pool first
    (one engine at a time)."""
    budget = gib_to_bytes(kv_cache_gib)
    ctx.serve_with(byte_budget_profile(ctx.profile))
    return budget


def capacity_row(engine, arm: str, budget_bytes: int | None = None) -> dict[str, Any]:
    """KV capacity as the engine reports it (vLLM's `cache_config_info` labels and
    its start-up log line), next to what bytes-per-token arithmetic predicts."""
    row: dict[str, Any] = {"arm": arm, **kv_capacity_of(engine)}
    if engine.server is not None:
        row.update(parse_kv_log(engine.server.log_path.read_text(errors="replace")))
    geometry = kv_geometry(engine.model_path)
    model_dtype = str(engine.profile.engine.get("dtype", "auto"))
    if geometry and budget_bytes and math.isfinite(row["block_size"]):
        try:
            per_token = geometry.bytes_per_token(kv_element_bytes(arm, model_dtype))
        except ValueError:
            per_token = None
        if per_token:
            row["bytes_per_token"] = per_token
            row["predicted_tokens"] = expected_capacity_tokens(budget_bytes, per_token,
                                                               int(row["block_size"]))
    return row


def single_request_latency(engine, arm: str, *, prompt_tokens: int = 256,
                           output_tokens: int = 32, repeats: int = 3, seed: int = 100,
                           results: Results | None = None, progress: bool = True) -> pd.DataFrame:
    """One request at a time (no batching, no memory pressure): TTFT and TPOT.
    The same prompts in every arm (same seed), different from the other experiments'."""
    specs = synthetic_specs(tokenizer_for(engine), repeats, prompt_tokens,
                            max_tokens=output_tokens, seed=seed, tag="single")
    with EngineCPU(engine) as cpu:
        run = measure(engine, specs, Load.sequential(), label=f"{arm}/single", results=results,
                      progress=progress)
    itl = [g * 1e3 for r in run.records if r.ok for g in r.itl]
    tokens = sum(r.output_tokens or 0 for r in run.records if r.ok)
    return run.frame().assign(arm=arm, itl_ms_p50=np.median(itl) if itl else math.nan,
                              itl_ms_p99=np.percentile(itl, 99) if itl else math.nan,
                              engine_cpu_pct=cpu.share * 100,
                              engine_cpu_ms_per_token=cpu.cpu_s * 1e3 / tokens if tokens
                              else math.nan, host_load_1m=host_load())


def pressure_run(engine, arm: str, *, requests: int = 8, concurrency: int | None = None,
                 prompt_tokens: int = 256, output_tokens: int = 64, seed: int = 200,
                 results: Results | None = None, progress: bool = True,
                 label: str | None = None) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    """`requests` long requests, `concurrency` of them in flight (default: all at
    once), each decoding exactly `output_tokens` tokens, against a small KV budget.
    Returns the arm's summary row, its per-request frame and the sampled gauges."""
    concurrency = int(concurrency or requests)
    specs = synthetic_specs(tokenizer_for(engine), requests, prompt_tokens,
                            max_tokens=output_tokens, seed=seed, tag="pressure")
    with GaugeSampler(engine) as sampler, EngineCPU(engine) as cpu:
        run = measure(engine, specs, Load.concurrent(concurrency),
                      label=label or f"{arm}/pressure", results=results, progress=progress)
    gauges = sampler.frame().assign(arm=arm)
    cc = engine.info.get("cache_config", {}) or {}
    prompt_len = int(np.median([r.prompt_tokens for r in run.records if r.prompt_tokens] or
                               [prompt_tokens]))
    row = pressure_row(arm, run, gauges,
                       capacity_tokens=float(cc.get("kv_cache_size_tokens", "nan")),
                       block_size=int(cc.get("block_size", 16)), prompt_tokens=prompt_len,
                       output_tokens=output_tokens, concurrency=concurrency)
    tokens = sum(r.output_tokens or 0 for r in run.records if r.ok)
    row.update(engine_cpu_pct=cpu.share * 100, host_load_1m=host_load(),
               engine_cpu_ms_per_token=cpu.cpu_s * 1e3 / tokens if tokens else math.nan)
    return row, run.frame().assign(arm=arm), gauges


@dataclass
class ArmsResult:
    """Everything `run_arms` measured, one table per experiment (`answers`:
    `lab_utils.quality.answers_frame` rows of every arm, with an `arm` column)."""
    budget_bytes: int
    capacity: pd.DataFrame = field(default_factory=pd.DataFrame)
    single: pd.DataFrame = field(default_factory=pd.DataFrame)
    logprobs: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    answers: pd.DataFrame = field(default_factory=pd.DataFrame)
    pressure: pd.DataFrame = field(default_factory=pd.DataFrame)
    pressure_requests: pd.DataFrame = field(default_factory=pd.DataFrame)
    gauges: pd.DataFrame = field(default_factory=pd.DataFrame)
    skipped: list[str] = field(default_factory=list)

    @property
    def arms(self) -> list[str]:
        return list(self.capacity.index)


def runnable_here(profile: Profile, kv_cache_dtype: str) -> str:
    """"" if this machine can run `kv_cache_dtype`, else the reason. On the cpu
    profile an fp8 dtype is checked by this machine's capability probe
    (`lab_utils.capabilities`, candidate "kv_fp8"): vLLM's CPU backend runs an
    fp8 KV cache only on x86 with AVX-512 or AMX."""
    from .. import capabilities
    return capabilities.why_not(profile, "kv_fp8" if kv_cache_dtype.startswith("fp8") else None)


def plan(profile: Profile, params: Mapping[str, Any]) -> arms.Plan:
    """The notebook's engines: one per KV dtype of `kv_dtypes`, in that order,
    all with the same byte budget (`kv_cache_gib`) and context length
    (`max_model_len`), so each differs from the first (the baseline, `auto`
    by default) in `kv_cache_dtype` only. An fp8 dtype this machine's probe
    says cannot run is left out (the reason is in the plan's notes); the fp8
    arms are optional: a server of theirs that fails to start is skipped."""
    budget = gib_to_bytes(params.get("kv_cache_gib", 0.0625))
    max_len = int(params.get("max_model_len", 1024))
    notes, kept = [], []
    for dtype in dict.fromkeys(params.get("kv_dtypes", ["auto", "fp8"])):
        why = runnable_here(profile, dtype)
        if why:
            notes.append(f"arm {dtype!r} skipped: {why.splitlines()[0]}")
        else:
            kept.append(dtype)
    if not kept:
        raise ConfigError("06_fp8_kv_cache: no KV dtype of "
                          f"{params.get('kv_dtypes')} can run here: " + "; ".join(notes))
    out = [arms.Arm(d, arm_flags(d, budget, max_len), knob="kv_cache_dtype" if i else None,
                    title=f"--kv-cache-dtype {d}", optional=d.startswith("fp8"))
           for i, d in enumerate(kept)]
    return arms.Plan("06_fp8_kv_cache", tuple(out), notes=tuple(notes))


def run_arms(ctx, names: Sequence[str] | None = None, *, kv_cache_gib: float = 0.0625,
             single_prompt_tokens: int = 256, single_output_tokens: int = 32,
             single_repeats: int = 3, quality_tokens: int = 768, n_questions: int = 10,
             pressure_requests: int = 8, pressure_prompt_tokens: int = 256,
             pressure_output_tokens: int = 64, progress: bool = True) -> ArmsResult:
    """Every experiment on one arm of the notebook's plan (or of `names`), then
    on the next: one engine start per KV dtype. An arm the target cannot serve
    (remote profile, an fp8 server that did not start) is skipped and noted."""
    out = ArmsResult(budget_bytes=use_kv_budget(ctx, kv_cache_gib))
    cap, single, pressure, reqs, gauges, answers = [], [], [], [], [], []
    for arm in names or ctx.plan.names:
        engine = ctx.arm(arm)
        if engine is None:
            out.skipped.append(arm)
            continue
        cap.append(capacity_row(engine, arm, out.budget_bytes))
        warm_up(engine, prompt="Hello", api="completions")
        single.append(single_request_latency(
            engine, arm, prompt_tokens=single_prompt_tokens, output_tokens=single_output_tokens,
            repeats=single_repeats, results=ctx.results, progress=progress))
        ids = text_windows(tokenizer_for(engine), 1, quality_tokens)[0]
        lp, top1 = token_logprobs(ids, prompt_logprobs(engine, ids))
        out.logprobs[arm] = {"logprobs": lp, "top1": top1}
        answers.append(greedy_answers(engine, n_questions, concurrency=max(1, n_questions),
                                      label=f"{arm}/answers", results=ctx.results, arm=arm))
        row, frame, g = pressure_run(engine, arm, requests=pressure_requests,
                                     prompt_tokens=pressure_prompt_tokens,
                                     output_tokens=pressure_output_tokens,
                                     results=ctx.results, progress=progress)
        pressure.append(row)
        reqs.append(frame)
        gauges.append(g)
    if cap:
        out.capacity = pd.DataFrame(cap).set_index("arm")
        out.single = pd.concat(single, ignore_index=True)
        out.answers = pd.concat(answers, ignore_index=True)
        out.pressure = pd.DataFrame(pressure).set_index("arm")
        out.pressure_requests = pd.concat(reqs, ignore_index=True)
        out.gauges = pd.concat(gauges, ignore_index=True)
    return out


# --------------------------------------------------------------------------
# Tables the notebook shows
# --------------------------------------------------------------------------

CAPACITY_COLUMNS = ["cache_dtype", "kv_cache_memory_bytes", "bytes_per_token", "num_blocks",
                    "kv_cache_size_tokens", "predicted_tokens", "log_kv_tokens",
                    "kv_cache_max_concurrency", "log_max_concurrency"]
PRESSURE_COLUMNS = ["requests", "failed", "requests_that_fit", "preemptions", "waiting_max",
                    "running_max", "kv_usage_max_pct", "server_queue_ms_mean", "ttft_ms_median",
                    "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_median", "output_tok_s", "duration_s",
                    "engine_cpu_ms_per_token", "engine_cpu_pct", "host_load_1m"]


def capacity_table(result: ArmsResult) -> pd.DataFrame:
    """The capacity rows with the token ratio of every arm against the baseline."""
    t = result.capacity.reindex(columns=CAPACITY_COLUMNS)
    if BASELINE in t.index:
        t["tokens_vs_auto"] = t.kv_cache_size_tokens / t.loc[BASELINE, "kv_cache_size_tokens"]
    return t


def single_table(single: pd.DataFrame) -> pd.DataFrame:
    """Per arm: TTFT and TPOT median/p90 and the pooled ITL p50/p99 (ms)."""
    if single.empty:
        return pd.DataFrame()
    g = single[single.ok.astype(bool)].groupby("arm", sort=False)
    return pd.DataFrame({"requests": g.size(), "ttft_ms_median": g.ttft_ms.median(),
                         "ttft_ms_p90": g.ttft_ms.quantile(0.9),
                         "tpot_ms_median": g.tpot_ms.median(),
                         "tpot_ms_p90": g.tpot_ms.quantile(0.9),
                         "itl_ms_p50": g.itl_ms_p50.first(), "itl_ms_p99": g.itl_ms_p99.first(),
                         "engine_cpu_ms_per_token": g.engine_cpu_ms_per_token.first(),
                         "engine_cpu_pct": g.engine_cpu_pct.first(),
                         "host_load_1m": g.host_load_1m.first()})


def quality_table(result: ArmsResult, baseline: str = BASELINE) -> pd.DataFrame:
    """Per arm against the baseline: perplexity, log-prob differences, top-1 agreement."""
    if baseline not in result.logprobs:
        return pd.DataFrame()
    rows = {arm: compare_logprobs(result.logprobs[baseline], lp)
            for arm, lp in result.logprobs.items()}
    return pd.DataFrame.from_dict(rows, orient="index")


def predicted_table(profile: Profile, budget_bytes: int, max_model_len: int,
                    kv_dtypes: Sequence[str], *, pressure_shape: tuple[int, int] | None = None
                    ) -> pd.DataFrame:
    """Before any engine starts: tokens, maximum concurrency (and requests of the
    pressure shape that fit) per arm at this budget and at the profile's own
    1 GiB cpu default. Empty when the model or its dtype is not known locally."""
    model_dtype = str(profile.engine.get("dtype", "auto"))
    geometry = None if profile.is_remote else kv_geometry(profile.model_for())
    if geometry is None or model_dtype.lower() not in ELEMENT_BYTES:
        return pd.DataFrame()
    block = default_block_size(profile.device)
    cases = {f"{budget_bytes / 2**20:g} MiB, max_model_len {max_model_len}":
             (budget_bytes, max_model_len)}
    if profile.env.get(CPU_KV_ENV):
        cases[f"{profile.env[CPU_KV_ENV]} GiB ({CPU_KV_ENV}), max_model_len "
              f"{profile.engine.get('max_model_len', max_model_len)}"] = (
            int(profile.env[CPU_KV_ENV]) * GIB, int(profile.engine.get("max_model_len",
                                                                       max_model_len)))
    frames = {}
    for name, (budget, mml) in cases.items():
        t = predicted_capacity(geometry, budget, block, mml, kv_dtypes, model_dtype)
        if pressure_shape:
            t["pressure_requests_that_fit"] = [
                requests_that_fit(n, block, *pressure_shape) for n in t.kv_cache_size_tokens]
        frames[name] = t
    return pd.concat(frames, names=["budget", "arm"])


def traffic_table(profile: Profile, kv_dtypes: Sequence[str],
                  cases: Mapping[str, tuple[int, int]]) -> pd.DataFrame:
    """Least bytes one decode step reads (weights + KV of the batch) per arm and
    case {name: (context tokens, batch)}, and the KV share of them."""
    model_dtype = str(profile.engine.get("dtype", "auto"))
    model_dir = None if profile.is_remote else profile.model_for()
    geometry, params = kv_geometry(model_dir), safetensors_parameters(model_dir)
    if geometry is None or params is None or model_dtype.lower() not in ELEMENT_BYTES:
        return pd.DataFrame()
    weights = params * ELEMENT_BYTES[model_dtype.lower()]
    rows = []
    for name, (context, batch) in cases.items():
        for arm in kv_dtypes:
            per_token = geometry.bytes_per_token(kv_element_bytes(arm, model_dtype))
            rows.append({"case": name, "arm": arm, "context_tokens": context, "batch": batch,
                         **decode_step_traffic(weights, per_token, context, batch)})
    return pd.DataFrame(rows).set_index(["case", "arm"])


SINGLE_COLUMNS = ["requests", "ttft_ms_median", "ttft_ms_p90", "tpot_ms_median", "tpot_ms_p90",
                  "itl_ms_p50", "itl_ms_p99", "engine_cpu_ms_per_token", "engine_cpu_pct",
                  "host_load_1m"]
QUALITY_COLUMNS = ["tokens", "ppl_baseline", "ppl_treated", "ppl_change_pct",
                   "mean_abs_logprob_diff", "p99_abs_logprob_diff", "max_abs_logprob_diff",
                   "top1_agreement"]


def pressure_table(result: ArmsResult) -> pd.DataFrame:
    """The pressure rows, in the notebook's column order (empty if no arm ran)."""
    return result.pressure.reindex(columns=PRESSURE_COLUMNS)


def headline(result: ArmsResult, baseline: str = BASELINE) -> dict[str, Any]:
    """Baseline and treated (first other arm) numbers the findings cite; NaN where
    an arm did not run (remote profile), so the findings cells still run."""
    others = [a for a in result.arms if a != baseline]
    treated = others[0] if others else "fp8"
    keys = [baseline, treated]
    answers = answer_summary(answer_table(result.answers, baseline), keys, baseline)
    return {"baseline": baseline, "treated": treated,
            "capacity": capacity_table(result).reindex(keys),
            "single": single_table(result.single).reindex(index=keys, columns=SINGLE_COLUMNS),
            "pressure": pressure_table(result).reindex(keys),
            "quality": quality_table(result).reindex(index=[treated],
                                                     columns=QUALITY_COLUMNS).loc[treated],
            "answers": answers.reindex(index=keys, columns=["questions", "correct",
                                                            "identical_to_baseline"])}


#: The article's line on the fp8 KV cache (its only claim: bandwidth, not accuracy).
CLAIM = "--kv-cache-dtype fp8: less memory-bandwidth pressure"


def findings(result: ArmsResult, *, max_model_len: int, pressure_requests: int,
             baseline: str = BASELINE) -> list[dict[str, Any]]:
    """The notebook's findings (`Results.add_finding` keyword arguments), the
    baseline against the first other arm (`headline`): KV capacity in the
    budget, single-request TPOT, TTFT p99 / throughput / preemptions under
    memory pressure, and perplexity of the fixed text. Each mechanism cites
    vLLM's counters and labels; an arm that did not run leaves NaN values,
    which `add_finding` notes instead of recording."""
    h = headline(result, baseline)
    b, t = h["baseline"], h["treated"]
    cap, one, pres = h["capacity"], h["single"], h["pressure"]
    q, a = h["quality"], h["answers"]
    out = [
        {"technique": "fp8 KV cache",
         "metric": f"KV-cache capacity (tokens) in {result.budget_bytes / 2**20:g} MiB, {b} -> {t}",
         "baseline": cap.kv_cache_size_tokens[b], "treated": cap.kv_cache_size_tokens[t],
         "article_claim": CLAIM,
         "mechanism": f"vllm:cache_config_info cache_dtype {cap.cache_dtype[b]} -> "
                      f"{cap.cache_dtype[t]}, num_gpu_blocks {cap.num_blocks[b]:.0f} -> "
                      f"{cap.num_blocks[t]:.0f}, kv_cache_max_concurrency "
                      f"{cap.kv_cache_max_concurrency[b]:g} -> "
                      f"{cap.kv_cache_max_concurrency[t]:g} at max_model_len {max_model_len}; "
                      f"{cap.bytes_per_token[b]:,.0f} -> {cap.bytes_per_token[t]:,.0f} bytes "
                      "per token"},
        {"technique": "fp8 KV cache", "metric": f"single-request TPOT median (ms), {b} -> {t}",
         "baseline": one.tpot_ms_median[b], "treated": one.tpot_ms_median[t],
         "article_claim": "less memory-bandwidth pressure (implies faster decoding)",
         "mechanism": f"ITL p50 {one.itl_ms_p50[b]:.1f} -> {one.itl_ms_p50[t]:.1f} ms, p99 "
                      f"{one.itl_ms_p99[b]:.1f} -> {one.itl_ms_p99[t]:.1f} ms; engine CPU per "
                      f"output token {one.engine_cpu_ms_per_token[b]:.0f} -> "
                      f"{one.engine_cpu_ms_per_token[t]:.0f} ms (engine got "
                      f"{one.engine_cpu_pct[b]:.0f}% -> {one.engine_cpu_pct[t]:.0f}% of the "
                      "cores)"},
    ]
    evidence = (f"vllm:num_preemptions_total {pres.preemptions[b]:.0f} -> "
                f"{pres.preemptions[t]:.0f}; vllm:num_requests_waiting max "
                f"{pres.waiting_max[b]:.0f} -> {pres.waiting_max[t]:.0f}, running max "
                f"{pres.running_max[b]:.0f} -> {pres.running_max[t]:.0f}; "
                f"vllm:request_queue_time_seconds mean {pres.server_queue_ms_mean[b]:.0f} -> "
                f"{pres.server_queue_ms_mean[t]:.0f} ms; engine CPU per output token "
                f"{pres.engine_cpu_ms_per_token[b]:.0f} -> "
                f"{pres.engine_cpu_ms_per_token[t]:.0f} ms")
    for metric, col in [("TTFT p99 (ms)", "ttft_ms_p99"),
                        ("output throughput (tok/s)", "output_tok_s"),
                        ("preemptions", "preemptions")]:
        out.append({"technique": "fp8 KV cache",
                    "metric": f"under memory pressure ({pressure_requests} requests at once): "
                              f"{metric}, {b} -> {t}",
                    "baseline": pres[col][b], "treated": pres[col][t],
                    "article_claim": "less memory-bandwidth pressure", "mechanism": evidence})
    out.append({
        "technique": "fp8 KV cache",
        "metric": (f"perplexity on {q.tokens:.0f} tokens of a fixed text, {b} -> {t}"
                   if math.isfinite(q.tokens) else  # no pair of arms was compared
                   f"perplexity of a fixed text, {b} -> {t}"),
        "baseline": q.ppl_baseline, "treated": q.ppl_treated,
        "article_claim": "(no accuracy claim for the fp8 KV cache)",
        "mechanism": f"prompt_logprobs: mean |log-prob difference| "
                     f"{q.mean_abs_logprob_diff:.4f} nats (p99 {q.p99_abs_logprob_diff:.3f}, "
                     f"max {q.max_abs_logprob_diff:.3f}); top-1 token agreement "
                     f"{q.top1_agreement:.1%}; greedy answers identical "
                     f"{a.identical_to_baseline[t]}/{a.questions[t]}, correct {a.correct[b]} -> "
                     f"{a.correct[t]}"})
    return out


def arm_notes(result: ArmsResult) -> list[str]:
    """One line per arm that ran, for the results file's notes: KV tokens,
    single-request TPOT, TTFT p99 and preemptions under pressure."""
    capacity, single = capacity_table(result), single_table(result.single)
    return [f"{arm}: {capacity.kv_cache_size_tokens[arm]:,.0f} KV tokens, single TPOT "
            f"{single.tpot_ms_median[arm]:.1f} ms, pressure TTFT p99 "
            f"{result.pressure.ttft_ms_p99[arm]:.0f} ms, "
            f"preemptions {result.pressure.preemptions[arm]:.0f}" for arm in result.arms]


# --------------------------------------------------------------------------
# Explore
# --------------------------------------------------------------------------

_explore_seeds = itertools.count(10_000, 100)


def explore_pressure(ctx, kv_cache_dtype: str, concurrency: int, *, requests: int = 8,
                     kv_cache_gib: float = 0.0625, max_model_len: int = 1024,
                     prompt_tokens: int = 256, output_tokens: int = 64) -> pd.DataFrame:
    """Explore: the pressure run again for one KV dtype and concurrency, on
    fresh prompts (so the prefix cache cannot help), with the notebook's budget."""
    if ctx.engines.profile.env.get(CPU_KV_ENV):  # the notebook's pool would ignore the budget
        use_kv_budget(ctx, kv_cache_gib)
    flags = arm_flags(kv_cache_dtype, gib_to_bytes(kv_cache_gib), max_model_len)
    planned = ctx.plan.find(None, flags)
    # the notebook's own arm when it is one, else an engine outside the plan
    engine = ctx.arm(planned) if planned is not None else ctx.any_engine(**flags)
    if engine is None:
        return pd.DataFrame()
    row, _, _ = pressure_run(engine, kv_cache_dtype, requests=max(requests, concurrency),
                             concurrency=concurrency, prompt_tokens=prompt_tokens,
                             output_tokens=output_tokens, seed=next(_explore_seeds),
                             label=f"explore/{kv_cache_dtype}/c{concurrency}")
    return pd.DataFrame([row]).set_index("arm")[PRESSURE_COLUMNS].round(1)


__all__ = [  # defined here, then the shared names the notebook reads from here
    "CPU_KV_CACHE_DTYPES", "BASELINE", "CPU_KV_ENV", "CAPACITY_COLUMNS", "PRESSURE_COLUMNS",
    "SINGLE_COLUMNS", "QUALITY_COLUMNS", "CLAIM", "arm_flags", "pressure_row",
    "use_kv_budget", "capacity_row", "single_request_latency", "pressure_run", "ArmsResult",
    "runnable_here", "plan", "run_arms", "capacity_table", "single_table", "quality_table",
    "predicted_table", "traffic_table", "pressure_table", "headline", "findings", "arm_notes",
    "explore_pressure",
    "answer_summary", "answer_table", "gib_to_bytes", "plot_capacity", "plot_latencies",
    "plot_logprobs", "plot_pressure", "vllm_source",
]
