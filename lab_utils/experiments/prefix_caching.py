"""Experiments of `02_prefix_caching`: what vLLM's automatic prefix caching
(`--enable-prefix-caching`, on by default in vLLM V1) does to TTFT.

The two arms differ in that one flag. Each experiment sends, per shared
prefix, one warm-up request first (it fills the cache in the "on" arm; the
"off" arm gets the same request so both arms see identical traffic) and then
the measured requests one at a time, so TTFT is prefill and not queueing.
Warm-up requests are kept (phase "warm-up") but left out of the TTFT
distributions.

vLLM caches KV per *full* block (`block_size` tokens, 128 on the CPU build)
and keys each block by a hash chained over every token before it, so a hit
covers `floor(shared / block_size) * block_size` tokens, and never the last
prompt token (its logits must be computed).
"""
from __future__ import annotations

import itertools
import random
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .. import arms
from ..client import Load, RequestSpec
from ..counters import block_size_of
from ..results import Results, measure
from ..workloads import (Tokenizer, chat, chat_questions, exact_text, synthetic_specs,
                         system_prompts, tokenizer_for)

#: Columns of the per-request frames that the notebook shows.
SHOW = ["arm", "experiment", "prefix_len", "phase", "prompt_tokens", "cached_tokens", "ttft_ms"]


def plan(profile, params) -> arms.Plan:
    """The A/B: two engines that differ in the one flag. Off is the baseline
    and must be said (vLLM V1 turns prefix caching on by default); on is said
    too, so the two command lines differ in exactly that flag."""
    return arms.Plan("02_prefix_caching", (
        arms.Arm("off", {"enable_prefix_caching": False}, title="--no-enable-prefix-caching"),
        arms.Arm("on", {"enable_prefix_caching": True}, knob="enable_prefix_caching",
                 title="--enable-prefix-caching")))


# --------------------------------------------------------------------------
# Pure helpers (unit-tested without a server)
# --------------------------------------------------------------------------

