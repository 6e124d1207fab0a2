"""Prompts: exact-length synthetic text with a stand-in tokenizer (and the
real SmolLM2 tokenizer when its folder exists), and the shipped datasets."""
import itertools
import json
import time
from pathlib import Path

import pytest

from lab_utils import workloads
from lab_utils.client import RequestSpec
from lab_utils.model import embedded_model_dir
from lab_utils.workloads import (
    Tokenizer,
    chat,
    chat_specs,
    code_edit_specs,
    document_specs,
    exact_text,
    shared_prefix_prompts,
    synthetic_specs,
)

_names = itertools.count()


from stand_ins import word_tokenizer  # noqa: E402


@pytest.fixture
def tok():
    return word_tokenizer()


# --------------------------------------------------------------------------
# With the stand-in tokenizer
# --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 64, 500])
def test_exact_text_has_exactly_n_tokens(tok, n):
    text = exact_text(tok, n)
    assert tok.count(text) == n


def test_exact_text_zero_and_offsets(tok):
    assert exact_text(tok, 0) == "" and exact_text(tok, -3) == ""
    a, b = exact_text(tok, 50, offset=0), exact_text(tok, 50, offset=1234)
    assert a != b
    assert exact_text(tok, 50, offset=1234) == b          # deterministic
    # offsets beyond the corpus wrap around and still give exact lengths
    assert tok.count(exact_text(tok, 50, offset=10**9)) == 50


def test_shared_prefix_prompts(tok):
    prompts = shared_prefix_prompts(tok, 5, 40, 12, seed=3)
    assert len(prompts) == 5
    ids = [tok.encode(p) for p in prompts]
    assert all(len(i) == 52 for i in ids)
    assert all(i[:40] == ids[0][:40] for i in ids)
    assert len({tuple(i[40:]) for i in ids}) == 5         # suffixes differ
    assert shared_prefix_prompts(tok, 5, 40, 12, seed=3) == prompts
    assert shared_prefix_prompts(tok, 5, 40, 12, seed=4)[0] != prompts[0]


def test_shared_prefix_zero_prefix(tok):
    prompts = shared_prefix_prompts(tok, 3, 0, 20)
    assert [tok.count(p) for p in prompts] == [20, 20, 20]
    assert not prompts[0].startswith("\n")


def test_synthetic_specs(tok):
    specs = synthetic_specs(tok, 3, 48, prefix_tokens=32, max_tokens=8, priority=1)
    assert len(specs) == 3
    for s in specs:
        assert isinstance(s, RequestSpec) and s.api == "completions"
        assert (s.max_tokens, s.tag, s.ignore_eos, s.priority) == (8, "synthetic", True, 1)
        assert tok.count(s.prompt) == 48
    assert len({tuple(tok.encode(s.prompt)[:32]) for s in specs}) == 1


def test_synthetic_specs_errors(tok):
    with pytest.raises(ValueError, match=r"prefix_tokens \(64\) > input_tokens \(32\)"):
        synthetic_specs(tok, 2, 32, prefix_tokens=64)
    with pytest.raises(ValueError, match="max_tokens"):
        synthetic_specs(tok, 2, 32, max_tokens=0)


def test_exact_text_impossible_length_raises():
    # a tokenizer whose decode doubles the text: no cut re-encodes to 100 tokens
    bad = Tokenizer(lambda t: list(t), lambda ids: "".join(ids) * 2, "doubling")
    with pytest.raises(ValueError, match="could not build a 100-token text"):
        exact_text(bad, 100)
    with pytest.raises(ValueError, match="100-token"):
        synthetic_specs(bad, 1, 100)


# --------------------------------------------------------------------------
# With the real model's tokenizer (the folder `make test` creates first)
# --------------------------------------------------------------------------

MODEL_DIR = embedded_model_dir()
needs_model = pytest.mark.skipif(not (Path(MODEL_DIR) / "tokenizer.json").is_file()
                                 and not (Path(MODEL_DIR) / "tokenizer_config.json").is_file(),
                                 reason=f"no converted model at {MODEL_DIR}")


