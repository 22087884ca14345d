"""Shared fixtures for the evaluation tests: the bundled tokenizer and a character-level one."""

import pytest


@pytest.fixture(scope="session")
def tok():
    from kvjax.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


class CharTokenizer:
    """One token per character: a second, unrelated tokenizer for the length-fitting contract."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="session")
def char_tok():
    return CharTokenizer()
