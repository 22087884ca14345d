"""Checkpoint loading: sharded safetensors, the local Hub cache, tokenizers and chat templates."""

import json
import shutil

import numpy as np
import pytest

import kvjax
from tiny_models import build_hf


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_hf("llama3", folder)
    return folder


def _leaves(params):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_sharded_checkpoint_equals_single_file(tmp_path, llama_folder):
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(llama_folder)
    hf.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    a, b = kvjax.load_model(llama_folder), kvjax.load_model(tmp_path)
    for x, y in zip(_leaves(a.params), _leaves(b.params)):
        np.testing.assert_array_equal(x, y)


def _hub_cache(tmp_path, folder, repo="tiny-org/tiny-llama"):
    """Lays out `folder` as huggingface_hub's cache would after a download."""
    root = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        shutil.copy(f, snap / f.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    return tmp_path / "hub", repo


def test_hub_id_loads_offline_from_local_cache(tmp_path, llama_folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_dir, repo = _hub_cache(tmp_path, llama_folder)
    model = kvjax.load_model(repo, cache_dir=str(cache_dir))
    ref = kvjax.load_model(llama_folder)
    for x, y in zip(_leaves(model.params), _leaves(ref.params)):
        np.testing.assert_array_equal(x, y)


def test_hub_id_missing_everywhere_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not in the local Hub cache"):
        kvjax.load_model("nobody/no-such-model", cache_dir=str(tmp_path))


def _save_tokenizer(folder, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
    fast.save_pretrained(folder)


def test_tokenizer_texts_and_chat_template(tmp_path, llama_folder):
    for f in llama_folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    _save_tokenizer(tmp_path, 101)
    model = kvjax.load_model(tmp_path)
    assert model.tokenizer is not None
    text = "w5 w11 w12 w40 w3"
    ids = model.tokenizer(text)["input_ids"]
    out_text = kvjax.generate(model, [text], max_new_tokens=6, stop_tokens=[])
    out_ids = kvjax.generate(model, [ids], max_new_tokens=6, stop_tokens=[])
    np.testing.assert_array_equal(out_text.tokens, out_ids.tokens)
    assert out_text.texts[0] == model.tokenizer.decode(out_ids.tokens[0].tolist(), skip_special_tokens=True)
    chat = kvjax.generate(model, [text], max_new_tokens=6, stop_tokens=[], chat_template=True)
    templated = model.tokenizer("w7 " + text + " w8 w9")["input_ids"]
    np.testing.assert_array_equal(chat.tokens, kvjax.generate(model, [templated], max_new_tokens=6, stop_tokens=[]).tokens)


def test_folder_without_tokenizer_works_on_ids(llama_folder):
    model = kvjax.load_model(llama_folder)
    assert model.tokenizer is None
    out = kvjax.generate(model, [[1, 5, 9]], max_new_tokens=3, stop_tokens=[])
    assert out.texts is None and out.tokens.shape == (1, 3)


def test_config_fields(llama_folder):
    cfg = kvjax.ModelConfig.from_file(llama_folder / "config.json")
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.rope_theta) == ("llama", 8, 2, 4, 500000.0)
    hf = json.loads((llama_folder / "config.json").read_text())
    assert cfg.head_dim == hf["hidden_size"] // hf["num_attention_heads"]
