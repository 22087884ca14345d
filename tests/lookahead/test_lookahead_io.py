"""LookaheadConfig validation and adapter save / load, with their errors."""

import json

import jax
import numpy as np
import pytest
from tiny_models import build_hf

import kvjax
import kvjax.lookahead as lk


def test_config_defaults_and_from_dict():
    c = lk.LookaheadConfig()
    assert (c.n_tokens, c.rank, c.alpha, c.gqa_reduce, c.pooling, c.kernel, c.protect_last) == (
        32, 8, 32.0, "mean", "max", 7, 0)
    assert c.projections == ("q", "k", "v", "o", "gate", "up", "down") and c.scale == 4.0
    d = {"n_tokens": 8, "projections": ["q", "v"], "pooling": None, "gqa_reduce": "max"}
    assert lk.LookaheadConfig.from_dict(d) == lk.LookaheadConfig(n_tokens=8, projections=("q", "v"), pooling=None,
                                                                 gqa_reduce="max")
    assert lk.LookaheadConfig.from_dict(c.to_dict()) == c
    assert c.span is None and c.offsets == tuple(range(32))
    spread = lk.LookaheadConfig(n_tokens=4, span=10)
    assert spread.offsets == (0, 2, 5, 7) and lk.LookaheadConfig.from_dict(spread.to_dict()) == spread
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lora_rank', 'size'\]"):
        lk.LookaheadConfig.from_dict({"size": 3, "lora_rank": 4})


@pytest.mark.parametrize("field, value, match", [
    ("gqa_reduce", "sum", r"gqa_reduce must be one of \('mean', 'max'\)"),
    ("pooling", "avg", r"pooling must be one of \('max', None\)"),
    ("kernel", 4, "kernel must be odd"),
    ("pool_offset", 4, r"pool_offset must be in \[0, kernel // 2 = 3\]"),
    ("pool_offset", -1, "pool_offset must be an int >= 0"),
    ("bridge", -1, "bridge must be an int >= 0"),
    ("tail", -1, "tail must be an int >= 0"),
    ("tail_weight", 0.0, r"tail_weight must be a float in \(0, 1\]"),
    ("tail_weight", 1.5, r"tail_weight must be a float in \(0, 1\]"),
    ("projections", ("q", "attn"), "projections must be distinct names from"),
    ("n_tokens", 0, "n_tokens must be an int >= 1"),
    ("rank", 0, "rank must be an int >= 1"),
    ("alpha", -1.0, "alpha must be a positive float"),
    ("protect_last", -2, "protect_last must be an int >= 0"),
    ("window", -1, "window must be an int >= 0"),
    ("window_weight", 0.0, "window_weight must be a positive float"),
    ("span", 16, "span must be an int >= 32"),
])
def test_config_bad_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        lk.LookaheadConfig(**{field: value})


def test_init_shapes_and_save_load_roundtrip(tiny, tmp_path):
    conf = lk.LookaheadConfig(n_tokens=5, rank=3, projections=("q", "k", "down"))
    a = lk.init_adapter(tiny, conf, jax.random.PRNGKey(0))
    cfg = tiny.config
    E, L = cfg.hidden_size, cfg.num_layers
    assert a.params["embeddings"].shape == (5, E)
    assert a.params["lora"]["q"]["a"].shape == (L, E, 3)
    assert a.params["lora"]["k"]["b"].shape == (L, 3, cfg.num_kv_heads * cfg.head_dim)
    assert a.params["lora"]["down"]["a"].shape == (L, cfg.intermediate_size, 3)
    assert set(a.params["lora"]) == {"q", "k", "down"}
    assert all(float(abs(f["b"]).max()) == 0.0 for f in a.params["lora"].values())
    bound = 1 / np.sqrt(E)
    qa = np.asarray(a.params["lora"]["q"]["a"])
    assert qa.min() >= -bound and qa.max() <= bound and qa.std() > bound / 3  # U(-1/sqrt(in), 1/sqrt(in))
    table = np.asarray(tiny.params["embed"])
    rows = [np.flatnonzero((table == e).all(1)) for e in np.asarray(a.params["embeddings"])]
    assert all(len(r) >= 1 for r in rows)  # every embedding is a vocabulary token's
    lk.save(a, tmp_path / "ad")
    b = lk.load(tmp_path / "ad", model=tiny)
    assert b.config == conf and b.model_info == a.model_info
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert lk.load(tmp_path / "ad" / "adapter_config.json").config == conf


def test_init_from_given_token_ids_keeps_the_key_s_lora(tiny):
    """token_ids fix the lookahead embeddings (those tokens' rows of the embedding table, in order); the key still
    draws the LoRA factors, as without them."""
    conf = lk.LookaheadConfig(n_tokens=3, rank=2, projections=("q", "up"))
    ids = [7, 2, 7]
    a = lk.init_adapter(tiny, conf, jax.random.PRNGKey(1), token_ids=ids)
    np.testing.assert_array_equal(np.asarray(a.params["embeddings"]),
                                  np.asarray(tiny.params["embed"], np.float32)[ids])
    free = lk.init_adapter(tiny, conf, jax.random.PRNGKey(1))
    for x, y in zip(jax.tree.leaves(a.params["lora"]), jax.tree.leaves(free.params["lora"])):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    V = tiny.config.vocab_size
    for bad in ([1, 2], [1, 2, V], [1, -1, 2]):
        with pytest.raises(ValueError, match=rf"token_ids must be 3 \(n_tokens\) vocabulary ids in \[0, {V}\)"):
            lk.init_adapter(tiny, conf, jax.random.PRNGKey(1), token_ids=bad)


