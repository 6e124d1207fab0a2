"""Perceived latency: what a person reading a streamed answer waits for, from
the arrival time and text of each streamed piece (seconds since the send).

- `first_content_time`: the first piece with visible text;
- `first_sentence_time`: the first complete sentence;
- `word_arrival_times`: when each word became complete;
- `max_unstalled_wpm`: the fastest reader the stream stays ahead of;
- `reader_times`, `reading_schedule`: a reader at a given pace, and how long
  they wait for words that have not arrived;
- `reading_measures`: all of the above for one answer;
- `perceived_reduction_by_length`, `tokens_for_reduction`: what streaming
  saves against waiting for the whole answer, by answer length.

A non-streamed answer is one piece that arrives with the whole body.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

import pandas as pd

#: Typical adult silent reading pace (words per minute); the default reader.
READING_WPM = 250
_SENTENCE_END = re.compile(r"[.!?。！？]")
_WORD = re.compile(r"\S+")


def first_content_time(times: Sequence[float], pieces: Sequence[str]) -> float | None:
    """Arrival of the first piece with visible (non-blank) text."""
    for t, piece in zip(times, pieces):
        if piece and piece.strip():
            return t
    return None


def first_sentence_time(times: Sequence[float], pieces: Sequence[str], *,
                        min_words: int = 3) -> float | None:
    """Arrival of the first complete sentence: a `.`, `!` or `?` (or their CJK
    forms) that ends at least `min_words` words (so "1." of a list does not
    count) and is followed by whitespace, or ends the whole answer (a `.` at
    the end of a chunk may still become "3.5")."""
    text = ""
    for i, (t, piece) in enumerate(zip(times, pieces)):
        start = max(0, len(text) - 1)  # a terminator at the old end may be settled now
        text += piece or ""
        last = i == len(pieces) - 1
        for m in _SENTENCE_END.finditer(text, start):
            end = m.end()
            settled = end < len(text) and text[end].isspace() or (end == len(text) and last)
            if settled and len(_WORD.findall(text[:end])) >= min_words:
                return t
    return None


def word_arrival_times(times: Sequence[float], pieces: Sequence[str]) -> list[float]:
    """When each word became complete: followed by whitespace, or at the end
    of the answer for the last one."""
    text, out = "", []
    for i, (t, piece) in enumerate(zip(times, pieces)):
        text += piece or ""
        words = _WORD.findall(text)
        complete = len(words) if (i == len(pieces) - 1 or (text and text[-1].isspace())) \
            else max(0, len(words) - 1)
        out.extend([t] * (complete - len(out)))
    return out


def max_unstalled_wpm(word_times: Sequence[float]) -> float:
    """The fastest reader (words/min, starting at the first word) who never has
    to wait for a word: min over k of k / (arrival_k - arrival_0). Infinite
    when every word arrives at once (a non-streamed body)."""
    if len(word_times) < 2:
        return math.inf
    t0 = word_times[0]
    rates = [60.0 * k / (t - t0) for k, t in enumerate(word_times[1:], 1) if t > t0]
    return min(rates) if rates else math.inf


def reader_times(word_times: Sequence[float], wpm: float) -> list[float]:
    """When a reader who starts at the first word and reads at `wpm` words/min
    reaches each word, waiting whenever the next word has not arrived yet."""
    if not wpm > 0:
        raise ValueError(f"wpm must be > 0, got {wpm!r}")
    gap = 60.0 / wpm
    out: list[float] = []
    for arrival in word_times:
        out.append(arrival if not out else max(out[-1] + gap, arrival))
    return out


def reading_schedule(word_times: Sequence[float], wpm: float) -> dict[str, float]:
    """`reader_times` summed up: when the reader starts, how long they wait for
    words in all (`stall_s`), and when they finish the answer (`done_s`)."""
    read = reader_times(word_times, wpm)
    if not read:
        return {"start_s": math.nan, "stall_s": math.nan, "done_s": math.nan}
    gap = 60.0 / wpm
    stall = read[-1] - (read[0] + gap * (len(read) - 1))
    return {"start_s": read[0], "stall_s": max(0.0, stall), "done_s": read[-1] + gap}


def reading_measures(times: Sequence[float], pieces: Sequence[str],
                     wpm: float = READING_WPM) -> dict[str, float]:
    """The measures above for one answer (seconds; nan where there is no such
    moment): first content, first sentence, words, the fastest unstalled
    reader, and a reader at `wpm`: the time spent waiting and the finish."""
    nan = lambda v: math.nan if v is None else v  # noqa: E731
    words = word_arrival_times(times, pieces)
    reading = reading_schedule(words, wpm) if words else {}
    return {"first_content_s": nan(first_content_time(times, pieces)),
            "first_sentence_s": nan(first_sentence_time(times, pieces)), "words": len(words),
            "max_unstalled_wpm": max_unstalled_wpm(words) if words else math.nan,
            "reading_stall_s": reading.get("stall_s", math.nan),
            "reading_done_s": reading.get("done_s", math.nan)}


def perceived_reduction_by_length(times: Sequence[float], token_counts: Sequence[int],
                                  first_content: float) -> pd.DataFrame:
    """For a streamed answer: if it had been k tokens long, a non-streaming
    client would have waited for token k (the engine does the same work), a
    streaming one only for the first content. One row per k."""
    rows = []
    seen = 0
    for t, n in zip(times, token_counts):
        for k in range(seen + 1, int(n) + 1):
            rows.append({"tokens": k, "non_stream_wait_ms": t * 1e3,
                         "stream_wait_ms": first_content * 1e3,
                         "perceived_change_pct": (first_content - t) / t * 100 if t > 0 else 0})
        seen = max(seen, int(n))
    return pd.DataFrame(rows)


def tokens_for_reduction(by_length: pd.DataFrame, target_pct: float = -80.0) -> int | None:
    """Shortest answer (tokens) from which the median perceived change reaches
    `target_pct` (e.g. the article's -80%) and stays there."""
    med = by_length.groupby("tokens")["perceived_change_pct"].median().sort_index()
    ok = med <= target_pct
    if not ok.any():
        return None
    bad = med.index[~ok]
    after = med.index[med.index > (bad.max() if len(bad) else -1)]
    return int(after.min()) if len(after) else None


__all__ = ["READING_WPM", "first_content_time", "first_sentence_time", "max_unstalled_wpm", "perceived_reduction_by_length", "reader_times", "reading_measures", "reading_schedule", "tokens_for_reduction", "word_arrival_times"]