def common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix that all `sequences` share."""
    seqs = [list(s) for s in sequences]
    if not seqs:
        return 0
    n = 0
    for column in zip(*seqs):
        if any(c != column[0] for c in column):
            break
        n += 1
    return n


def expected_cached_tokens(shared_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens vLLM can serve from its prefix cache for a request whose first
    `shared_tokens` tokens are already cached: whole blocks only, and never the
    last prompt token (`max_cache_hit_length = num_tokens - 1` in
    vllm/v1/core/kv_cache_manager.py)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    usable = max(0, min(int(shared_tokens), int(prompt_tokens) - 1))
    return usable // block_size * block_size


def exact_prefix_specs(tok: Tokenizer, n: int, prefix_tokens: int, suffix_tokens: int, *,
                       seed: int = 0, max_tokens: int = 4, tag: str = "block") -> list[RequestSpec]:
    """`n` completions requests given as token ids: the same `prefix_tokens`
    ids, then `suffix_tokens` ids whose first id differs between requests.

    Token ids (not text) so the shared prefix is exact: joining texts can merge
    or share a token at the seam (`workloads.shared_prefix_prompts` puts a
    newline there, which every prompt then shares: prefix + 1 tokens), and a
    one-token difference decides whether a 127- or 255-token prefix fills a block.
    """
    prefix = list(tok.encode(exact_text(tok, prefix_tokens, offset=seed * 7919))) \
        if prefix_tokens else []
    if len(prefix) != prefix_tokens:
        raise ValueError(f"prefix has {len(prefix)} tokens, wanted {prefix_tokens}")
    rng = random.Random(seed)
    suffixes: list[list[int]] = []
    firsts: set[int] = set()
    for _ in range(50 * n):
        if len(suffixes) == n:
            break
        ids = list(tok.encode(exact_text(tok, suffix_tokens, offset=rng.randrange(1, 10**6))))
        if len(ids) == suffix_tokens and ids and ids[0] not in firsts:
            firsts.add(ids[0])
            suffixes.append(ids)
    if len(suffixes) < n:
        raise ValueError(f"could not find {n} suffixes with distinct first tokens")
    return [RequestSpec(prompt=prefix + s, max_tokens=max_tokens, tag=tag, ignore_eos=True)
            for s in suffixes]


def system_prompt_specs(n: int, *, max_tokens: int = 4, seed: int = 0,
                        system: str | None = None) -> list[RequestSpec]:
    """`n` chat requests: the long (512-token) system prompt of
    datasets/system_prompts.json and a different user question each."""
    system = system if system is not None else system_prompts()["long"]
    qs = chat_questions()
    random.Random(seed).shuffle(qs)
    if n > len(qs):
        raise ValueError(f"only {len(qs)} distinct questions; asked for {n}")
    return [RequestSpec(messages=chat(q["question"], system), max_tokens=max_tokens,
                        tag="system_prompt", ignore_eos=True) for q in qs[:n]]


def hit_rate(frame: pd.DataFrame) -> float | None:
    """Prefix-cache hits / queries (tokens, from /metrics) over the runs in `frame`."""
    if frame.empty or "run" not in frame:
        return None
    runs = frame.drop_duplicates("run")
    queries = runs["run_queries"].sum()
    return float(runs["run_hits"].sum() / queries) if queries else None


def hit_rates(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Per arm and experiment: vLLM's prefix-cache queries and hits (tokens,
    /metrics deltas) of the measured requests, their ratio, and the ratio with
    the warm-up requests counted too. vLLM counts no queries when prefix
    caching is off (the lookup is skipped), so the "off" rate is empty."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=["queries", "hits", "hit_rate", "hit_rate_with_warmup"])
    data = pd.concat(frames, ignore_index=True).drop_duplicates("run")
    rows = []
    for (arm, experiment), g in data.groupby(["arm", "experiment"], sort=False):
        m = g[g.phase == "measured"]
        q, h = m.run_queries.sum(), m.run_hits.sum()
        rows.append({"arm": arm, "experiment": experiment, "queries": int(q), "hits": int(h),
                     "hit_rate": h / q if q else None,
                     "hit_rate_with_warmup": hit_rate(g)})
    return pd.DataFrame(rows).set_index(["arm", "experiment"])


def _measured(frame: pd.DataFrame) -> pd.DataFrame:
    if frame is None or frame.empty or "phase" not in frame:
        return pd.DataFrame(columns=[*SHOW, "ok"])
    return frame[(frame.phase == "measured") & frame.ok.astype(bool)]


def ttft_table(frame: pd.DataFrame, by: Sequence[str] = ("arm",)) -> pd.DataFrame:
    """TTFT median/p90/p99 (ms), mean cached tokens and request count of the
    measured (non-warm-up) requests, per group."""
    data = _measured(frame).astype({"ttft_ms": float, "cached_tokens": float,
                                    "prompt_tokens": float})
    groups = data.groupby(list(by))
    out = pd.DataFrame({
        "requests": groups.size(),
        "prompt_tokens": groups.prompt_tokens.median(),
        "cached_tokens": groups.cached_tokens.mean(),
        "ttft_ms_median": groups.ttft_ms.median(),
        "ttft_ms_p90": groups.ttft_ms.quantile(0.90),
        "ttft_ms_p99": groups.ttft_ms.quantile(0.99),
    })
    return out


def arm_change(table: pd.DataFrame, column: str, index: Any = None) -> dict[str, float]:
    """off, on and the change in % of one `ttft_table` column (arms as a level
    of the index; `index` picks the other levels, e.g. a prefix length)."""
    def get(arm: str) -> float:
        key = arm if index is None else (arm, index)
        return float(table.loc[key, column]) if key in table.index else float("nan")
    off, on = get("off"), get("on")
    return {"off": off, "on": on,
            "change_pct": (on - off) / off * 100 if off and np.isfinite(off) else float("nan")}


def gain_vs_hits(frame: pd.DataFrame) -> pd.DataFrame:
    """Per shared-prefix length: median TTFT saved by the cache (off - on) and
    the median cached tokens of the "on" arm, to show that gains track hits."""
    if _measured(frame).empty:
        return pd.DataFrame()
    table = ttft_table(frame, by=("arm", "prefix_len"))
    rows = []
    for p in sorted(_measured(frame).prefix_len.unique()):
        off = arm_change(table, "ttft_ms_median", p)
        cached = table.loc[("on", p), "cached_tokens"] if ("on", p) in table.index else np.nan
        first = frame[(frame.arm == "on") & (frame.phase == "warm-up") & (frame.prefix_len == p)]
        rows.append({"prefix_len": int(p), "ttft_off_ms": off["off"], "ttft_on_ms": off["on"],
                     "saved_ms": off["off"] - off["on"], "change_pct": off["change_pct"],
                     "cached_tokens_on": cached,
                     "first_request_on_ms": first.ttft_ms.mean() if len(first) else np.nan})
    return pd.DataFrame(rows).set_index("prefix_len")


def block_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Experiment (c) per shared-prefix length: tokens really shared, full
    blocks in them, the cached tokens the full-block rule predicts, the cached
    tokens each arm reported (median) and the median TTFT of each arm."""
    data = _measured(frame)
    if data.empty:
        return pd.DataFrame()
    rows = []
    for p, g in data.groupby("prefix_len"):
        bs = int(g.block_size.iloc[0])
        shared = int(g.shared_tokens.iloc[0])
        row = {"prefix_len": int(p), "shared_tokens": shared, "full_blocks": shared // bs,
               "predicted_cached": int(g[g.arm == "on"].predicted_cached.max())
               if (g.arm == "on").any() else np.nan}
        for arm in ("off", "on"):
            a = g[g.arm == arm]
            row[f"cached_{arm}"] = a.cached_tokens.median() if len(a) else np.nan
            row[f"ttft_{arm}_ms"] = a.ttft_ms.median() if len(a) else np.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("prefix_len")