def test_load_errors(tiny, tmp_path):
    a = lk.init_adapter(tiny, lk.LookaheadConfig(n_tokens=2, rank=2), jax.random.PRNGKey(0))
    folder = lk.save(a, tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        lk.load(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="missing adapter.safetensors"):
        lk.load(tmp_path / "half")
    bad = lk.save(a, tmp_path / "corrupt_weights")
    (bad / "adapter.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(ValueError, match="corrupt LookaheadKV adapter weights"):
        lk.load(bad)
    bad = lk.save(a, tmp_path / "corrupt_json")
    (bad / "adapter_config.json").write_text("{ nope")
    with pytest.raises(ValueError, match="corrupt LookaheadKV adapter config"):
        lk.load(bad)
    bad = lk.save(a, tmp_path / "unknown_key")
    meta = json.loads((bad / "adapter_config.json").read_text())
    meta["config"]["temperature"] = 2.0
    (bad / "adapter_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['temperature'\]"):
        lk.load(bad)
    bad = lk.save(a, tmp_path / "wrong_rank")
    meta = json.loads((bad / "adapter_config.json").read_text())
    meta["config"]["rank"] = 3
    (bad / "adapter_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"wrong shape: lora.down.a \(2, 96, 2\) \(expected \(2, 96, 3\)\)"):
        lk.load(bad)


def test_stack_save_load_an_ensemble_and_its_errors(tiny, tmp_path):
    """`stack`: every leaf the members' leaves stacked on a leading axis, members recorded, the first member's
    inference fields unless a config is given; save / load round-trips it; members of different recipes,
    models or nested ensembles are refused, as is a corrupt member count."""
    conf = lk.LookaheadConfig(n_tokens=3, rank=2, projections=("q", "v"))
    a, b = (lk.init_adapter(tiny, conf, jax.random.PRNGKey(i)) for i in (0, 1))
    both = lk.stack([a, b], config=lk.LookaheadConfig(n_tokens=3, rank=2, projections=("q", "v"), kernel=15))
    assert both.members == 2 and both.config.kernel == 15 and lk.stack([a, b]).config == conf
    for x, y, z in zip(jax.tree.leaves(both.params), jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert np.array_equal(np.asarray(x), np.stack([np.asarray(y), np.asarray(z)]))
    assert lk.stack([a]) is not None and lk.stack([a]).members == 1
    lk.save(both, tmp_path / "ens")
    assert json.loads((tmp_path / "ens" / "adapter_config.json").read_text())["members"] == 2
    back = lk.load(tmp_path / "ens", model=tiny)
    assert back.members == 2 and back.config == both.config
    for x, y in zip(jax.tree.leaves(both.params), jax.tree.leaves(back.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    other = lk.init_adapter(tiny, lk.LookaheadConfig(n_tokens=3, rank=4, projections=("q", "v")), jax.random.PRNGKey(2))
    with pytest.raises(ValueError, match=r"adapter 1 differs in its trained fields \['rank'\]"):
        lk.stack([a, other])
    with pytest.raises(ValueError, match="already an ensemble"):
        lk.stack([both, a])
    with pytest.raises(TypeError, match="non-empty sequence of Adapters"):
        lk.stack([])
    meta = json.loads((tmp_path / "ens" / "adapter_config.json").read_text())
    for members, match in ((0, "'members' must be an int >= 1"), (3, r"wrong shape: .*\(expected \(3, ")):
        meta["members"] = members
        (tmp_path / "ens" / "adapter_config.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=match):
            lk.load(tmp_path / "ens")


def test_adapter_for_another_model_is_refused(tiny, tmp_path):
    build_hf("llama2", tmp_path / "mha")  # 4 KV heads instead of 2
    other = kvjax.load_model(tmp_path / "mha")
    a = lk.init_adapter(tiny, lk.LookaheadConfig(n_tokens=2, rank=2), jax.random.PRNGKey(0))
    lk.save(a, tmp_path / "ad")
    with pytest.raises(ValueError, match="trained for another model .*num_heads: adapter 8 vs model 4"):
        lk.load(tmp_path / "ad", model=other)
    with pytest.raises(ValueError, match="num_kv_heads: adapter 2 vs model 4"):
        a.check_model(other.config)


def test_missing_bundled_adapter_says_how_to_pass_one(monkeypatch, tmp_path):
    monkeypatch.setattr(lk.adapter, "BUNDLED", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"no bundled LookaheadKV adapter .*--lookahead PATH"):
        lk.load("bundled")
