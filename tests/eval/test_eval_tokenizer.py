"""The bundled tokenizer: loads as a real HF tokenizer, covers the task vocabulary, round-trips."""

import pathlib

import pytest
from tokenizers import Tokenizer

from kvjax.data.prompts import build_prompt, chat_overhead
from kvjax.data.prose import prose_sentences, prose_words
from kvjax.data.words import ADJECTIVES, NOUNS, VERBS
from kvjax.eval.tasks import generate_task, task_names
from kvjax.models.model import load_tokenizer as model_loader
from kvjax.tokenizer import TOKENIZER_DIR, load_tokenizer
from kvjax.tokenizer.build import multi_token_words
from kvjax.training import bundled


def test_loads_with_autotokenizer_and_has_special_tokens(tok):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert auto.get_vocab() == tok.get_vocab()
    assert len(tok) == 2560
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "<|end|>", "<pad>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    size = sum(p.stat().st_size for p in pathlib.Path(TOKENIZER_DIR).iterdir())
    assert size < 1_000_000


def test_every_builtin_word_is_one_token(tok):
    assert multi_token_words(tok) == []


def test_digits_are_single_tokens(tok):
    ids = tok.encode(" 9081726", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[-7:] == list("9081726")


def test_round_trip_on_every_synthetic_task(tok):
    for task in task_names("synthetic"):
        s = generate_task(task, tok, 1024, 1, overhead=chat_overhead(tok))[0]
        text = build_prompt(s, tok).text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert tok.unk_token_id is None or tok.unk_token_id not in tok.encode(text, add_special_tokens=False)


def test_chat_template_renders_one_user_turn(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids


def test_encode_adds_bos_like_llama(tok):
    assert tok("hello")["input_ids"][0] == tok.bos_token_id


def test_prose_is_prefix_stable_and_in_vocabulary():
    assert prose_words(50) == prose_words(120)[:50]
    assert prose_sentences(5) == prose_sentences(9)[:5]
    allowed = {w.lower() for w in ADJECTIVES + NOUNS + VERBS}
    words = {w.strip(".,").lower() for w in prose_words(3000)}
    assert len(words & allowed) > 300  # the filler really uses the word lists
    assert not any(w.isdigit() for w in words)
    assert "special" not in words and "magic" not in words


def test_one_loader_for_checkpoints_and_the_bundled_tokenizer(tmp_path):
    """kvjax.tokenizer.load_tokenizer serves both uses: its ids match the `tokenizers` file itself,
    a folder without tokenizer files gives None (token ids only) or a FileNotFoundError naming it."""
    raw = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    text = "One of the special magic numbers for brave-owl is: 4410527."
    for loaded in (load_tokenizer(), model_loader(TOKENIZER_DIR), bundled.load_tokenizer()):
        assert loaded.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert model_loader(tmp_path) is None and load_tokenizer(tmp_path, required=False) is None
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
