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
