"""Built-in prose: seeded, grammatical filler sentences over the bundled vocabulary.

It replaces the Paul Graham essays of RULER and the needle-in-a-haystack grid when no essay file
is given, so that every haystack is expressible in the bundled model's vocabulary with no
download. Scores on it are not comparable with published essay-haystack numbers.
"""

from __future__ import annotations

import random

from kvjax.data.words import ADJECTIVES, ADVERBS, DETERMINERS, NAMES, NOUNS, PREPOSITIONS, PRONOUNS, VERBS

_TEMPLATES: tuple[str, ...] = (
    "{Det} {adj} {noun} can {verb} {det} {noun2}.",
    "{Det} {noun} {prep} {det} {adj} {noun2} will {verb} again.",
    "{Pron} {adv} {verb} {det} {adj} {noun} {prep} {det} {noun2}.",
    "{Name} said that {det} {noun} was {adj} and {adj2}.",
    "When {det} {noun} is {adj}, {pron} {verb} {det} {noun2}.",
    "{Name} and {name2} {verb} {det} {noun} {prep} {det} {adj} {noun2}.",
    "{Det} {noun} looked {adj}, so {name} did not {verb} it.",
    "There was {det} {adj} {noun} {prep} {det} {noun2}.",
    "{Pron} think {det} {noun} is more {adj} than {det} {noun2}.",
    "After {det} {adj} {noun} left, {name} began to {verb} {det} {noun2}.",
    "Nobody could {verb} {det} {noun} {prep} {det} {adj} {noun2}.",
    "{Name} will {verb} {det} {adj} {noun} before {det} {noun2} is {adj2}.",
)


def _sentence(rng: random.Random) -> str:
    template = rng.choice(_TEMPLATES)
    pron = rng.choice(PRONOUNS)
    det = rng.choice(DETERMINERS)
    fields = {
        "det": det,
        "Det": det.capitalize(),
        "adj": rng.choice(ADJECTIVES),
        "adj2": rng.choice(ADJECTIVES),
        "noun": rng.choice(NOUNS),
        "noun2": rng.choice(NOUNS),
        "verb": rng.choice(VERBS),
        "prep": rng.choice(PREPOSITIONS),
        "adv": rng.choice(ADVERBS),
        "pron": "I" if pron == "i" else pron,
        "Pron": pron.capitalize(),
        "name": rng.choice(NAMES),
        "name2": rng.choice(NAMES),
        "Name": rng.choice(NAMES),
    }
    # Each {det} gets its own draw so sentences do not repeat one determiner.
    parts = template.split("{det}")
    out = parts[0]
    for part in parts[1:]:
        out += rng.choice(DETERMINERS) + part
    return out.format(**fields)


def prose_sentences(n: int, seed: int = 0) -> list[str]:
    """The first ``n`` sentences of the built-in prose stream for ``seed`` (prefix-stable in ``n``)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(n)]


class ProseStream:
    """The built-in prose for one seed, extended on demand; ``words(n)`` is prefix-stable in ``n``."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._words: list[str] = []

    def words(self, n: int) -> list[str]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        while len(self._words) < n:
            self._words.extend(_sentence(self._rng).split())
        return self._words[:n]


_STREAMS: dict[int, ProseStream] = {}


def prose_words(n: int, seed: int = 0) -> list[str]:
    """The first ``n`` whitespace-separated words of the built-in prose stream for ``seed``."""
    if seed not in _STREAMS:
        _STREAMS[seed] = ProseStream(seed)
    return _STREAMS[seed].words(n)
