"""Speculative decoding's shared pieces: the proposers' engine flags, the
draft model a profile names (named without building it), the per-position
acceptance counters and the acceptance arithmetic (no server needed)."""
import json
import math
from types import SimpleNamespace

import pytest

from lab_utils import derived_models
from lab_utils.arms import Arm
from lab_utils.profiles import ConfigError, load_profile
from lab_utils.speculation import (
    break_even_acceptance,
    describe_draft,
    draft_model_config,
    draft_source,
    ensure_draft,
    expected_tokens_per_step,
    ngram_config,
    per_position_counts,
    per_position_rates,
)


def test_ngram_config_matches_the_issue():
    assert ngram_config(4) == {"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.mark.parametrize("k", [0, -1, 17, 2.0, True, "4"])
def test_bad_k_is_refused(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ngram_config(k)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        draft_model_config("/m", k)


def test_bad_lookup_window_is_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ngram_config(4, prompt_lookup_max=2, prompt_lookup_min=3)


def test_draft_config_needs_a_model():
    assert draft_model_config("/d", 2) == {"model": "/d", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="path or hub id"):
        draft_model_config("", 2)

def test_ensure_draft_builds_only_what_the_lab_derives(monkeypatch, tmp_path):
    from lab_utils import model
    built = []
    monkeypatch.setattr(derived_models, "truncated_model", lambda n: built.append(n))
    monkeypatch.setattr(model, "ensure_embedded_model", lambda: built.append("embedded"))
    for path in (derived_models.truncated_model_dir(5), model.embedded_model_dir(),
                 tmp_path / "other-3L", "Qwen/Qwen2.5-0.5B-Instruct"):
        ensure_draft(SimpleNamespace(draft_path=str(path)))
    ensure_draft(Arm("ngram k=4", {"speculative_config": ngram_config(4)}))  # no draft
    assert built == [5, "embedded"]


def test_draft_source(cpu, gpu, nothing_built):
    assert draft_source(gpu, "auto") == ("Qwen/Qwen2.5-0.5B-Instruct",
                                            "Qwen2.5-0.5B-Instruct")
    assert draft_source(gpu, "profile")[0] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert draft_source(gpu, "self") == ("Qwen/Qwen2.5-7B-Instruct", "self")
    if not cpu.models.get("draft"):  # until the profile names a draft role
        assert draft_source(cpu, "auto", 3) == (str(derived_models.truncated_model_dir(3)),
                                                   "3L")
    assert draft_source(cpu, "truncated", 4) == (str(derived_models.truncated_model_dir(4)),
                                                    "4L")
    from lab_utils.model import embedded_model_dir
    assert draft_source(cpu, "self") == (str(embedded_model_dir()), "self")
    assert draft_source(cpu, "/some/where/mydraft") == ("/some/where/mydraft", "mydraft")
    with pytest.raises(ConfigError, match="cuts the embedded model"):
        draft_source(gpu, "truncated")


def test_draft_source_on_remote_needs_a_named_model():
    remote = load_profile("remote", base_url="http://127.0.0.1:1")
    with pytest.raises(ConfigError):
        draft_source(remote, "self")
    with pytest.raises(ConfigError, match="names no draft"):
        draft_source(remote, "auto")

def test_describe_draft(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 6,
                                                      "hidden_size": 8, "vocab_size": 10}))
    (tmp_path / "lab_derived.json").write_text(json.dumps({"transform": "cut", "x": 1}))
    info = describe_draft(str(tmp_path))
    assert info["layers"] == 6 and info["transform"] == "cut" and "x" not in info
    assert describe_draft("Qwen/Qwen2.5-0.5B-Instruct") == {
        "draft": "Qwen/Qwen2.5-0.5B-Instruct", "local": False}

EXPOSITION = """\
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 1.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
"""


def test_per_position_counts_and_rates():
    after = per_position_counts(EXPOSITION)
    assert after == {0: 9.0, 1: 8.0}
    assert per_position_counts("") == {}
    assert per_position_rates({0: 1.0, 1: 0.0}, after, 10) == [0.8, 0.8]
    assert per_position_rates({}, after, 0) == []
    assert per_position_rates({}, after, None) == []



@pytest.mark.parametrize("alpha, k, tokens", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5),
                                              (0.5, 2, 1.75)])
def test_expected_tokens_per_step(alpha, k, tokens):
    assert expected_tokens_per_step(alpha, k) == pytest.approx(tokens)


def test_expected_tokens_rejects_bad_alpha():
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)


@pytest.mark.parametrize("cost, k", [(1.3, 1), (1.7, 2), (2.5, 4), (4.9, 4)])
def test_break_even_acceptance_pays_the_step_cost(cost, k):
    alpha = break_even_acceptance(cost, k)
    assert 0 < alpha < 1
    assert expected_tokens_per_step(alpha, k) == pytest.approx(cost, rel=1e-6)


def test_break_even_edges():
    assert break_even_acceptance(0.9, 2) == 0.0
    assert math.isnan(break_even_acceptance(3.5, 2))  # more than k+1 steps' worth
