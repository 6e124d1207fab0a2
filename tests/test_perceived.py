"""Perceived-latency measures of a streamed answer, on hand-made arrivals."""
import math

import pandas as pd
import pytest

from lab_utils.perceived import (
    first_content_time,
    first_sentence_time,
    max_unstalled_wpm,
    perceived_reduction_by_length,
    reader_times,
    reading_schedule,
    tokens_for_reduction,
    word_arrival_times,
    reading_measures,
)


def test_first_content_skips_role_and_blank_chunks():
    assert first_content_time([0.1, 0.2, 0.3], ["", " ", "Hi"]) == 0.3
    assert first_content_time([0.1], [""]) is None


@pytest.mark.parametrize("pieces, expected", [
    (["The sky", " is blue", ". It", " is"], 3),          # ". " settles at the 3rd piece
    (["The sky is blue", ".", " Yes"], 3),                # "." at a chunk's end waits
    (["Pi is 3", ".", "14 and more"], None),              # "3.14" is not a sentence end
    (["1. ", "Paris is big", "! And"], 3),                # "1." has too few words
    (["Only three words."], 1),                           # the answer's end settles it
    (["no end at all"], None),
    (["东京是日本的首都。", "它很大"], None),               # one CJK "word" < 3 words
])
def test_first_sentence_time(pieces, expected):
    times = [float(i + 1) for i in range(len(pieces))]
    assert first_sentence_time(times, pieces) == expected


def test_word_arrival_times_count_complete_words_only():
    times = [1.0, 2.0, 3.0, 4.0]
    assert word_arrival_times(times, ["Hel", "lo wor", "ld", "!"]) == [2.0, 4.0]
    assert word_arrival_times([1.0, 2.0], ["a b ", "c"]) == [1.0, 1.0, 2.0]
    assert word_arrival_times([5.0], ["one two three"]) == [5.0] * 3   # a non-streamed body
    assert word_arrival_times([], []) == []


def test_max_unstalled_wpm():
    assert max_unstalled_wpm([0.0, 1.0, 2.0]) == pytest.approx(60.0)
    # A slow start limits the reader even if the rest is fa
    assert max_unstalled_wpm([0.0, 2.0, 2.1, 2.2]) == pytest.approx(30.0)
    assert max_unstalled_wpm([3.0, 3.0, 3.0]) == math.inf
    assert max_unstalled_wpm([1.0]) == math.inf


def test_reader_waits_only_when_the_stream_is_behind():
    fast = [0.0, 0.1, 0.2, 0.3]                      # 600 words/min
    assert reader_times(fast, 60) == [0.0, 1.0, 2.0, 3.0]
    assert reading_schedule(fast, 60) == {"start_s": 0.0, "stall_s": 0.0, "done_s": 4.0}
    slow = [0.0, 2.0, 4.0]                           # 30 words/min, reader at 60
    assert reader_times(slow, 60) == [0.0, 2.0, 4.0]
    sched = reading_schedule(slow, 60)
    assert sched["stall_s"] == pytest.approx(2.0) and sched["done_s"] == pytest.approx(5.0)
    body = [3.0, 3.0]                                # non-streamed: all at once, late
    assert reading_schedule(body, 60) == {"start_s": 3.0, "stall_s": 0.0, "done_s": 5.0}
    with pytest.raises(ValueError):
        reader_times(fast, 0)


def test_perceived_reduction_by_length_and_threshold():
    # First content at 0.2 s, then one token each 0.1 s (several per chunk too).
    by = perceived_reduction_by_length([0.2, 0.3, 0.5], [1, 2, 4], 0.2)
    assert list(by.tokens) == [1, 2, 3, 4]
    assert list(by.non_stream_wait_ms.round(3)) == [200.0, 300.0, 500.0, 500.0]
    assert by.perceived_change_pct.iloc[0] == 0.0
    assert by.perceived_change_pct.iloc[-1] == pytest.approx(-60.0)
    assert tokens_for_reduction(by, -50.0) == 3
    assert tokens_for_reduction(by, -80.0) is None


def test_tokens_for_reduction_needs_it_to_stay_reached():
    by = pd.DataFrame({"tokens": [1, 2, 3, 4], "perceived_change_pct": [-10, -85, -70, -90]})
    assert tokens_for_reduction(by, -80) == 4


def test_reading_measures_of_one_answer():
    m = reading_measures([0.1, 0.5, 1.0], ["", "One two. Three", " four."], wpm=60)
    # "two." ends only two words: the first sentence is the whole answer.
    assert m["first_content_s"] == 0.5 and m["first_sentence_s"] == 1.0
    assert m["words"] == 4                          # "Three" completes with " four."
    assert m["max_unstalled_wpm"] == pytest.approx(240.0)   # words 3 and 4, 0.5 s after 1
    assert m["reading_stall_s"] == 0.0 and m["reading_done_s"] == pytest.approx(4.5)
    empty = reading_measures([0.2], [""])
    assert empty["words"] == 0 and math.isnan(empty["first_content_s"])
    assert math.isnan(empty["reading_done_s"]) and math.isnan(empty["max_unstalled_wpm"])
