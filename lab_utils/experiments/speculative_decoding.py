"""Experiments of `04_speculative_decoding`: what speculative decoding does to
TPOT, for two kinds of proposer, two kinds of text and two loads.

Every arm is one engine, declared by `plan(profile, params)` before any
starts. The baseline has no `--speculative-config`; each treated arm adds
exactly that flag:

- **n-gram prompt lookup** (`{"method": "ngram", "num_speculative_tokens": k,
  "prompt_lookup_max": 4, "prompt_lookup_min": 2}`; "ngram_gpu" on cuda, the
  same lookup on the GPU, with which vLLM keeps async scheduling on as in the
  baseline): the proposer looks for the last 2-4 generated tokens earlier in
  the request's own tokens (prompt and output) and proposes the k tokens that
  followed them there. No model runs.
- **a draft model** (`{"model": PATH, "num_speculative_tokens": k}`; vLLM sets
  `method="draft_model"` when a model is given without a method): a smaller
  model of the same tokenizer runs k decode steps of its own to propose (with
  `"use_heterogeneous_vocab": true` when its vocabulary is padded to another
  size, as Qwen2.5-0.5B's 151,936 against the 7B's 152,064).

The target model checks all k proposals in one forward pass and keeps the
longest prefix that matches what it would have produced itself, plus one token
of its own, so one engine step emits 1 to k+1 tokens. With greedy sampling
(temperature 0) the output must be the same text as without speculation.

Each engine runs every workload and load before the next engine starts
(engine starts dominate the run time): code edits and chat one request at a
time, then code edits at a high concurrency. The spec-decode counters on
/metrics (drafts, draft tokens, accepted tokens, accepted tokens per position)
are read around every run.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .. import arms
from ..client import Load, RequestSpec
from ..counters import scrape_text
from ..figures.speculative_decoding import plot_acceptance, plot_chunk_vs_token, plot_tpot
from ..host import busy_runs_warning, host_load
from ..metrics import chunk_frame, percentile, token_chunks, token_gaps_ms
from ..profiles import ConfigError, Profile
from ..quality import identity_summary, output_identity
from ..results import Results, measure
from ..speculation import (SPEC_KNOB, V1_RUNNER_ENV, break_even_acceptance, describe_draft,
                           draft_model_config, draft_source, ensure_draft, ngram_config,
                           ngram_method, per_position_counts, per_position_rates,
                           vocabularies_differ)
from ..workloads import chat_specs, code_edit_specs

#: The n-gram window of the article-style prompt-lookup arm (vLLM's default is 5..5).
NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
WORKLOADS = ("code_edit", "chat")
#: Columns of the run table the notebook shows first.
RUN_COLUMNS = ["requests", "output_tokens", "tpot_ms_median", "tpot_ms_p90", "tpot_ms_p99",
               "itl_chunk_ms_median", "itl_token_ms_median", "tokens_per_chunk",
               "e2e_ms_median", "output_throughput", "acceptance_rate",
               "mean_accepted_length", "host_load_1m"]


# --------------------------------------------------------------------------
# Arms: each adds one --speculative-config (lab_utils.speculation) to the baseline
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SpecArm(arms.Arm):
    """A plan arm (`lab_utils.arms.Arm`) that also says which proposer it runs,
    so every run-table row and results record can name it: `method` "none"
    (the baseline), "ngram" or "draft", `k` proposed tokens, and for a draft
    its short name (`draft`) and the folder or hub id vLLM loads (`draft_path`)."""
    method: str = "none"
    k: int = 0
    draft: str = ""
    draft_path: str = ""


def baseline_arm(env: Mapping[str, str] | None = None) -> SpecArm:
    return SpecArm("baseline", env=dict(env or {}), title="no --speculative-config")


def ngram_arm(k: int, method: str = "ngram", env: Mapping[str, str] | None = None) -> SpecArm:
    """An n-gram arm; `method` "ngram_gpu" on CUDA (`lab_utils.speculation.ngram_method`)."""
    return SpecArm(f"ngram k={k}", {SPEC_KNOB: ngram_config(k, **NGRAM_LOOKUP, method=method)},
                   env=dict(env or {}), knob=SPEC_KNOB,
                   title=f"n-gram prompt lookup{' (ngram_gpu)' if method != 'ngram' else ''}"
                         f", {k} proposed tokens",
                   method="ngram", k=int(k))


def draft_arm(path: str, k: int, draft: str, heterogeneous_vocab: bool = False,
              env: Mapping[str, str] | None = None) -> SpecArm:
    """A draft-model arm. Optional: a draft whose engine does not start (a
    download, a refused config, memory) is skipped with its log's root cause
    (`ctx.arm`), and the other arms still run."""
    other = ", vocabulary mapped (use_heterogeneous_vocab)" if heterogeneous_vocab else ""
    return SpecArm(f"draft {draft} k={k}",
                   {SPEC_KNOB: draft_model_config(path, k, heterogeneous_vocab)},
                   env=dict(env or {}), knob=SPEC_KNOB, optional=True,
                   title=f"draft model {draft}, {k} proposed tokens{other}",
                   method="draft", k=int(k), draft=draft, draft_path=str(path))


def plan(profile: Profile, params: Mapping[str, Any]) -> arms.Plan:
    """The notebook's engines: the baseline, one n-gram arm per k in
    `ngram_ks` ("ngram_gpu" on cuda, which keeps vLLM's async scheduling like
    the baseline), one draft arm per (draft in `draft_models`, k in `draft_ks`).
    Each treated arm adds `--speculative-config` to the baseline and nothing
    else; the draft folders are named here and built before their engine starts.

    A draft this profile cannot name ("truncated" cuts the embedded model,
    "profile" needs a `draft` role) leaves its arms out with a note. A draft
    whose vocabulary size differs from the target's (the facts data) gets
    `use_heterogeneous_vocab`; vLLM runs it on its V1 model runner only, so on
    cuda every arm then pins V1 (`V1_RUNNER_ENV`) and the note says so."""
    notes, drafts = [], []
    for name in params.get("draft_models", []):
        if name in ("", "none"):
            continue
        try:
            path, label = draft_source(profile, name, int(params.get("draft_layers", 6)))
        except ConfigError as exc:
            notes.append(f"draft arm(s) of {name!r} skipped: {exc}")
            continue
        drafts.append((path, label, vocabularies_differ(profile, path)))
    env = {}
    if profile.device == "cuda" and any(h for _, _, h in drafts):
        env = dict(V1_RUNNER_ENV)
        notes.append("a draft of another vocabulary size runs on vLLM's V1 model runner only "
                     "(use_heterogeneous_vocab, vllm/config/vllm.py): every arm pins it "
                     f"({', '.join(f'{k}={v}' for k, v in env.items())}), so the arms differ "
                     "in their speculative config alone")
    method = ngram_method(profile)
    out = [baseline_arm(env)] + [ngram_arm(int(k), method, env)
                                 for k in params.get("ngram_ks", [])]
    out += [draft_arm(path, int(k), label, hetero, env) for path, label, hetero in drafts
            for k in params.get("draft_ks", [])]
    return arms.Plan("04_speculative_decoding", tuple(out), notes=tuple(notes))


def draft_table(plan: arms.Plan) -> pd.DataFrame:
    """What each draft arm's draft is (`describe_draft`), building the drafts
    the lab derives first (`ensure_draft`): one row per draft arm."""
    rows = []
    for a in plan.arms:
        if getattr(a, "method", "") == "draft":
            ensure_draft(a)
            rows.append({"arm": a.name, **describe_draft(a.draft_path)})
    return pd.DataFrame(rows).set_index("arm") if rows else pd.DataFrame()


def explore_methods(profile: Profile) -> list[str]:
    """The Explore widget's method choices this profile can start."""
    out = ["ngram", "none"]
    if profile.models.get("draft"):
        out.append("draft: profile")
    if profile.model == "embedded":
        out.append("draft: truncated")
    if not profile.is_remote:
        out.append("draft: self")
    return out


