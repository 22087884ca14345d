"""A transformers tokenizer built from a GGUF file's tokenizer metadata.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen2, SmolLM, ...) are built
here as a `tokenizers` BPE model (vocab and merges from the file) with the pre-tokenizer llama.cpp uses
for the file's `tokenizer.ggml.pre`, wrapped in a `PreTrainedTokenizerFast` with the file's special
tokens, BOS/EOS policy and chat template. SentencePiece vocabularies (`"llama"`) are handed to
transformers' own GGUF tokenizer conversion.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` -> the regexes llama.cpp splits text with, applied in turn (llama-vocab.cpp)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,), "gpt2": (_GPT2,), "mpt": (_GPT2,), "olmo": (_GPT2,),
    "llama3": (_LLAMA3,), "llama-v3": (_LLAMA3,), "llama-bpe": (_LLAMA3,), "falcon3": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,), "dbrx": (_LLAMA3,), "pixtral": (_LLAMA3,),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,), "stablelm2": (_QWEN2,),
    # digits one by one, then GPT-2's split
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2), "codeshell": (r"\p{N}", _GPT2),
    "tekken": (_TEKKEN,),
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def build_tokenizer(meta: dict[str, Any], name: str = "") -> Any:
    """The tokenizer the metadata describes, or None when the file has no tokenizer (token ids only).

    meta: the GGUF metadata as Python values (`tokenizer.ggml.*`, `tokenizer.chat_template`).
    name: the GGUF path (for messages, and for transformers' conversion of SentencePiece vocabularies).
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        return None
    if kind == "gpt2":
        return _byte_level_bpe(meta, name)
    if kind == "llama":
        return _sentencepiece(name)
    raise ValueError(f"GGUF file {name}: unsupported tokenizer model {kind!r}; supported: "
                     f"{list(SUPPORTED_TOKENIZER_MODELS)}")


def _special(meta: dict[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _byte_level_bpe(meta: dict[str, Any], name: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"GGUF file {name}: a byte-level BPE tokenizer ('gpt2') needs tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"GGUF file {name}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: "
                         f"{sorted(PRE_TOKENIZER_SPLITS)}")
    # llama.cpp (as Llama 3's own tokenizer.json) takes a piece that is a whole vocab entry as is
    ignore_merges = PRE_TOKENIZER_SPLITS[pre] == (_LLAMA3,)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # control tokens (<|im_start|>, <|endoftext|>) and user-defined ones are matched whole, before BPE
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos, eos = _special(meta, "bos_token_id"), _special(meta, "eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, name_or_path=name,
        bos_token=bos, eos_token=eos, unk_token=_special(meta, "unknown_token_id"),
        pad_token=_special(meta, "padding_token_id"), chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False)


def _sentencepiece(name: str) -> Any:
    """SentencePiece vocabularies: transformers' own GGUF conversion (its scores-to-merges logic)."""
    from transformers import AutoTokenizer

    path = pathlib.Path(name)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"GGUF file {name}: transformers could not build its SentencePiece tokenizer "
                         f"({type(e).__name__}: {e})") from None