def headline(frames: dict[str, pd.DataFrame]) -> dict[str, Any]:
    """The numbers the findings cite: (a) TTFT median/p99 off and on, hit rate
    and cached/prompt tokens; (b) TTFT at the longest shared prefix."""
    a, b = frames["system_prompt"], frames["prefix_length"]
    ta = ttft_table(a)
    rates = hit_rates(list(frames.values()))

    def rate(exp: str) -> float:
        key = ("on", exp)
        v = rates.loc[key, "hit_rate"] if key in rates.index else None
        return float(v) if v is not None else float("nan")

    longest = int(_measured(b).prefix_len.max()) if len(_measured(b)) else 0
    tb = ttft_table(b[b.prefix_len == longest] if len(b) else b)
    on = lambda t, c: float(t.loc["on", c]) if "on" in t.index else float("nan")  # noqa: E731
    ma = _measured(a)
    samples = {arm: ma[ma.arm == arm].ttft_ms.dropna().tolist() for arm in ("off", "on")}
    off_key = ("off", "system_prompt")
    off = rates.loc[off_key] if off_key in rates.index else None
    reported = bool(len(ma)) and ma.cached_tokens.notna().any()
    return {"a_samples": samples,
            "a_off_queries": int(off["queries"]) if off is not None else 0,
            "a_off_hits": int(off["hits"]) if off is not None else 0,
            "cached_reported": reported,
            "a_median": arm_change(ta, "ttft_ms_median"), "a_p99": arm_change(ta, "ttft_ms_p99"),
            "a_hit_rate": rate("system_prompt"), "a_cached": on(ta, "cached_tokens"),
            "a_prompt": on(ta, "prompt_tokens"), "longest_prefix": longest,
            "b_median": arm_change(tb, "ttft_ms_median"),
            "b_hit_rate": hit_rate(_measured(b)[lambda d: (d.arm == "on")
                                                & (d.prefix_len == longest)]) or float("nan"),
            "b_cached": on(tb, "cached_tokens"), "b_prompt": on(tb, "prompt_tokens")}