# --------------------------------------------------------------------------
# Tables (pure)
# --------------------------------------------------------------------------

def run_row(run, arm: SpecArm, workload: str, concurrency: int, chunks: pd.DataFrame,
            per_pos: Sequence[float] = (), host_load_1m: float = math.nan) -> dict[str, Any]:
    """One row of the run table: latency stats, chunk/token ITL, the counters
    and the host's load average when the run ended."""
    s = run.summary()
    c = run.counters or {}
    gaps = token_gaps_ms(chunks)
    row = {"arm": arm.name, "method": arm.method, "k": arm.k, "draft": arm.draft,
           "workload": workload, "concurrency": concurrency, "requests": s["completed"],
           "failed": s["failed"], "output_tokens": s["output_tokens"],
           "duration_s": run.duration_s}
    for m in ("ttft", "tpot", "e2e"):
        for stat in ("median", "p90", "p99"):
            row[f"{m}_ms_{stat}"] = s[f"{m}_ms_{stat}"]
    for name, values in (("itl_chunk", chunks["gap_ms"].to_numpy(float) if len(chunks) else []),
                         ("itl_token", gaps)):
        for stat, q in (("median", 50), ("p90", 90), ("p99", 99)):
            row[f"{name}_ms_{stat}"] = percentile(values, q)
    row["tokens_per_chunk"] = float(chunks["tokens"].mean()) if len(chunks) else math.nan
    row["output_throughput"] = s["output_throughput"]
    row["drafts"] = c.get("spec_decode_drafts", 0.0)
    row["draft_tokens"] = c.get("spec_decode_draft_tokens", 0.0)
    row["accepted_tokens"] = c.get("spec_decode_accepted_tokens", 0.0)
    row["acceptance_rate"] = c.get("spec_decode_acceptance_rate")
    row["mean_accepted_length"] = c.get("spec_decode_mean_accepted_length")
    row["generation_tokens"] = c.get("generation_tokens", math.nan)
    row["per_position_acceptance"] = [round(float(v), 4) for v in per_pos]
    row["host_load_1m"] = host_load_1m
    return row


