"""Results: an arm timed outside `measure` is written and recorded like one of its."""
import json

from lab_utils.client import RequestRecord, Run
from lab_utils.results import Results


def test_add_run_writes_the_records_and_the_arm(tmp_path):
    results = Results("07_streaming", tmp_path)
    records = [RequestRecord(index=i, tag="t", label="direct/stream", ttft=0.1 * (i + 1),
                             e2e=0.5 * (i + 1), output_tokens=5, ok=True) for i in range(2)]
    arm = results.add_run(Run("direct/stream", "sequential x1", records, 2.0), max_tokens=5)
    lines = (tmp_path / "07_streaming" / "direct_stream.jsonl").read_text().splitlines()
    assert [json.loads(line)["ttft"] for line in lines] == [0.1, 0.2]
    assert arm["records"] == "07_streaming/direct_stream.jsonl" and arm["max_tokens"] == 5
    assert arm["summary"]["completed"] == 2 and arm["summary"]["ttft_ms_median"] == 150.0
    saved = json.loads(results.path.read_text())
    assert saved["arms"]["direct/stream"]["load"] == "sequential x1"
    assert [r["index"] for r in results.iter_records()] == [0, 1]