@pytest.fixture(scope="module")
def real_tok():
    return workloads.local_tokenizer(str(MODEL_DIR))


@needs_model
@pytest.mark.parametrize("n", [1, 16, 100, 512])
def test_real_exact_text(real_tok, n):
    text = exact_text(real_tok, n, offset=n * 31)
    assert real_tok.count(text) == n


@needs_model
def test_real_shared_prefix_prompts(real_tok):
    prompts = shared_prefix_prompts(real_tok, 4, 64, 32, seed=1)
    ids = [real_tok.encode(p) for p in prompts]
    prefix = real_tok.encode(exact_text(real_tok, 64, offset=1 * 7919))
    assert len(prefix) == 64
    assert all(i[:64] == prefix for i in ids)             # shared exactly, in tokens
    assert all(abs(len(i) - 96) <= 2 for i in ids)
    assert len(set(prompts)) == 4


@needs_model
def test_real_synthetic_specs(real_tok):
    specs = synthetic_specs(real_tok, 2, 128, prefix_tokens=96, max_tokens=4)
    ids = [real_tok.encode(s.prompt) for s in specs]
    assert ids[0][:96] == ids[1][:96]
    assert all(abs(len(i) - 128) <= 2 for i in ids)


@needs_model
def test_the_fast_tokenizer_gives_what_transformers_gives():
    """local_tokenizer reads tokenizer.json without transformers; the ids and
    the text must be transformers' own, on the shipped texts and on the
    special tokens' spelling."""
    from transformers import AutoTokenizer
    assert workloads._tokenizer_json(Path(MODEL_DIR)) is not None, "the fast path is taken"
    ref = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    fast = workloads.local_tokenizer.__wrapped__(str(MODEL_DIR))
    texts = [d["text"] for d in workloads.long_documents()[:4]]
    texts += [p["instruction"] + "\n```" + p["language"] + "\n" + p["code"] + "\n```"
              for p in workloads.code_edit_prompts()[:3]]
    texts += ["<|im_start|>user\nHi<|im_end|>", "  two  spaces, tabs\t\tand é, 東京, 🙂 .", ""]
    for text in texts:
        ids = ref(text, add_special_tokens=False).input_ids
        assert fast.encode(text) == ids
        assert fast.decode(ids) == ref.decode(ids)
    cut = ref(texts[0], add_special_tokens=False).input_ids[3:40]   # a cut inside words
    assert fast.decode(cut) == ref.decode(cut)


def test_the_fast_tokenizer_is_not_taken_where_transformers_would_differ(tmp_path):
    assert workloads._tokenizer_json(tmp_path) is None                 # no tokenizer.json
    if not (Path(MODEL_DIR) / "tokenizer.json").is_file():
        pytest.skip(f"no converted model at {MODEL_DIR}")
    (tmp_path / "tokenizer.json").write_bytes((Path(MODEL_DIR) / "tokenizer.json").read_bytes())
    assert workloads._tokenizer_json(tmp_path) is not None             # no config: as transformers
    for config in ({"clean_up_tokenization_spaces": True}, {"tokenizer_class": "LlamaTokenizer"}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        assert workloads._tokenizer_json(tmp_path) is None, config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2TokenizerFast"}))
    assert workloads._tokenizer_json(tmp_path) is not None


# --------------------------------------------------------------------------
# Shipped datasets (structure only)
# --------------------------------------------------------------------------

def test_chat_helper():
    assert chat("q") == [{"role": "user", "content": "q"}]
    assert chat("q", "be brief") == [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "q"}]


def test_unknown_dataset_names_the_available_ones():
    with pytest.raises(FileNotFoundError, match="chat_questions.jsonl"):
        workloads.dataset_path("nope.jsonl")