def compare_to_baseline(runs: pd.DataFrame, baseline: str = "baseline") -> pd.DataFrame:
    """Per arm, workload and concurrency: median TPOT against the baseline's,
    and its decomposition speed-up = tokens per step / step cost, where tokens
    per step is the mean tokens per streamed chunk and the step cost is the
    arm's median chunk gap over the baseline's (one chunk = one engine step
    for a request that runs alone)."""
    cols = ["tpot_baseline_ms", "tpot_ms", "tpot_change_pct", "tokens_per_chunk",
            "step_cost_ratio", "speedup", "acceptance_rate", "mean_accepted_length"]
    if runs.empty or baseline not in set(runs.arm):
        return pd.DataFrame(columns=cols)
    base = runs[runs.arm == baseline].set_index(["workload", "concurrency"])
    rows = []
    for _, r in runs.iterrows():
        key = (r.workload, r.concurrency)
        if key not in base.index:
            continue
        b = base.loc[key]
        step_cost = r.itl_chunk_ms_median / b.itl_chunk_ms_median \
            if b.itl_chunk_ms_median else math.nan
        rows.append({"arm": r.arm, "workload": r.workload, "concurrency": r.concurrency,
                     "tpot_baseline_ms": b.tpot_ms_median, "tpot_ms": r.tpot_ms_median,
                     "tpot_change_pct": (r.tpot_ms_median - b.tpot_ms_median)
                     / b.tpot_ms_median * 100 if b.tpot_ms_median else math.nan,
                     "tokens_per_chunk": r.tokens_per_chunk, "step_cost_ratio": step_cost,
                     "speedup": b.tpot_ms_median / r.tpot_ms_median if r.tpot_ms_median
                     else math.nan,
                     "acceptance_rate": r.acceptance_rate,
                     "mean_accepted_length": r.mean_accepted_length})
    return pd.DataFrame(rows).set_index(["arm", "workload", "concurrency"])[cols]


