"""lab_utils.quality: log-probs of fixed text, perplexity, greedy answers and
their agreement, on hand-written server responses."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from lab_utils import quality
from lab_utils.workloads import Tokenizer, answer_is_correct


def test_token_logprobs_and_perplexity():
    ids = [5, 7, 9]
    lps = [None, {"7": {"logprob": math.log(0.5), "rank": 1}},
           {"9": {"logprob": math.log(0.25), "rank": 3}, "4": {"logprob": -0.1}}]
    lp, top1 = quality.token_logprobs(ids, lps)
    assert lp.tolist() == pytest.approx([math.log(0.5), math.log(0.25)])
    assert top1.tolist() == [7, -1]   # position 2's rank-1 token is not in the entry
    assert quality.perplexity(-lp.sum(), lp.size) == pytest.approx(math.sqrt(8))
    assert math.isnan(quality.perplexity(0.0, 0))
    with pytest.raises(ValueError, match="lack the prompt token"):
        quality.token_logprobs([1, 2], [None, {"3": {"logprob": -1.0}}])
    with pytest.raises(ValueError, match="prompt logprobs for"):
        quality.token_logprobs([1, 2, 3], [None])
    with pytest.raises(ValueError, match="after the first"):
        quality.token_logprobs([1, 2], [None, None])


def test_perplexity_windows_are_fixed_and_exact():
    tok = Tokenizer(lambda t: [ord(c) for c in t], lambda ids: "".join(map(chr, ids)), "chars")
    a = quality.text_windows(tok, 2, 100)
    assert [len(w) for w in a] == [100, 100] and a[0] != a[1]
    assert a == quality.text_windows(tok, 2, 100)
    with pytest.raises(ValueError):
        quality.text_windows(tok, 99, 10)


@pytest.mark.parametrize("answer, expect, ok", [
    ("The capital of France is Paris.", ["paris"], True),
    ("PARIS", ["paris"], True),
    ("Lyon", ["paris"], False),
    (None, ["x"], False),
])
def test_is_correct(answer, expect, ok):
    assert answer_is_correct(answer, expect) is ok


def test_agreement():
    answers = pd.DataFrame([
        {"arm": "full", "id": "k1", "answer": "Paris.", "correct": True},
        {"arm": "full", "id": "k2", "answer": "Rome", "correct": True},
        {"arm": "full", "id": "k3", "answer": "dunno", "correct": False},
        {"arm": "int8", "id": "k1", "answer": " paris. ", "correct": True},
        {"arm": "int8", "id": "k2", "answer": "Milan", "correct": False},
        {"arm": "int8", "id": "k3", "answer": "no idea", "correct": False},
    ])
    ag = quality.agreement(answers, "int8", "full")
    assert ag["questions"] == 3
    assert ag["identical"] == pytest.approx(1 / 3)
    assert ag["same_verdict"] == pytest.approx(2 / 3)
    assert ag["accuracy"] == pytest.approx(1 / 3)
    assert ag["reference_accuracy"] == pytest.approx(2 / 3)
    assert quality.agreement(answers, "int8", "nothing")["questions"] == 0


def test_compare_logprobs_by_hand():
    base = {"logprobs": np.log([0.5, 0.5, 0.25]), "top1": np.array([1, 2, 3])}
    treated = {"logprobs": np.log([0.5, 0.25, 0.25]), "top1": np.array([1, 9, 3])}
    c = quality.compare_logprobs(base, treated)
    assert c["tokens"] == 3 and c["top1_agreement"] == pytest.approx(2 / 3)
    assert c["ppl_baseline"] == pytest.approx((0.5 * 0.5 * 0.25) ** (-1 / 3))
    assert c["ppl_treated"] == pytest.approx((0.5 * 0.25 * 0.25) ** (-1 / 3))
    assert c["max_abs_logprob_diff"] == pytest.approx(math.log(2))
    assert c["mean_abs_logprob_diff"] == pytest.approx(math.log(2) / 3)
    with pytest.raises(ValueError, match="different token counts"):
        quality.compare_logprobs(base, {"logprobs": [0.0], "top1": [1]})
    assert math.isnan(quality.compare_logprobs({"logprobs": [], "top1": []},
                                               {"logprobs": [], "top1": []})["ppl_baseline"])


def test_answer_specs_are_the_first_questions_greedy():
    specs = quality.answer_specs(3, max_tokens=7)
    assert len(specs) == 3 and len({s.tag for s in specs}) == 3
    assert all(s.temperature == 0.0 and s.max_tokens == 7 for s in specs)
    with pytest.raises(ValueError, match="at most"):
        quality.answer_specs(10_000)


def test_first_difference_and_diff():
    assert quality.first_difference("abc", "abc") is None
    assert quality.first_difference("abc", "abd") == 2
    assert quality.first_difference("ab", "abc") == 2
    assert quality.text_diff("same", "same") == ""
    d = quality.text_diff("x = 1\ny = 2\n", "x = 1\ny = 3\n", b_name="ngram")
    assert d.startswith("first difference at character 10")
    assert "-y = 2" in d and "+y = 3" in d and "+++ ngram" in d


def test_answer_table_and_summary_per_question():
    rows = [("auto", "k01", "Paris. ", True), ("auto", "k08", "Four", True),
            ("fp8", "k01", "Paris.", True), ("fp8", "k08", "five", False)]
    answers = pd.DataFrame([{"arm": a, "id": i, "question": f"q {i}", "answer": text, "ok": True,
                             "correct": ok} for a, i, text, ok in rows])
    t = quality.answer_table(answers)                          # baseline: the first arm
    assert list(t.index) == ["k01", "k08"]
    assert t.correct_auto.tolist() == [True, True] and t.correct_fp8.tolist() == [True, False]
    assert t.same_as_auto_fp8.tolist() == [True, False]        # whitespace does not count
    s = quality.answer_summary(t, ["auto", "fp8", "fp8_e5m2"])  # an arm that did not run
    assert s.loc["auto"].tolist() == [2, 2, 2] and s.loc["fp8"].tolist() == [2, 1, 1]
    assert "fp8_e5m2" not in s.index
    other = quality.answer_table(answers, baseline="fp8")
    assert other.same_as_fp8_auto.tolist() == [True, False] and "same_as_auto_fp8" not in other
    assert quality.answer_summary(other, ["auto", "fp8"], "fp8").loc["fp8"].tolist() == [2, 1, 2]
    assert quality.answer_table(pd.DataFrame()).empty


def test_output_identity_pairs_requests_by_the_given_keys():
    import pandas as pd

    from lab_utils.quality import identity_summary, output_identity
    frame = pd.DataFrame([
        {"arm": "base", "tenant": 1, "index": 0, "ok": True, "text": "abc"},
        {"arm": "base", "tenant": 1, "index": 1, "ok": True, "text": "xyz"},
        {"arm": "new", "tenant": 1, "index": 0, "ok": True, "text": "abc"},
        {"arm": "new", "tenant": 1, "index": 1, "ok": True, "text": "xyq"},
        {"arm": "new", "tenant": 2, "index": 0, "ok": True, "text": "no baseline"}])
    ident = output_identity(frame, "base", keys=("tenant", "index"))
    assert ident.identical.tolist() == [True, False]
    assert ident.first_difference.isna().tolist() == [True, False]
    assert ident.first_difference.iloc[1] == 2          # "xyz" vs "xyq"
    summary = identity_summary(ident, by=("arm", "tenant"))
    assert summary.loc[("new", 1)].tolist() == [2, 1]


def test_the_reference_model_loads_without_a_bar_in_a_log(capfd):
    # transformers draws a "Loading weights" bar as it loads; in a log (stderr no
    # terminal, as under pytest or make run) it is left out, and turned on again after
    from transformers.utils import logging as hf_logging
    from lab_utils.model import embedded_model_dir
    from lab_utils.workloads import local_tokenizer
    model_dir = embedded_model_dir()
    if not (model_dir / "config.json").is_file():
        pytest.skip("the embedded model is not converted (make setup)")
    ids = local_tokenizer(str(model_dir)).encode("The capital of France is Paris.")
    scores = quality.reference_scores(str(model_dir), ids)
    assert len(scores["logprobs"]) == len(ids) - 1   # every token after the first, scored
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
