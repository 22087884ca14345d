"""The bundled model's vocabulary (word lists and prose live in kvjax.data), its builder, and the one
tokenizer loader of kvjax (checkpoint folders and the bundled tokenizer alike)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

TOKENIZER_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(folder: str | os.PathLike = TOKENIZER_DIR, *, required: bool = True) -> Any:
    """transformers' AutoTokenizer from ``folder`` (default: the bundled tokenizer).

    A folder with none of ``TOKENIZER_FILES`` gives None when ``required`` is False (a checkpoint
    used on token ids only), FileNotFoundError otherwise.
    """
    folder = pathlib.Path(folder)
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        if not required:
            return None
        hint = ": run `python -m kvjax.tokenizer.build`" if folder == TOKENIZER_DIR else ""
        raise FileNotFoundError(f"no tokenizer in {folder} (none of {', '.join(TOKENIZER_FILES)}){hint}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def load_bundled_tokenizer() -> Any:
    """The bundled tokenizer from ``kvjax/assets/tokenizer``."""
    return load_tokenizer(TOKENIZER_DIR)


__all__ = ["TOKENIZER_DIR", "TOKENIZER_FILES", "load_bundled_tokenizer", "load_tokenizer"]