def speculation_economics(runs: pd.DataFrame, baseline: str = "baseline") -> pd.DataFrame:
    """Per speculative run: tokens per step, step cost (both relative to the
    baseline's plain decode step), the resulting speed-up, and the per-token
    acceptance `alpha` at which a step of that cost would break even."""
    comp = compare_to_baseline(runs, baseline)
    if comp.empty:
        return comp
    k = runs.set_index(["arm", "workload", "concurrency"])["k"]
    comp = comp[comp.index.get_level_values("arm") != baseline].copy()
    comp.insert(0, "k", [int(k.loc[i]) for i in comp.index])
    comp["break_even_acceptance"] = [
        break_even_acceptance(c, kk) if np.isfinite(c) else math.nan
        for c, kk in zip(comp.step_cost_ratio, comp.k)]
    return comp[["k", "acceptance_rate", "mean_accepted_length", "tokens_per_chunk",
                 "step_cost_ratio", "speedup", "break_even_acceptance", "tpot_change_pct"]]


def load_warning(runs: pd.DataFrame, cores: int | None = None, factor: float = 2.0) -> str:
    """`host.busy_runs_warning` for the run table (a run: arm/workload/concurrency)."""
    return busy_runs_warning(runs, ("arm", "workload", "concurrency"), cores=cores,
                             factor=factor)


def tpot_samples(requests: pd.DataFrame | None, arm: str | None, workload: str,
                 concurrency: int) -> list[float]:
    """Per-request TPOT (ms) of one run, for bootstrap intervals."""
    if requests is None or arm is None or requests.empty:
        return []
    sel = requests[(requests.arm == arm) & (requests.workload == workload)
                   & (requests.concurrency == concurrency) & requests.ok.astype(bool)]
    return [float(v) for v in sel.tpot_ms.dropna()]


#: Which finding answers the article's table row, and how it differs from the article.
CHECKLIST_ROW = "speculative decoding:tpot"