def findings(frames: dict[str, pd.DataFrame]) -> list[dict[str, Any]]:
    """The notebook's findings (`headline`): (a) TTFT median and p99 with the
    512-token system prompt, off -> on, with a bootstrap interval from the
    per-request TTFTs (the median is the checklist's row), and (b) TTFT at the
    longest shared prefix; the mechanism is vLLM's prefix-cache counters."""
    h, claim = headline(frames), "prefix caching: TTFT -40-60% (low effort)"
    # off is an engine without prefix caching (no lookups) or, on a remote
    # server, emulated with a fresh cache_salt per request (lookups, no hit)
    off = (f"{h['a_off_hits']} hits of {h['a_off_queries']} queried tokens"
           if h["a_off_queries"] else "no lookups")

    def cached(which: str) -> str:
        if not h["cached_reported"]:
            return ("cached tokens per request not reported (the server runs without "
                    "--enable-prompt-tokens-details)")
        return (f"{h[f'{which}_cached']:.0f} of {h[f'{which}_prompt']:.0f} prompt tokens cached "
                "per request")
    evidence = (f"vllm:prefix_cache_hits/queries = {h['a_hit_rate']:.1%} on the 'on' arm (off: "
                f"{off}); {cached('a')}")
    out = [dict(technique="prefix caching: 512-token system prompt",
                metric=f"TTFT {stat} (ms), off -> on", baseline=h[f"a_{stat}"]["off"],
                treated=h[f"a_{stat}"]["on"], article_claim=claim, mechanism=evidence,
                samples=(h["a_samples"]["off"], h["a_samples"]["on"]), stat=stat,
                checklist="prefix caching:ttft" if stat == "median" else None)
           for stat in ("median", "p99")]
    out.append(dict(
        technique="prefix caching: long shared prefix",
        metric=f"TTFT median (ms), {h['longest_prefix']}-token shared prefix, off -> on",
        baseline=h["b_median"]["off"], treated=h["b_median"]["on"], article_claim=claim,
        mechanism=f"vllm:prefix_cache_hits/queries = {h['b_hit_rate']:.1%}; {cached('b')}"))
    return out


def block_rule_note(frame: pd.DataFrame) -> str:
    """Experiment (c) in one line for the results' notes: cached tokens per case."""
    return "block rule: " + ", ".join(f"{p} shared -> {r.cached_on:.0f} cached"
                                      for p, r in block_table(frame).iterrows())


# --------------------------------------------------------------------------
# Measuring (needs a server)
# --------------------------------------------------------------------------

def _run_group(engine, arm: str, experiment: str, prefix_len: int, warm: list[RequestSpec],
               specs: list[RequestSpec], results: Results | None, progress: bool,
               **columns: Any) -> pd.DataFrame:
    """The warm-up request(s), then the measured ones, each as its own measured
    run (so its /metrics deltas are its own); one row per request."""
    frames = []
    for phase, batch in (("warm-up", warm), ("measured", specs)):
        if not batch:
            continue
        label = f"{arm}/{experiment}/prefix={prefix_len}/{phase}"
        run = measure(engine, batch, Load.sequential(), label=label, results=results,
                      progress=progress)
        c = run.counters or {}
        frames.append(run.frame().assign(
            arm=arm, experiment=experiment, prefix_len=int(prefix_len), phase=phase, run=label,
            run_queries=c.get("prefix_cache_queries", 0.0), run_hits=c.get("prefix_cache_hits", 0.0),
            block_size=block_size_of(engine, 16), **columns))
    frame = pd.concat(frames, ignore_index=True)
    frame["cached_tokens"] = frame["cached_tokens"].fillna(0).astype(int)
    return frame


def system_prompt_ttft(engine, arm: str, requests: int = 12, *, max_tokens: int = 4,
                       results: Results | None = None, progress: bool = True) -> pd.DataFrame:
    """(a) Chat requests sharing the 512-token system prompt, one question each;
    the first is the warm-up."""
    specs = system_prompt_specs(requests + 1, max_tokens=max_tokens)
    system_tokens = int(system_prompts().get("long_tokens", 512))
    return _run_group(engine, arm, "system_prompt", system_tokens, specs[:1], specs[1:],
                      results, progress)


