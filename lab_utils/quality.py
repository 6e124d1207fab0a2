"""Quality of what an engine serves, measured the same way in every notebook
that changes numerics (quantization, KV-cache dtype, a smaller model tier).

Two signals, both from the server itself:

* **Log-probs of fixed text** (teacher forcing): vLLM's `prompt_logprobs`
  extra parameter returns, for each prompt token, the log-prob the model gives
  it after the tokens before it, and the model's own top-1 token there. From
  them: perplexity, per-token log-prob differences between two arms, and top-1
  agreement. Same token ids for every arm, so differences are the numerics.
* **Greedy answers** to the shipped quality questions (temperature 0): the
  dataset's correctness rule (`workloads.answer_is_correct`) and agreement
  between two arms' answers, overall (`agreement`) and per question across
  arms (`answer_table`, `answer_summary`); where two greedy texts first
  differ, and a short diff of them (`first_difference`, `text_diff`).
"""
from __future__ import annotations

import difflib
import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .client import Load, RequestSpec
from .errors import ServerError
from .http import post_json
from .workloads import Tokenizer, answer_is_correct, chat, long_documents, quality_questions


def text_windows(tok: Tokenizer, windows: int, tokens: int, *, first_doc: int = 0) -> list[list[int]]:
    """`windows` token-id windows of exactly `tokens` ids, each from the start
    of a different shipped document (datasets/long_documents.jsonl, from
    `first_doc` on): the fixed text every arm is scored on."""
    docs = long_documents()[first_doc:]
    if windows > len(docs):
        raise ValueError(f"at most {len(docs)} windows (one per document), got {windows}")
    out = []
    for doc in docs[:windows]:
        ids = list(tok.encode(doc["text"]))
        if len(ids) < tokens:
            raise ValueError(f"document {doc['id']} has {len(ids)} tokens, fewer than {tokens}")
        out.append(ids[:tokens])
    return out