def findings(runs: pd.DataFrame, identity: pd.DataFrame, *, high_concurrency: int,
             article_claim: str, requests: pd.DataFrame | None = None,
             served: str = "") -> list[dict[str, Any]]:
    """The notebook's findings as `Results.add_finding` keyword arguments: TPOT
    median baseline -> first n-gram arm (code edits, chat, high load), the
    n-gram acceptance rate (chat -> code edits), the first draft arm's TPOT,
    and greedy output identity. Runs that were not measured are left out.

    With `requests` (per-request rows) each TPOT finding carries its samples
    for a bootstrap interval. The n-gram code-edit finding answers the
    article's table row (`checklist`), with a `reason` naming its scope and
    `served` (what served this run, e.g. "cpu, smollm2-135m-instruct")."""
    names = list(dict.fromkeys(runs.arm)) if len(runs) else []
    method = dict(zip(runs.arm, runs.method)) if len(runs) else {}
    ngram = next((a for a in names if method[a] == "ngram"), None)
    draft = next((a for a in names if method[a] == "draft"), None)
    out: list[dict[str, Any]] = []

    def evidence(arm: str, workload: str, conc: int) -> str:
        g = lambda col: pick(runs, arm, workload, conc, col)  # noqa: E731
        acc, mal = g("acceptance_rate"), g("mean_accepted_length")
        if not np.isfinite(g("draft_tokens")) or not g("draft_tokens"):
            return f"{arm}: no drafts proposed in this run (vllm:spec_decode_num_drafts = 0)"
        return (f"{arm}: vllm:spec_decode accepted {g('accepted_tokens'):.0f} of "
                f"{g('draft_tokens'):.0f} draft tokens ({acc:.0%}) in {g('drafts'):.0f} drafts, "
                f"mean accepted length {mal:.2f} tokens/step; "
                f"{g('tokens_per_chunk'):.2f} tokens per streamed chunk")

    def tpot(technique: str, arm: str | None, workload: str, conc: int, what: str) -> None:
        base, treated = pick(runs, "baseline", workload, conc), pick(runs, arm, workload, conc)
        if arm is None or not (np.isfinite(base) and np.isfinite(treated)):
            return
        f = {"technique": technique, "metric": f"TPOT median (ms), {what}, baseline -> {arm}",
             "baseline": base, "treated": treated, "article_claim": article_claim,
             "mechanism": evidence(arm, workload, conc)}
        samples = (tpot_samples(requests, "baseline", workload, conc),
                   tpot_samples(requests, arm, workload, conc))
        if min(len(samples[0]), len(samples[1])) >= 2:
            f["samples"] = samples
        if arm == ngram and workload == "code_edit" and conc == 1:
            f["checklist"] = CHECKLIST_ROW
            f["reason"] = ("n-gram prompt lookup on code edits whose answers copy the prompt "
                           "(its best case); the article's draft model is measured in the "
                           "draft-model findings" + (f"; measured on {served}" if served else ""))
        out.append(f)

    tpot("speculative decoding: n-gram, code edits", ngram, "code_edit", 1,
         "code edits, 1 at a time")
    tpot("speculative decoding: n-gram, chat", ngram, "chat", 1, "chat, 1 at a time")
    if high_concurrency > 1:
        tpot("speculative decoding: n-gram under load", ngram, "code_edit", high_concurrency,
             f"code edits, {high_concurrency} in flight")
    acc_chat = pick(runs, ngram, "chat", 1, "acceptance_rate")
    acc_code = pick(runs, ngram, "code_edit", 1, "acceptance_rate")
    if ngram is not None and np.isfinite(acc_code):
        row = runs[(runs.arm == ngram) & (runs.workload == "code_edit") & (runs.concurrency == 1)]
        out.append({"technique": "speculative decoding: n-gram acceptance",
                    "metric": f"acceptance rate of drafted tokens (%), chat -> code edits, {ngram}",
                    "baseline": acc_chat * 100 if np.isfinite(acc_chat) else math.nan,
                    "treated": acc_code * 100, "article_claim": article_claim,
                    "mechanism": evidence(ngram, "code_edit", 1) + "; per draft position: "
                    + ", ".join(f"{v:.0%}" for v in row.per_position_acceptance.iloc[0])})
    tpot("speculative decoding: draft model", draft, "code_edit", 1, "code edits, 1 at a time")
    tpot("speculative decoding: draft model, chat", draft, "chat", 1, "chat, 1 at a time")
    if len(identity):
        per_arm = identity.groupby("arm", sort=False).identical.agg(["sum", "size"])
        out.append({"technique": "speculative decoding: output identity",
                    "metric": "greedy outputs identical to the baseline (prompts), "
                              "compared -> identical",
                    "baseline": float(len(identity)), "treated": float(identity.identical.sum()),
                    "article_claim": "(implied) speculation does not change the output",
                    "mechanism": "temperature 0, same prompts, text compared per prompt: "
                                 + "; ".join(f"{a}: {int(r['sum'])}/{int(r['size'])}"
                                             for a, r in per_arm.iterrows())})
    return out


def pick(runs: pd.DataFrame, arm: str | None, workload: str, concurrency: int,
         column: str = "tpot_ms_median") -> float:
    """One value of the run table, nan when that run was not measured."""
    if arm is None or runs.empty:
        return math.nan
    sel = runs[(runs.arm == arm) & (runs.workload == workload) & (runs.concurrency == concurrency)]
    if sel.empty or sel[column].iloc[0] is None:
        return math.nan
    return float(sel[column].iloc[0])


# --------------------------------------------------------------------------
# Measuring (needs a server)
# --------------------------------------------------------------------------

