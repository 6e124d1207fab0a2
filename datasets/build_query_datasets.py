"""Rebuild datasets/query_log.jsonl and datasets/typing_sessions.jsonl.

The query log is a seeded sample of LOG_SAMPLES queries drawn from the
LOG_QUERIES below with Zipf weights (rank r has weight 1 / r**ZIPF_S), the
usual shape of search and assistant query logs: a few queries are very
frequent, most are rare. Its `count` field is how often each query was drawn.

The typing sessions are "future" users: each types one query, drawn from the
log in proportion to its count, except that with probability NEW_SHARE the
query is one nobody asked before (from NEW_QUERIES, which are not in the
log; many share a beginning with a logged query, so the predictor guesses
wrong for them). Keystroke times come from `lab_utils.prefetch.typing_timeline`
(lognormal inter-key intervals with a 238 ms mean, then a pause before Enter).

    .venv/bin/python datasets/build_query_datasets.py          # rewrite both files
    .venv/bin/python datasets/build_query_datasets.py --check  # exit 1 if they would change

Deterministic: the same seeds give byte-identical files.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lab_utils.prefetch import TypingSession, typing_timeline

LOG_OUT = HERE / "query_log.jsonl"
SESSIONS_OUT = HERE / "typing_sessions.jsonl"
LOG_SAMPLES = 3000
ZIPF_S = 1.0
SESSIONS = 64
NEW_SHARE = 0.15          # share of never-seen queries among new sessions
LOG_SEED, SESSION_SEED = 2024, 7

#: Queries to a general assistant, most popular first (the Zipf rank).
LOG_QUERIES = """
how do i reset my password
what is machine learning
how to boil an egg
what is the capital of australia
how do i make pancakes
what is python used for
how to lose weight fast
how do i center a div in css
what is the meaning of life
how many ounces in a cup
how to write a cover letter
what is a black hole
how do i change my email address
what are the symptoms of the flu
how long to boil pasta
how to tie a tie
what is the difference between weather and climate
how do i delete my account
what is bitcoin
how to make cold brew coffee
how do i reverse a list in python
what time zone is london in
how to improve my sleep
what is photosynthesis
how many calories in a banana
how do i take a screenshot on windows
what is an api
how to learn spanish quickly
why is the sky blue
how do i make a budget
what is the speed of light
how to remove a stain from a shirt
how do i convert celsius to fahrenheit
what are good exercises for back pain
how to cook rice in a pot
what is inflation
how do i read a csv file in python
what is the tallest mountain in the world
how to start a vegetable garden
how do i write a for loop in javascript
what is a good name for a cat
how to get rid of hiccups
what is the difference between a virus and bacteria
how do i reset my router
what is the best way to study for exams
how to make a paper airplane
what is quantum computing
how do i sort a dictionary by value in python
how to say thank you in japanese
what is the population of canada
how do i set up two factor authentication
what is a healthy breakfast
how to change a flat tire
what is the difference between ram and storage
how do i merge two branches in git
how to meditate for beginners
what is compound interest
how do i cancel my subscription
how to make guacamole
what causes earthquakes
how do i install python on mac
what is a haiku
how to ask for a raise
what are the planets in order
how do i fix a leaking tap
what is the boiling point of water
how to write a haiku
what is sql
how do i update my billing address
how to clean a cast iron pan
what is the largest ocean
how do i undo a commit in git
how to calm down before a presentation
what is a prime number
how do i make a pivot table in excel
what is the best time to visit japan
how to make bread without yeast
what is dna
how do i find my ip address
how to train a puppy to sit
what is the difference between affect and effect
how do i connect to wifi on my laptop
what is the stock market
how to memorize things faster
what is the greenhouse effect
how do i export my contacts
how to fold a fitted sheet
what is a neural network
how do i check my python version
how to write a thank you note
what is the longest river in the world
how do i recover a deleted file
how to keep basil alive
what is a leap year
how do i block a phone number
how to pack a suitcase efficiently
what is renewable energy
how do i print in python
how to make a smoothie
what is a credit score
""".strip().splitlines()

#: Queries the log has never seen (new sessions only).
NEW_QUERIES = """
how do i reset my smart watch
how do i make a sourdough starter
what is the capital of mongolia
how to boil corn on the cob
what is machine translation
how do i center text in word
what is the global interpreter lock in python
how to tie a bowline knot
how many ounces in a pound
what is a white dwarf star
how do i change my username
how long to bake a potato
what is the difference between a lake and a pond
how to make iced tea
how do i reverse a string in javascript
why is the ocean salty
how do i make a spreadsheet formula
what is the speed of sound
how to remove rust from tools
what is deflation
how do i read a json file in python
how to start a compost bin
what is a good name for a dog
how to get rid of fruit flies
what is quantum entanglement
how do i merge two pdf files
what causes thunder
how do i install node on windows
what is a sonnet
how to ask for feedback at work
""".strip().splitlines()


def build_log() -> list[dict]:
    ranks = np.arange(1, len(LOG_QUERIES) + 1)
    weights = 1.0 / ranks ** ZIPF_S
    draws = np.random.default_rng(LOG_SEED).choice(len(LOG_QUERIES), size=LOG_SAMPLES,
                                                   p=weights / weights.sum())
    counts = np.bincount(draws, minlength=len(LOG_QUERIES))
    order = sorted(range(len(LOG_QUERIES)), key=lambda i: (-counts[i], i))
    return [{"id": f"ql{n + 1:03d}", "query": LOG_QUERIES[i], "count": int(counts[i])}
            for n, i in enumerate(order) if counts[i] > 0]


def build_sessions(log: list[dict]) -> list[dict]:
    rng = np.random.default_rng(SESSION_SEED)
    counts = np.array([r["count"] for r in log], dtype=float)
    new_order = rng.permutation(len(NEW_QUERIES))
    sessions, n_new = [], 0
    for k in range(SESSIONS):
        if rng.random() < NEW_SHARE:
            query, in_log = NEW_QUERIES[new_order[n_new % len(NEW_QUERIES)]], False
            n_new += 1
        else:
            query, in_log = log[rng.choice(len(log), p=counts / counts.sum())]["query"], True
        keys, enter = typing_timeline(query, rng)
        sessions.append(TypingSession(f"s{k + 1:03d}", query, tuple(keys), enter,
                                      in_log).to_json())
    return sessions


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the files")
    args = parser.parse_args()
    assert not set(NEW_QUERIES) & set(LOG_QUERIES), "a new query is already in the log"
    log = build_log()
    outputs = {LOG_OUT: render(log), SESSIONS_OUT: render(build_sessions(log))}
    stale = [p.name for p, text in outputs.items()
             if not p.exists() or p.read_text() != text]
    if args.check:
        print("up to date" if not stale else f"would change: {', '.join(stale)}")
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text)
    print(f"wrote {len(log)} logged queries ({sum(r['count'] for r in log)} log entries) and "
          f"{SESSIONS} sessions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