def ttft_vs_prefix_length(engine, arm: str, prefix_lengths: Sequence[int], repeats: int = 3, *,
                          suffix_tokens: int = 64, max_tokens: int = 4, seed: int = 100,
                          results: Results | None = None, progress: bool = True) -> pd.DataFrame:
    """(b) For each shared-prefix length: 1 warm-up + `repeats` completions
    requests of `prefix + suffix_tokens` tokens (lab.synthetic_specs). Each
    length gets its own prefix text (its own seed), so lengths never share blocks;
    the same `seed` gives both arms identical prompts."""
    tok = tokenizer_for(engine)
    frames = []
    for i, p in enumerate(prefix_lengths):
        specs = synthetic_specs(tok, repeats + 1, int(p) + suffix_tokens, prefix_tokens=int(p),
                                max_tokens=max_tokens, seed=seed + i, tag=f"prefix_{p}")
        frames.append(_run_group(engine, arm, "prefix_length", int(p), specs[:1], specs[1:],
                                 results, progress))
    return pd.concat(frames, ignore_index=True)


def block_boundary_hits(engine, arm: str, prefix_lengths: Sequence[int] = (64, 127, 128, 129,
                                                                           255, 256),
                        repeats: int = 2, *, suffix_tokens: int = 64, max_tokens: int = 4,
                        seed: int = 500, results: Results | None = None,
                        progress: bool = True) -> pd.DataFrame:
    """(c) Exact token-id prompts sharing `p` tokens for p around the block
    size; adds the cached tokens vLLM's full-block rule predicts."""
    tok = tokenizer_for(engine)
    bs = block_size_of(engine, 16)
    frames = []
    for i, p in enumerate(prefix_lengths):
        specs = exact_prefix_specs(tok, repeats + 1, int(p), suffix_tokens, seed=seed + i,
                                   max_tokens=max_tokens, tag=f"block_{p}")
        shared = common_prefix_len([s.prompt for s in specs])
        predicted = expected_cached_tokens(shared, int(p) + suffix_tokens, bs) \
            if arm == "on" else 0
        frames.append(_run_group(engine, arm, "block_boundary", int(p), specs[:1], specs[1:],
                                 results, progress, shared_tokens=shared,
                                 predicted_cached=predicted))
    return pd.concat(frames, ignore_index=True)


def run_arms(ctx, names: Sequence[str] | None = None, *, system_requests: int = 12,
             prefix_lengths: Sequence[int] = (0, 512, 1024, 2048), prefix_repeats: int = 3,
             block_prefixes: Sequence[int] = (64, 127, 128, 129, 255, 256),
             block_repeats: int = 2, suffix_tokens: int = 64, max_tokens: int = 4,
             progress: bool = True) -> dict[str, pd.DataFrame]:
    """All three experiments on one arm of the plan, then on the next (one
    engine start per arm; `names` defaults to the plan's arms, off first).
    Returns {"system_prompt", "prefix_length", "block_boundary"} frames; an
    arm the target cannot serve (remote profile) is skipped and noted."""
    def experiments(arm: arms.Arm, engine) -> dict[str, pd.DataFrame]:
        print(f"[{arm.name}] prefix caching per vLLM's cache_config: "
              f"{engine.info.get('cache_config', {}).get('enable_prefix_caching', '?')}, "
              f"block size {block_size_of(engine, 16)}")
        kw = dict(max_tokens=max_tokens, results=ctx.results, progress=progress)
        return {"system_prompt": system_prompt_ttft(engine, arm.name, system_requests, **kw),
                "prefix_length": ttft_vs_prefix_length(engine, arm.name, prefix_lengths,
                                                       prefix_repeats,
                                                       suffix_tokens=suffix_tokens, **kw),
                "block_boundary": block_boundary_hits(engine, arm.name, block_prefixes,
                                                      block_repeats,
                                                      suffix_tokens=suffix_tokens, **kw)}
    measured = list(arms.run(ctx, names or ctx.plan.names, experiments).values())
    return {k: pd.concat([m[k] for m in measured], ignore_index=True) if measured
            else pd.DataFrame(columns=SHOW)
            for k in ("system_prompt", "prefix_length", "block_boundary")}