def workload_specs(workload: str, n: int, max_tokens: int) -> list[RequestSpec]:
    """`n` greedy (temperature 0) chat requests of one workload: `code_edit`
    (rewrite the given code: the answer repeats its input) or `chat`."""
    if workload == "code_edit":
        return code_edit_specs(n, max_tokens=max_tokens, temperature=0.0)
    if workload == "chat":
        return chat_specs(n, max_tokens=max_tokens, temperature=0.0)
    raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")


def _per_pos(engine) -> dict[int, float]:
    try:
        return per_position_counts(scrape_text(engine.base_url, engine.api_key))
    except (OSError, RuntimeError, ValueError):  # no /metrics (a proxy), a parse error
        return {}


def measure_workload(engine, arm: SpecArm, workload: str, concurrency: int, n: int,
                     max_tokens: int, *, results: Results | None = None,
                     progress: bool = True, label: str | None = None) -> dict[str, Any]:
    """One run: `n` requests of `workload` with `concurrency` in flight.
    Returns {"row": run-table row, "requests": frame, "chunks": frame, "records": list}."""
    specs = workload_specs(workload, n, max_tokens)
    load = Load.sequential() if concurrency <= 1 else Load.concurrent(int(concurrency))
    label = label or f"{arm.name}/{workload}/c{concurrency}"
    before = _per_pos(engine)
    run = measure(engine, specs, load, label=label, results=results, progress=progress,
                  arm=arm.name, method=arm.method, num_speculative_tokens=arm.k,
                  draft=arm.draft, workload=workload, concurrency=concurrency,
                  host_load_1m_before=host_load())
    per_pos = per_position_rates(before, _per_pos(engine), (run.counters or {}).get(
        "spec_decode_drafts"))
    cols = {"arm": arm.name, "method": arm.method, "k": arm.k, "workload": workload,
            "concurrency": int(concurrency)}
    chunks = chunk_frame(run.records, **cols)
    frame = run.frame().assign(**cols, text=[r.text for r in run.records],
                               chunks=[len(token_chunks(r)) for r in run.records])
    return {"row": run_row(run, arm, workload, int(concurrency), chunks, per_pos, host_load()),
            "requests": frame, "chunks": chunks, "records": run.records}


def measure_arm(engine, arm: SpecArm, *, workloads: Sequence[str] = WORKLOADS, requests: int = 3,
                max_tokens: int = 48, high_concurrency: int = 8,
                high_load_workload: str = "code_edit", results: Results | None = None,
                progress: bool = True) -> list[dict[str, Any]]:
    """Everything one engine measures: each workload one request at a time,
    then `high_load_workload` with `high_concurrency` requests in flight
    (skipped when high_concurrency <= 1)."""
    runs = [(w, 1, requests) for w in workloads]
    if high_concurrency > 1:
        runs.append((high_load_workload, high_concurrency, high_concurrency))
    return [measure_workload(engine, arm, w, c, n, max_tokens, results=results,
                             progress=progress) for w, c, n in runs]