def token_logprobs(prompt_ids: Sequence[int], prompt_logprobs: Sequence[Mapping | None]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """From a completions response's `prompt_logprobs` (one entry per prompt
    position: None for the first, else a dict keyed by token id — a string in
    JSON — of {"logprob", "rank"} or of bare log-probs): the log-prob of each
    actual prompt token after the first, and the model's top-1 token id at
    each of those positions (-1 where the entry has no rank-1 token)."""
    if len(prompt_logprobs) != len(prompt_ids):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(prompt_ids)} tokens")
    logprobs, top1 = [], []
    for i, (tid, entry) in enumerate(zip(prompt_ids, prompt_logprobs)):
        if entry is None:
            if i:
                raise ValueError(f"prompt position {i} (after the first) has no log-probs")
            continue
        item = entry.get(str(tid), entry.get(tid))
        if item is None:
            raise ValueError(f"prompt logprobs lack the prompt token {tid}")
        logprobs.append(float(item["logprob"] if isinstance(item, Mapping) else item))
        best = [int(t) for t, v in entry.items() if isinstance(v, Mapping) and v.get("rank") == 1]
        top1.append(best[0] if best else -1)
    return np.asarray(logprobs, float), np.asarray(top1, int)


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(mean negative log-likelihood): `nll_sum` = -sum of log-probs."""
    return math.exp(nll_sum / tokens) if tokens else math.nan


def prompt_logprobs(engine, prompt_ids: Sequence[int], top: int = 1) -> list:
    """vLLM's `prompt_logprobs` of a token-id prompt: one non-streaming
    completions request, `max_tokens=1`, `prompt_logprobs=top` (the prompt
    token's own log-prob plus the `top` most likely tokens, ranked)."""
    body = {"model": engine.model, "prompt": list(prompt_ids), "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": top}
    out = post_json(engine, "/v1/completions", body)
    lps = out["choices"][0].get("prompt_logprobs")
    if lps is None:
        raise ServerError("the server returned no prompt_logprobs (is it vLLM?)")
    return lps


def reference_scores(model_dir: str, prompt_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """The same teacher-forced signals as `token_logprobs` of a vLLM response,
    computed by transformers in float32 from the model's own files: the
    log-prob of each prompt token after the first and the top-1 token id at
    each of those positions ({"logprobs", "top1"}, for `compare_logprobs`).
    An independent reference for an engine's numerics (~1 s on 2 cores for
    the embedded model, plus ~4 s to import transformers once)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    bar = hf_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():  # its "Loading weights" bar in a log is noise (~0.1 s here)
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return teacher_forced(model, prompt_ids)


def teacher_forced(model, prompt_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """A transformers causal LM's log-prob of each token of `prompt_ids` after
    the first and its top-1 token id at each of those positions."""
    import torch
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    actual = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    return {"logprobs": actual.numpy().astype(float), "top1": logp.argmax(-1).numpy().astype(int)}


def pooled_perplexity(scores: pd.DataFrame) -> float:
    """Perplexity over every window of `score_text` rows together (their
    negative log-likelihoods and tokens summed), not a mean of perplexities."""
    return perplexity(scores.nll_sum.sum(), int(scores.tokens.sum()))


def score_text(engine, windows: Sequence[Sequence[int]]) -> pd.DataFrame:
    """Perplexity of each fixed window from the server's prompt log-probs: one
    row per window (tokens scored, nll_sum, perplexity, request seconds)."""
    rows = []
    for i, ids in enumerate(windows):
        t0 = time.perf_counter()
        lp, _ = token_logprobs(ids, prompt_logprobs(engine, ids))
        nll = -float(lp.sum())
        rows.append({"window": i, "tokens": int(lp.size), "nll_sum": nll,
                     "perplexity": perplexity(nll, int(lp.size)),
                     "request_s": time.perf_counter() - t0})
    return pd.DataFrame(rows)


def compare_logprobs(base: Mapping[str, np.ndarray], treated: Mapping[str, np.ndarray]
                     ) -> dict[str, float]:
    """Two arms on the same tokens ({"logprobs", "top1"} each): perplexity of
    each, its change, the mean / p99 / largest absolute log-prob difference,
    and top-1 (argmax) agreement."""
    a, b = np.asarray(base["logprobs"], float), np.asarray(treated["logprobs"], float)
    if a.shape != b.shape:
        raise ValueError(f"different token counts: {a.shape} vs {b.shape}")
    if not a.size:
        return {"tokens": 0, **dict.fromkeys(
            ("ppl_baseline", "ppl_treated", "ppl_change_pct", "mean_abs_logprob_diff",
             "p99_abs_logprob_diff", "max_abs_logprob_diff", "top1_agreement"), math.nan)}
    diff = np.abs(b - a)
    ppl_a, ppl_b = perplexity(-a.sum(), a.size), perplexity(-b.sum(), b.size)
    return {"tokens": int(a.size), "ppl_baseline": ppl_a, "ppl_treated": ppl_b,
            "ppl_change_pct": (ppl_b - ppl_a) / ppl_a * 100,
            "mean_abs_logprob_diff": float(diff.mean()),
            "p99_abs_logprob_diff": float(np.percentile(diff, 99)),
            "max_abs_logprob_diff": float(diff.max()),
            "top1_agreement": float(np.mean(np.asarray(base["top1"]) == np.asarray(treated["top1"])))}


def answer_specs(n: int, max_tokens: int = 24) -> list[RequestSpec]:
    """Greedy chat requests for the first `n` shipped quality questions, each
    tagged with its question id."""
    qs = quality_questions()
    if n > len(qs):
        raise ValueError(f"at most {len(qs)} quality questions, got {n}")
    return [RequestSpec(messages=chat(q["question"]), max_tokens=max_tokens, temperature=0.0,
                        tag=q["id"]) for q in qs[:n]]


def answers_frame(records, **columns: Any) -> pd.DataFrame:
    """One row per answered question (records of `answer_specs` requests):
    id, question, answer, ok, and whether it is correct by the dataset's rule."""
    qs = {q["id"]: q for q in quality_questions()}
    return pd.DataFrame([{**columns, "id": r.tag, "question": qs[r.tag]["question"],
                          "answer": r.text, "ok": r.ok,
                          "correct": answer_is_correct(r.text, qs[r.tag]["answer_contains"])}
                         for r in records])


def greedy_answers(engine, n: int, *, max_tokens: int = 24, concurrency: int = 8,
                   label: str = "answers", results=None, progress: bool = False,
                   **columns: Any) -> pd.DataFrame:
    """The engine's greedy answers to the first `n` quality questions, a few
    in flight (greedy answers do not depend on timing): `answers_frame`."""
    from .results import measure
    run = measure(engine, answer_specs(n, max_tokens), Load.concurrent(concurrency),
                  label=label, results=results, progress=progress, **columns)
    return answers_frame(run.records, **columns)


def normalise_answer(text: str | None) -> str:
    """Whitespace and case folded: two answers that differ only there agree."""
    return " ".join((text or "").split()).lower()


def agreement(answers: pd.DataFrame, arm_name: str, reference: str,
              by: str = "arm") -> dict[str, float]:
    """Greedy answers of `arm_name` against `reference` (rows of
    `answers_frame` with an `arm` column), question by question: share of
    identical texts (`normalise_answer`), share with the same verdict (both
    right or both wrong), and the two accuracies."""
    a = answers[answers[by] == arm_name].set_index("id")
    b = answers[answers[by] == reference].set_index("id")
    common = a.index.intersection(b.index)
    if not len(common):
        return {"questions": 0, "identical": math.nan, "same_verdict": math.nan,
                "accuracy": math.nan, "reference_accuracy": math.nan}
    a, b = a.loc[common], b.loc[common]
    same = [normalise_answer(x) == normalise_answer(y) for x, y in zip(a.answer, b.answer)]
    return {"questions": len(common), "identical": float(np.mean(same)),
            "same_verdict": float(np.mean(a.correct.to_numpy() == b.correct.to_numpy())),
            "accuracy": float(a.correct.mean()), "reference_accuracy": float(b.correct.mean())}


def answer_table(answers: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """One row per question from `answers_frame` rows of every arm (an `arm`
    column): each arm's greedy answer, whether it is correct, and whether it
    is the `baseline` arm's answer (default: the first arm's) word for word
    (surrounding whitespace aside)."""
    if answers.empty:
        return pd.DataFrame()
    baseline = baseline or answers.arm.iloc[0]
    table = answers.drop_duplicates("id").set_index("id")[["question"]]
    texts = {arm: frame.set_index("id").answer.fillna("").str.strip()
             for arm, frame in answers.groupby("arm", sort=False)}
    for arm, frame in answers.groupby("arm", sort=False):
        table[f"answer_{arm}"] = texts[arm]
        table[f"correct_{arm}"] = frame.set_index("id").correct
        if arm != baseline and baseline in texts:
            table[f"same_as_{baseline}_{arm}"] = texts[arm] == texts[baseline]
    return table


def answer_summary(table: pd.DataFrame, names: Sequence[str], baseline: str | None = None
                   ) -> pd.DataFrame:
    """Per arm of `names` that `answer_table` holds: questions, correct answers,
    and answers identical to the `baseline` arm's (default: `names[0]`)."""
    baseline = baseline or (names[0] if names else None)
    rows = {}
    for arm in names:
        if f"answer_{arm}" not in table:
            continue
        same = table.get(f"same_as_{baseline}_{arm}")
        rows[arm] = {"questions": len(table), "correct": int(table[f"correct_{arm}"].sum()),
                     "identical_to_baseline": len(table) if arm == baseline
                     else int(same.sum()) if same is not None else None}
    return pd.DataFrame.from_dict(rows, orient="index")


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character, or None if the texts are equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def text_diff(a: str, b: str, *, context: int = 40, a_name: str = "baseline",
              b_name: str = "treated") -> str:
    """A short readable diff: the common text just before the first difference,
    then how each side continues (line-based unified diff of that window)."""
    i = first_difference(a, b)
    if i is None:
        return ""
    start = max(0, i - context)
    wa, wb = a[start:i + 3 * context], b[start:i + 3 * context]
    lines = difflib.unified_diff(wa.splitlines(), wb.splitlines(), a_name, b_name, lineterm="",
                                 n=1)
    return f"first difference at character {i}:\n" + "\n".join(lines)

def output_identity(requests: pd.DataFrame, baseline: str = "baseline",
                    keys: Sequence[str] = ("workload", "concurrency", "index")) -> pd.DataFrame:
    """Per treated arm and prompt (the request identified by `keys`, the
    same in every arm): whether its greedy text equals the `baseline` arm's,
    where they first differ and a short diff (`diff_text`, empty when
    identical). `requests` has one row per request with `arm`, `ok`, `text`
    and the `keys` columns."""
    keys = list(keys)
    cols = ["arm", *keys, "identical", "first_difference", "baseline_chars", "treated_chars",
            "diff_text"]
    if requests.empty or baseline not in set(requests.arm):
        return pd.DataFrame(columns=cols)
    ok = requests[requests.ok.astype(bool)]
    base = {tuple(r[k] for k in keys): r.text for _, r in ok[ok.arm == baseline].iterrows()}
    rows = []
    for _, r in ok[ok.arm != baseline].iterrows():
        ref = base.get(tuple(r[k] for k in keys))
        if ref is None:
            continue
        rows.append({"arm": r.arm, **{k: r[k] for k in keys}, "identical": r.text == ref,
                     "first_difference": first_difference(ref, r.text),
                     "baseline_chars": len(ref), "treated_chars": len(r.text),
                     "diff_text": text_diff(ref, r.text, b_name=r.arm)})
    return pd.DataFrame(rows, columns=cols)


def identity_summary(identity: pd.DataFrame,
                     by: Sequence[str] = ("arm", "workload", "concurrency")) -> pd.DataFrame:
    """Compared and identical prompts of `output_identity`, per group `by`."""
    if identity.empty:
        return pd.DataFrame(columns=["compared", "identical"])
    g = identity.groupby(list(by), sort=False)
    return pd.DataFrame({"compared": g.size(), "identical": g.identical.sum().astype(int)})


__all__ = ["agreement", "answer_specs", "answer_summary", "answer_table", "answers_frame",
           "compare_logprobs", "first_difference", "greedy_answers", "identity_summary",
           "output_identity", "text_diff",
           "normalise_answer", "perplexity", "pooled_perplexity", "prompt_logprobs",
           "reference_scores", "score_text", "teacher_forced",
           "text_windows", "token_logprobs"]