_explore_seeds = itertools.count(10_000, 100)


def explore_prefix_length(ctx, arm: str, prefix_len: int, repeats: int = 3,
                          suffix_tokens: int = 64) -> pd.DataFrame:
    """Explore: re-run experiment (b) for one prefix length on one arm, with a
    prefix text not used before (so the "on" arm starts cold again)."""
    engine = ctx.arm(arm)
    if engine is None:
        return pd.DataFrame(columns=SHOW)
    frame = ttft_vs_prefix_length(engine, arm, [prefix_len], repeats, suffix_tokens=suffix_tokens,
                                  seed=next(_explore_seeds))
    return frame[SHOW]


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------

def plot_gains_track_hits(frames: Sequence[pd.DataFrame], title: str = "TTFT follows the "
                          "tokens the engine must prefill"):
    """Left: TTFT against cached tokens per request, by arm. Right: TTFT against
    prompt tokens minus cached tokens (the prefill actually done), by arm."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    frames = [f for f in frames if len(f)]
    if not frames:
        print("no measured requests to draw")
        return None
    data = pd.concat([f[SHOW] for f in frames], ignore_index=True)
    data = data[data.phase == "measured"].assign(
        prefilled_tokens=lambda d: d.prompt_tokens - d.cached_tokens)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, x, xlabel in ((axes[0], "cached_tokens", "cached tokens per request (from usage)"),
                          (axes[1], "prefilled_tokens", "prompt tokens − cached tokens")):
        sns.scatterplot(data=data, x=x, y="ttft_ms", hue="arm", style="experiment",
                        hue_order=["off", "on"], alpha=0.75, ax=ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("TTFT (ms, log scale)")
        ax.set_yscale("log")
        ax.legend(fontsize="x-small", ncol=2)
    axes[0].set_title("TTFT against prefix-cache hits")
    axes[1].set_title("TTFT against prefill work left")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_block_hits(frame: pd.DataFrame, block_size: int,
                    title: str = "Only full KV blocks are cached"):
    """Per shared-prefix case ("on" arm): tokens shared, cached tokens measured
    (median) and the full-block prediction, with the block boundaries."""
    import matplotlib.pyplot as plt
    table = block_table(frame)
    if table.empty or table.cached_on.isna().all():
        print("no 'on' arm requests to draw")
        return None
    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.bar(x - 0.2, table.shared_tokens, 0.4, color="lightgrey", label="tokens shared")
    ax.bar(x + 0.2, table.cached_on, 0.4, color="tab:blue",
           label="cached tokens reported (median)")
    ax.scatter(x + 0.2, table.predicted_cached, marker="_", s=600, color="tab:orange",
               zorder=3, label=f"predicted: floor(shared / {block_size}) × {block_size}")
    for k in range(1, int(table.shared_tokens.max()) // block_size + 1):
        ax.axhline(k * block_size, color="tab:red", ls=":", lw=1,
                   label="block boundary" if k == 1 else None)
    ax.set_xticks(x, [str(p) for p in table.index])
    ax.set_xlabel("shared prefix length (tokens)")
    ax.set_ylabel("tokens per request")
    ax.set_ylim(0, table.shared_tokens.max() * 1.5)  # room for the legend
    ax.legend(fontsize="small", loc="upper left", ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


__all__ = ["SHOW", "plan", "findings", "block_rule_note", "common_prefix_len", "expected_cached_tokens", "block_size_of",
           "exact_prefix_specs", "system_prompt_specs", "hit_rate", "hit_rates", "ttft_table",
           "arm_change", "gain_vs_hits", "block_table", "headline", "system_prompt_ttft", "ttft_vs_prefix_length", "block_boundary_hits",
           "run_arms", "explore_prefix_length", "plot_gains_track_hits", "plot_block_hits"]
