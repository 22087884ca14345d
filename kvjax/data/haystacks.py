"""Haystack sources for the generated tasks: noise lines, essay words, sentence splitting, keys.

The essay haystack reads a local file when one is given (``data["essay"]``: plain text, or
RULER's ``PaulGrahamEssays.json`` with a ``text`` field) and otherwise the built-in prose of the
bundled vocabulary. Words for keys come from the built-in lists, or from the ``wonderwords``
package when asked for (RULER's lists, for comparable scores on real models).
"""

from __future__ import annotations

import functools
import json
import pathlib
import random
import re
import uuid

from kvjax.data.base import TaskSkipped
from kvjax.data.prose import prose_words
from kvjax.data.words import ADJECTIVES, NOUNS, VERBS

WORD_SOURCES = ("builtin", "wonderwords")

# RULER's 40 evenly spaced needle depths (percent), rounded to int.
DEPTHS: tuple[int, ...] = tuple(int(round(100 * i / 39)) for i in range(40))

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: cut after ``.``, ``!`` or ``?`` followed by whitespace.

    A dependency-free stand-in for NLTK's punkt (which RULER uses); it differs only on
    abbreviations, which move a needle by at most one sentence.
    """
    text = text.strip()
    return [s for s in _SENTENCE_END.split(text) if s] if text else []


@functools.lru_cache(maxsize=4)
def _file_words(path: str) -> tuple[str, ...]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"essay file {path!r} does not exist")
    raw = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        raw = json.loads(raw)["text"]
    words = re.sub(r"\s+", " ", raw).strip().split(" ")
    if not words or words == [""]:
        raise ValueError(f"essay file {path!r} is empty")
    return tuple(words)


def essay_words(n: int, essay_path: str | None) -> list[str]:
    """The first ``n`` words of the essay haystack, cycling the file as RULER does."""
    if essay_path is None:
        return prose_words(n)
    words = _file_words(essay_path)
    reps = -(-n // len(words)) if n else 0
    return list((words * reps)[:n])


@functools.lru_cache(maxsize=2)
def key_words(source: str = "builtin") -> tuple[str, ...]:
    """Sorted, de-duplicated ``adjective-noun`` keys (RULER's word keys)."""
    if source == "builtin":
        adjs, nouns = ADJECTIVES, NOUNS
    elif source == "wonderwords":
        adjs, nouns = _wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt")
    else:
        raise ValueError(f"word source must be one of {WORD_SOURCES}, got {source!r}")
    return tuple(sorted({f"{a}-{n}" for a in adjs for n in nouns}))


@functools.lru_cache(maxsize=2)
def common_words(source: str = "builtin") -> tuple[str, ...]:
    """The common-words vocabulary (nouns, adjectives, verbs), de-duplicated and sorted."""
    if source == "builtin":
        return tuple(sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS)))
    if source == "wonderwords":
        lists = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
        return tuple(sorted({w for name in lists for w in _wonderwords(name)}))
    raise ValueError(f"word source must be one of {WORD_SOURCES}, got {source!r}")


def _wonderwords(name: str) -> tuple[str, ...]:
    try:
        from wonderwords import random_word
    except ImportError as err:
        raise TaskSkipped("word source 'wonderwords' needs the wonderwords package (pip install wonderwords)") from err
    return tuple(random_word._get_words_from_text_file(name))


def pseudo_word(index: int) -> str:
    """A pronounceable filler word, distinct for each ``index``: used when a word list runs out."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    out = ""
    index += 70  # start at three syllables so none collides with a short real word
    while True:
        index, r = divmod(index, len(consonants) * len(vowels))
        out += consonants[r // len(vowels)] + vowels[r % len(vowels)]
        if index == 0:
            return out


def random_value(kind: str, rng: random.Random, words: tuple[str, ...]) -> str:
    """RULER's random keys and values: 7-digit numbers, ``adjective-noun`` words or UUIDv4."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return rng.choice(words)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type must be 'numbers', 'words' or 'uuids', got {kind!r}")


def insert_lines(lines: list[str], items: list[str], fractions: list[float]) -> list[str]:
    """``lines`` with ``items`` inserted, in order, at sorted positions ``int(f * len(lines))``."""
    out = list(lines)
    positions = sorted(int(f * len(lines)) for f in fractions)
    for j, (pos, item) in enumerate(zip(positions, items)):
        out.insert(pos + j, item)
    return out


def require(data: dict[str, str] | None, name: str, task: str, what: str) -> str:
    """The local file path registered under ``name``, or TaskSkipped saying how to give it."""
    path = (data or {}).get(name)
    if not path:
        raise TaskSkipped(
            f"{task} needs {what}: pass --data {name}=PATH (kvjax ships no copy and downloads nothing for it)"
        )
    if not pathlib.Path(path).exists():
        raise TaskSkipped(f"{task}: the {name} file {path!r} does not exist")
    return path
