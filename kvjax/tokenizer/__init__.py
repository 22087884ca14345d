"""The bundled model's vocabulary: word lists, built-in prose, and the tokenizer builder/loader."""

from __future__ import annotations

import pathlib

TOKENIZER_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tokenizer"


def load_bundled_tokenizer():
    """The bundled tokenizer (`transformers.PreTrainedTokenizerFast`) from ``kvjax/assets/tokenizer``."""
    from transformers import PreTrainedTokenizerFast

    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no bundled tokenizer in {TOKENIZER_DIR}: run `python -m kvjax.tokenizer.build`")
    return PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))
