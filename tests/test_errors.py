"""Every bad input gets a clear error naming the argument and the accepted values."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kvjax
from tiny_models import build_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("err")
    build_hf("llama3", f)
    return f


@pytest.fixture(scope="module")
def model(folder):
    return kvjax.load_model(folder)


def _copy(folder, tmp_path):
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_unknown_architecture(folder, tmp_path):
    d = _copy(folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        kvjax.load_model(d)


def test_unsupported_rope_type(folder, tmp_path):
    d = _copy(folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    cfg.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"yarn.*llama3"):
        kvjax.load_model(d)


def test_wrong_dtype(folder):
    with pytest.raises(ValueError, match=r"dtype='float16'.*bfloat16.*float32"):
        kvjax.load_model(folder, dtype="float16")


def test_missing_folder_and_missing_weights(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        kvjax.load_model(tmp_path / "nope")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        kvjax.load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config"):
        kvjax.load_model(tmp_path)


def test_missing_tensor(folder, tmp_path):
    d = _copy(folder, tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        kvjax.load_model(d)


def test_shape_mismatch(folder, tmp_path):
    d = _copy(folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_proj.weight.*\(96, 64\).*\(128, 64\)"):
        kvjax.load_model(d)


def test_corrupt_checkpoint_and_config(folder, tmp_path):
    d = _copy(folder, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt safetensors"):
        kvjax.load_model(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt model config"):
        kvjax.load_model(d)


def test_missing_shard_listed_in_index(folder, tmp_path):
    import transformers

    transformers.LlamaForCausalLM.from_pretrained(folder).save_pretrained(tmp_path, max_shard_size="30KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1].name):
        kvjax.load_model(tmp_path)


def test_prompt_longer_than_the_model_allows(model):
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        kvjax.generate(model, [[1] * 500], max_new_tokens=20)


@pytest.mark.parametrize(
    "prompts, exc, match",
    [
        ([], ValueError, "non-empty"),
        ([[]], ValueError, "empty"),
        (["a string"], ValueError, "no tokenizer"),
        ([[1, 2, 400]], ValueError, r"outside the vocabulary \[0, 101\)"),
        ([np.array([1.0, 2.0])], TypeError, "int token ids"),
    ],
)
def test_bad_prompts(model, prompts, exc, match):
    with pytest.raises(exc, match=match):
        kvjax.generate(model, prompts, max_new_tokens=2)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=2.0), "top_p"),
        (dict(budget=8), "need a policy"),
        (dict(questions=[[3], [4]]), "one question per context"),
    ],
)
def test_bad_generation_arguments(model, kw, match):
    kw = {"max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=match):
        kvjax.generate(model, [[1, 2, 3]], **kw)