def test_datasets_have_their_fields():
    qs = workloads.chat_questions()
    assert qs and all(q["id"] and q["question"].strip() for q in qs)
    docs = workloads.long_documents()
    assert docs and all(d["id"] and d["title"] and d["text"].strip() for d in docs)
    edits = workloads.code_edit_prompts()
    assert edits and all(e["language"] and e["instruction"] and e["code"] for e in edits)
    quality = workloads.quality_questions()
    assert quality and all(q["question"] and q["answer_contains"] for q in quality)
    sp = workloads.system_prompts()
    assert sp["long"] and sp["short"] and isinstance(sp["checks"], list)
    prefixes = workloads.warmup_prefixes()
    assert prefixes and all(isinstance(p, str) and p for p in prefixes)


def test_chat_specs():
    n = len(workloads.chat_questions()) + 3       # cycles past the end
    specs = chat_specs(n, max_tokens=16, system="be brief", seed=2, priority=1)
    assert len(specs) == n
    for s in specs:
        assert s.api == "chat" and s.tag == "chat" and s.max_tokens == 16 and s.priority == 1
        assert s.messages[0] == {"role": "system", "content": "be brief"}
        assert s.messages[-1]["role"] == "user" and s.messages[-1]["content"].strip()
    assert chat_specs(5, seed=2) == chat_specs(5, seed=2)
    assert chat_specs(3)[0].messages[0]["role"] == "user"


def test_document_specs():
    specs = document_specs(3, max_tokens=8, question="Summarize.")
    assert len(specs) == 3 and len({s.messages[-1]["content"] for s in specs}) == 3
    for s in specs:
        assert s.tag == "long" and s.max_tokens == 8 and s.api == "chat"
        content = s.messages[-1]["content"]
        assert content.endswith("\n\nSummarize.") and len(content) > 1000


def test_code_edit_specs():
    specs = code_edit_specs(2)
    assert len(specs) == 2
    for s in specs:
        assert s.tag == "code_edit" and s.max_tokens == 256
        assert s.messages[-1]["content"].count("```") == 2


# --------------------------------------------------------------------------
# Warm-up (against the fake OpenAI server of conftest)
# --------------------------------------------------------------------------

def _engine(fake, model="chat"):
    from types import SimpleNamespace
    return SimpleNamespace(base_url=fake.base_url, model=model, api_key=None)


def test_warm_up_ramps_once_per_engine_with_unique_prompts(fake, monkeypatch):
    monkeypatch.setattr(workloads, "_WARMED", set())         # no engine warmed up before
    engine = _engine(fake)
    t0 = time.perf_counter()  # the fake stamps arrivals with the same clock
    workloads.warm_up(engine, 3, max_tokens=12, spacing_s=0.05, once=True)
    workloads.warm_up(engine, 3, max_tokens=12, spacing_s=0.05, once=True)
    assert len(fake.requests) == 3                           # once per engine
    bodies = [r["body"] for r in fake.requests]
    assert all(b["ignore_eos"] and b["max_tokens"] == 12 for b in bodies)
    assert len({b["messages"][-1]["content"] for b in bodies}) == 3
    assert all(r["path"] == "/v1/chat/completions" for r in fake.requests)
    # The third is sent 2 x 50 ms after the run starts, never earlier. A lower bound
    # from the test's own start: a busy machine delays sends, which can bunch them
    # up (arrivals once came 22 ms apart in all under two test streams).
    assert max(r["time"] for r in fake.requests) - t0 >= 0.10
    workloads.warm_up(engine)                                  # without `once`: again
    assert len(fake.requests) == 4


def test_warm_up_several_engines_and_a_completions_prompt(fake):
    engines = [_engine(fake, "text"), _engine(fake, "text")]
    workloads.warm_up(engines, prompt="Hello", api="completions")
    assert [r["path"] for r in fake.requests] == ["/v1/completions"] * 2
    assert all(r["body"]["prompt"] == "Hello" and r["body"]["max_tokens"] == 4
               and r["body"]["temperature"] == 0.0 for r in fake.requests)
    with pytest.raises(ValueError, match="api must be"):
        workloads.warm_up(engines, api="embeddings")


def test_warm_up_prompt_is_not_from_the_datasets():
    texts = [q["question"] for q in workloads.chat_questions() + workloads.quality_questions()]
    assert not any(t.startswith(workloads.WARM_UP_PROMPT.split("{")[0]) for t in texts)
