"""Gemma 2 / Gemma 3 text against Hugging Face transformers (PyTorch, float32), and their sliding-window
layers' rolling buffers (window 8, so that every prompt here rolls them)."""

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from test_hf_parity import _check_family, _extend, _hf_greedy_batch, _hf_logits
from tiny_models import GEMMA_FAMILIES, build_hf

import kvjax
from kvjax import engine
from kvjax.cache import KVCache
from kvjax.kernels import attention
from kvjax.models import ModelConfig, extend
from kvjax.models.local import init_cache

RNG = np.random.RandomState(1)
W = 8  # the tiny models' sliding_window


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory):
    """family -> (torch model, folder)."""
    return {f: (build_hf(f, folder := tmp_path_factory.mktemp(f)), folder) for f in GEMMA_FAMILIES}


def _window_positions(length: int) -> np.ndarray:
    """NumPy reference of a rolling buffer after `length` positions: slot p mod W holds the last such p."""
    pos = np.full(W, -1)
    for p in range(length):
        pos[p % W] = p
    return pos


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_logits_match_transformers(gemma_models, family):
    """Batched right-padded prefill (prompts of 9, 23, 16 tokens) and 5 decode steps."""
    hf, folder = gemma_models[family]
    _check_family(hf, folder)


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_forward_without_cache_matches_transformers(gemma_models, family):
    """The training path (cache=None): local layers still attend over their window only."""
    hf, folder = gemma_models[family]
    model = kvjax.load_model(folder)
    ids = RNG.randint(3, model.config.vocab_size, 30)
    logits, cache, _ = extend(model.params, model.config, None, jnp.asarray(ids[None]), jnp.arange(30)[None],
                              fresh=True)
    assert cache is None
    ref = _hf_logits(hf, ids.tolist())
    np.testing.assert_array_less(np.abs(np.asarray(logits[0]) - ref).max(), 1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_greedy_generation_matches_transformers(gemma_models, family):
    hf, folder = gemma_models[family]
    model = kvjax.load_model(folder)
    prompts = [RNG.randint(3, model.config.vocab_size, n).tolist() for n in (4, 19, 11, 30)]
    out = kvjax.generate(model, prompts, max_new_tokens=10, stop_tokens=[])
    np.testing.assert_array_equal(out.tokens, _hf_greedy_batch(hf, prompts, 10))


@pytest.mark.parametrize("family", [pytest.param("gemma2", marks=pytest.mark.slow), "gemma3"])
def test_long_sequence_rolls_the_window(gemma_models, family):
    """40 prompt tokens + 12 generated through window-8 layers: the same tokens as transformers, and
    the local buffers hold exactly the last 8 positions, at slot p mod 8, after prefill and every step."""
    hf, folder = gemma_models[family]
    model = kvjax.load_model(folder)
    cfg = model.config
    n_local, n_global = len(cfg.local_layer_ids), cfg.num_global_layers
    assert n_local and n_global and cfg.sliding_window == W
    prompt = RNG.randint(3, cfg.vocab_size, 40).tolist()
    out = kvjax.generate(model, [prompt], max_new_tokens=12, stop_tokens=[])
    np.testing.assert_array_equal(out.tokens, _hf_greedy_batch(hf, [prompt], 12))
    # decode cache: global layers of bucket (64) + decode room (64 + 16 steps), local layers of W slots only
    per_slot = 2 * cfg.head_dim * 4 + 4 + 1  # k and v float32, pos int32, valid bool
    assert out.cache_bytes == cfg.num_kv_heads * per_slot * (n_global * (64 + 16) + n_local * W)

    ids = prompt + out.tokens[0].tolist()
    ref = _hf_logits(hf, ids)
    cache = init_cache(cfg, 1, 64)
    logits, cache, _ = extend(model.params, cfg, cache, jnp.asarray([prompt]), jnp.arange(40)[None], fresh=True)
    np.testing.assert_array_less(np.abs(np.asarray(logits[0]) - ref[:40]).max(), 1e-4 * np.abs(ref).max())
    for t in range(40, len(ids)):
        assert cache.local.k.shape == (n_local, 1, cfg.num_kv_heads, W, cfg.head_dim)
        assert cache.k.shape == (n_global, 1, cfg.num_kv_heads, 64, cfg.head_dim)
        np.testing.assert_array_equal(np.asarray(cache.local.pos), np.broadcast_to(_window_positions(t), cache.local.pos.shape))
        assert bool(cache.local.valid.all())
        logits, cache, _ = _extend(model.params, cfg, cache, jnp.asarray([[ids[t]]]), jnp.asarray([[t]]), fresh=False)
        np.testing.assert_array_less(np.abs(np.asarray(logits[0, 0]) - ref[t]).max(), 1e-4 * np.abs(ref).max())
    assert int(cache.num_valid().min()) == len(ids)  # the global layers keep everything


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_question_chunk_longer_than_window(gemma_models, family):
    """A 20-token chunk fed after a 13-token prefill: its first queries still see keys that its own later
    tokens overwrite in the buffer (attend first, then write)."""
    hf, folder = gemma_models[family]
    model = kvjax.load_model(folder)
    ids = RNG.randint(3, model.config.vocab_size, 33)
    cache = init_cache(model.config, 1, 40)
    _, cache, _ = extend(model.params, model.config, cache, jnp.asarray(ids[None, :13]), jnp.arange(13)[None],
                         fresh=True)
    logits, cache, _ = extend(model.params, model.config, cache, jnp.asarray(ids[None, 13:]),
                              jnp.arange(13, 33)[None], fresh=False)
    ref = _hf_logits(hf, ids.tolist())
    np.testing.assert_array_less(np.abs(np.asarray(logits[0]) - ref[13:]).max(), 1e-4 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(cache.local.pos[0, 0, 0]), _window_positions(33))


def test_blocked_prefill_matches_transformers(gemma_models, monkeypatch):
    """Prefills longer than QUERY_BLOCK attend in query blocks (the attention op's `blocked` implementation,
    flash left out), local (windowed) layers and soft-caps included."""
    monkeypatch.setattr(attention.reference, "QUERY_BLOCK", 16)
    monkeypatch.setenv(attention.ENV_VAR, "materialized,blocked")
    hf, folder = gemma_models["gemma2"]
    model = kvjax.load_model(folder)
    ids = RNG.randint(3, model.config.vocab_size, 64)
    logits, cache, _ = extend(model.params, model.config, init_cache(model.config, 1, 64), jnp.asarray(ids[None]),
                              jnp.arange(64)[None], fresh=True)
    ref = _hf_logits(hf, ids.tolist())
    np.testing.assert_array_less(np.abs(np.asarray(logits[0]) - ref).max(), 1e-4 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(cache.local.pos[0, 0, 0]), _window_positions(64))


def test_bfloat16_close_to_float32_reference(gemma_models):
    hf, folder = gemma_models["gemma3"]
    model = kvjax.load_model(folder, dtype="bfloat16")
    assert model.params["layers"]["post_mlp_norm"].dtype == jnp.bfloat16
    _check_family(hf, folder, dtype="bfloat16", rtol=5e-2)


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_snapkv_evicts_on_global_layers_only(gemma_models, family):
    """snapkv at compression_ratio=0.5 keeps int(100 * 0.5) = 50 entries per head on each global layer
    (its 32-token window protected); the local buffers are those of an uncompressed prefill, untouched."""
    _, folder = gemma_models[family]
    model = kvjax.load_model(folder)
    cfg = model.config
    prompt = RNG.randint(3, cfg.vocab_size, 100).tolist()
    cache = engine.compress(model, [prompt], policy="snapkv", compression_ratio=0.5)
    assert cache.k.shape[0] == cfg.num_global_layers
    np.testing.assert_array_equal(np.asarray(cache.num_valid()), 50)
    tokens, positions = np.zeros((1, 128), np.int32), np.where(np.arange(128) < 100, np.arange(128), -1)[None]
    tokens[0, :100] = prompt
    _, full, _ = extend(model.params, cfg, init_cache(cfg, 1, 128), jnp.asarray(tokens), jnp.asarray(positions),
                        fresh=True)
    for a, b in zip((cache.local.k, cache.local.v, cache.local.pos, cache.local.valid),
                    (full.local.k, full.local.v, full.local.pos, full.local.valid)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(cache.local.pos[0, 0, 0]), _window_positions(100))
    out = kvjax.generate(model, [prompt], policy="snapkv", compression_ratio=0.5, max_new_tokens=6, stop_tokens=[])
    assert out.kept[0] == 50 and out.tokens.shape == (1, 6)


def test_streaming_llm_on_gemma(gemma_models, family="gemma3"):
    """streaming_llm (budget 16: 4 sinks + the 11 newest after prefill) on the global layers; with a budget
    that evicts nothing, its cache-relative RoPE changes nothing and the tokens are the full cache's."""
    _, folder = gemma_models[family]
    model = kvjax.load_model(folder)
    prompt = RNG.randint(3, model.config.vocab_size, 40).tolist()
    cache = engine.compress(model, [prompt], policy="streaming_llm", budget=16)
    kept = np.asarray(cache.pos)[np.asarray(cache.valid)].reshape(model.config.num_global_layers, 1, -1, 15)
    expected = np.r_[0:4, 29:40]
    np.testing.assert_array_equal(np.sort(kept, axis=-1), np.broadcast_to(expected, kept.shape))
    np.testing.assert_array_equal(np.asarray(cache.local.pos[0, 0, 0]), _window_positions(40))
    out = kvjax.generate(model, [prompt], policy="streaming_llm", budget=16, max_new_tokens=8, stop_tokens=[])
    assert out.kept_final[0] == 15
    wide = kvjax.generate(model, [prompt], policy="streaming_llm", budget=60, max_new_tokens=8, stop_tokens=[])
    full = kvjax.generate(model, [prompt], max_new_tokens=8, stop_tokens=[])
    np.testing.assert_array_equal(wide.tokens, full.tokens)


def _hub_config(name: str) -> dict:
    """config.json of google/gemma-2-2b-it and google/gemma-3-1b-it as published (before layer_types)."""
    if name == "gemma2":
        return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
                "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
                "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
                "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
                "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000, "eos_token_id": [1, 107],
                "bos_token_id": 2, "pad_token_id": 0, "cache_implementation": "hybrid"}
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
            "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144,
            "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0}


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_hub_configs_read_as_transformers_does(family):
    hub = _hub_config(family)
    cfg = ModelConfig.from_hf(hub)
    ref_cls = GEMMA_FAMILIES[family][0]
    ref = ref_cls(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type", "torch_dtype")})
    assert list(cfg.layer_types) == list(ref.layer_types)
    assert cfg.num_global_layers == ref.layer_types.count("full_attention") == (13 if family == "gemma2" else 4)
    assert cfg.sliding_window == ref.sliding_window and cfg.attn_scale == ref.query_pre_attn_scalar ** -0.5
    assert cfg.attn_logit_softcapping == ref.attn_logit_softcapping
    assert cfg.final_logit_softcapping == ref.final_logit_softcapping
    assert cfg.tie_embeddings and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.gemma
    rope = ref.rope_parameters
    if family == "gemma3":
        assert cfg.qk_norm and cfg.rope_theta == rope["full_attention"]["rope_theta"]
        assert cfg.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    else:
        assert not cfg.qk_norm and cfg.rope_theta == rope["rope_theta"] and cfg.rope_local_theta is None


def test_unsupported_gemma_variants_are_refused(gemma_models):
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*multimodal.*Gemma3ForCausalLM"):
        ModelConfig.from_hf(transformers.Gemma3Config().to_dict() | {"architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ValueError, match="model_type 'gemma3'.*multimodal"):
        ModelConfig.from_hf(transformers.Gemma3Config().to_dict())
    with pytest.raises(ValueError, match="GemmaForCausalLM.*Gemma 1"):
        ModelConfig.from_hf(transformers.GemmaConfig().to_dict() | {"architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(_hub_config("gemma3") | {"use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="hidden_activation='silu'.*gelu_pytorch_tanh"):
        ModelConfig.from_hf(_hub_config("gemma2") | {"hidden_activation": "silu"})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf(_hub_config("gemma2") | {"layer_types": ["sliding_attention"] * 3})
    _, folder = gemma_models["gemma2"]
    model = kvjax.load_model(folder)
    cfg = model.config
    plain = KVCache.init(cfg.num_layers, 1, cfg.num_kv_heads, 16, cfg.head_dim, cfg.jnp_dtype)
    with pytest.raises(ValueError, match="init_cache"):
        extend(model.params, cfg, plain, jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None], fresh=True)


def test_export_refuses_gemma(gemma_models):
    from kvjax.models.export import hf_config

    with pytest.raises(ValueError, match="family='gemma2'.*accepted values"):
        hf_config(kvjax.load_model(gemma_models["gemma2"][1]).config)


@pytest.mark.slow
def test_every_policy_runs_on_gemma(gemma_models):
    """Every registered policy on the irregular Gemma 3 layer pattern, in one shared prefill: each runs
    but lookahead_kv and its compositions (or is refused for these prompt lengths as on any model), and
    the uniform ones keep kvpress's int(T * 0.5) entries per head on the global layers."""
    model = kvjax.load_model(gemma_models["gemma3"][1])
    prompts = [RNG.randint(3, model.config.vocab_size, n).tolist() for n in (100, 90)]
    # lookahead_kv and its compositions need an adapter trained for the model (LookaheadKV on Gemma is not
    # supported yet)
    lookahead = set(kvjax.policies.registry.lookahead_presets())
    names = [name for name in kvjax.policies.available() if name not in lookahead]
    settings = [engine.Setting(name, compression_ratio=0.5) for name in names]
    outs = engine.generate_settings(model, prompts, settings, max_new_tokens=6, stop_tokens=[], on_error="return")
    for st, out in zip(settings, outs):
        if isinstance(out, ValueError):
            assert st.policy == "lazy_eviction" and "window" in str(out), (st.policy, out)
            continue
        assert out.tokens.shape == (2, 6) and np.all(out.kept <= [100, 90]), st.policy
        if st.policy in ("snapkv", "pyramidkv", "h2o", "tova", "snapkv_kvpress", "streaming_llm_kvpress"):
            np.testing.assert_array_equal(out.kept, [50, 45], err_msg=st.policy)


@pytest.mark.slow
def test_sharded_gemma_equals_single_device(gemma_models):
    """Batch over `data`, KV heads over `model`, the rolling buffers included; snapkv compresses alike."""
    import jax

    _, folder = gemma_models["gemma3"]
    prompts = [RNG.randint(3, 101, n).tolist() for n in (100, 70)]
    kw = dict(max_new_tokens=8, stop_tokens=[], policy="snapkv", compression_ratio=0.5)
    single = kvjax.generate(kvjax.load_model(folder), prompts, **kw)
    sharded_model = kvjax.load_model(folder, mesh=kvjax.make_mesh(data=2, model=2, devices=jax.devices()[:4]))
    assert sharded_model.params["layers"]["post_attn_norm"].sharding.spec[0] is None
    sharded = kvjax.generate(sharded_model, prompts, **kw)
    np.testing.assert_array_equal(sharded.tokens, single.tokens)
    np.testing.assert_array_equal(sharded.kept, single.kept)


def _kept_sets(cache) -> list:
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    return [sorted(pos[idx][valid[idx]].tolist()) for idx in np.ndindex(pos.shape[:3])]


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_chunked_prefill_on_sliding_window_models(gemma_models, family):
    """Chunked prefill (README "Chunked prefill") on models with local layers and soft-caps: a prompt in
    one chunk gives the one-shot kept sets and tokens; in 32-token chunks StreamingLLM (positions only)
    keeps the one-shot sets, and every local layer's rolling buffer ends as the one-shot one."""
    _, folder = gemma_models[family]
    model = kvjax.load_model(folder)
    prompts = [RNG.randint(3, model.config.vocab_size, n).tolist() for n in (100, 61)]
    for name in ("snapkv", "h2o", "streaming_llm"):
        kw = dict(policy=name, budget=48)
        one = engine.compress(model, prompts, **kw)
        assert _kept_sets(engine.compress(model, prompts, prefill_chunk=128, **kw)) == _kept_sets(one)
        chunked = engine.compress(model, prompts, prefill_chunk=32, **kw)
        np.testing.assert_array_equal(np.asarray(chunked.local.pos), np.asarray(one.local.pos))
        if name == "streaming_llm":
            assert _kept_sets(chunked) == _kept_sets(one)
        a = kvjax.generate(model, prompts, max_new_tokens=6, stop_tokens=[], **kw)
        b = kvjax.generate(model, prompts, max_new_tokens=6, stop_tokens=[], prefill_chunk=128, **kw)
        np.testing.assert_array_equal(a.tokens, b.tokens)