def combine(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate `measure_workload` results: {"runs", "requests", "chunks", "records"}."""
    if not parts:
        return {"runs": pd.DataFrame(columns=["arm", "workload", "concurrency", *RUN_COLUMNS]),
                "requests": pd.DataFrame(columns=["arm", "workload", "concurrency", "index",
                                                  "ok", "text"]),
                "chunks": pd.DataFrame(columns=["arm", "workload", "concurrency", "gap_ms",
                                                "tokens", "per_token_ms"]),
                "records": []}
    return {"runs": pd.DataFrame([p["row"] for p in parts]),
            "requests": pd.concat([p["requests"] for p in parts], ignore_index=True),
            "chunks": pd.concat([p["chunks"] for p in parts], ignore_index=True),
            "records": [r for p in parts for r in p["records"]]}


def run_arms(ctx, names: Sequence[str] | None = None, *,
             workloads: Sequence[str] = WORKLOADS, requests: int = 3, max_tokens: int = 48,
             high_concurrency: int = 8, high_load_workload: str = "code_edit",
             progress: bool = True) -> dict[str, Any]:
    """Every arm of the notebook's plan (or the arms `names`) in turn, one
    engine start each, all runs on one engine before the next; a draft the lab
    derives is built before its engine starts. An arm the target cannot serve
    is skipped and noted (`ctx.arm`)."""
    parts: list[dict[str, Any]] = []
    for name in names or ctx.plan.names:
        arm = ctx.plan.arm(name)
        ensure_draft(arm)
        engine = ctx.arm(arm)
        if engine is not None:
            parts += measure_arm(engine, arm, workloads=workloads, requests=requests,
                                 max_tokens=max_tokens, high_concurrency=high_concurrency,
                                 high_load_workload=high_load_workload, results=ctx.results,
                                 progress=progress)
    return combine(parts)


_explore_runs = itertools.count(1)


def explore_engine(ctx, arm: SpecArm):
    """The engine of an arm chosen in Explore: the planned arm's (`ctx.arm`)
    when the plan declares that engine, else one outside the plan
    (`ctx.any_engine`); None (printed) when the target cannot serve it."""
    ensure_draft(arm)
    planned = ctx.plan.find(None, arm.flags, arm.env or None)
    return (ctx.arm(planned) if planned is not None
            else ctx.any_engine(env=arm.env or None, **arm.flags))


def explore_arm(ctx, method: str, k: int, workload: str, concurrency: int, *,
                requests: int = 3, max_tokens: int = 48, draft_layers: int = 6,
                measured: pd.DataFrame | None = None) -> pd.DataFrame:
    """Explore: one arm (method "none", "ngram", "draft: truncated", "draft: self"
    or "draft: profile") on one workload and concurrency. Rows of `measured`
    (the notebook's run table) for the same workload and concurrency are
    shown beside it for comparison."""
    env = dict(ctx.plan.baseline.env)  # the plan's model-runner pin, if any
    if method == "none":
        arm = baseline_arm(env)
    elif method == "ngram":
        arm = ngram_arm(int(k), ngram_method(ctx.profile), env)
    elif method.startswith("draft"):
        which = method.split(":", 1)[1].strip() if ":" in method else "auto"
        try:
            path, label = draft_source(ctx.profile, which, draft_layers)
        except ConfigError as exc:
            print(f"no draft model: {exc}")
            return pd.DataFrame()
        arm = draft_arm(path, int(k), label, vocabularies_differ(ctx.profile, path), env)
    else:
        raise ValueError(f"unknown method {method!r}")
    engine = explore_engine(ctx, arm)
    if engine is None:
        return pd.DataFrame()
    n = int(concurrency) if concurrency > 1 else int(requests)
    part = measure_workload(engine, arm, workload, int(concurrency), n, int(max_tokens),
                            label=f"explore{next(_explore_runs)}/{arm.name}/{workload}/"
                                  f"c{concurrency}")
    new = pd.DataFrame([part["row"]]).assign(source="explore")
    if measured is not None and len(measured):
        old = measured[(measured.workload == workload) & (measured.concurrency == concurrency)]
        new = pd.concat([old.assign(source="notebook run"), new], ignore_index=True)
    return new.set_index(["source", "arm"])[["workload", "concurrency", *RUN_COLUMNS]]


__all__ = [  # defined here, then the shared names the notebook reads from here
    "NGRAM_LOOKUP", "WORKLOADS", "RUN_COLUMNS", "CHECKLIST_ROW", "SpecArm", "baseline_arm",
    "ngram_arm", "draft_arm", "plan", "draft_table", "explore_methods", "output_identity",
    "identity_summary", "run_row", "compare_to_baseline", "speculation_economics",
    "tpot_samples", "findings", "pick", "workload_specs", "measure_workload", "load_warning",
    "measure_arm", "combine", "run_arms", "explore_engine", "explore_arm",
    "plot_acceptance", "plot_chunk_vs_token", "plot_tpot",
]
