"""The prefill observations of the issue-15 scorers against Hugging Face transformers (PyTorch):
`output_norms` (CriticalKV / DefensiveKV) and `query_stats` (ExpectedAttention), on a padded batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_models import build_hf

import kvjax
from kvjax.cache import KVCache
from kvjax.models import extend
from kvjax.observations import ObservationSpec

LENGTHS = (13, 21, 8)


def _hf_reference(hf, ids, start):
    """Per layer: output norms [Hkv, T] from HF's cached values and o_proj, and the mean / covariance
    of the pre-RoPE queries (after q_norm where the model has one) at positions >= start."""
    cfg = hf.config
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    captured = []
    hooks = []
    for layer in hf.model.layers:
        attn = layer.self_attn
        mod = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
        hooks.append(mod.register_forward_hook(lambda m, i, o: captured.append(o.detach())))
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
    for h in hooks:
        h.remove()
    pkv = out.past_key_values
    norms, means, covs = [], [], []
    for l, layer in enumerate(hf.model.layers):
        v = (pkv.layers[l].values if hasattr(pkv, "layers") else pkv[l][1])[0].double().numpy()  # [Hkv,T,D]
        wo = layer.self_attn.o_proj.weight.detach().double().numpy().T.reshape(Hq, D, -1)  # [Hq,D,E]
        G = Hq // Hkv
        norms.append(np.stack([np.mean([np.abs(v[h] @ wo[h * G + g]).sum(-1) for g in range(G)], 0)
                               for h in range(Hkv)]))
        q = captured[l][0].double().numpy().reshape(len(ids), Hq, D).transpose(1, 0, 2)[:, start:]  # [Hq,n,D]
        mu = q.mean(1)
        means.append(mu)
        covs.append(np.stack([(x - m).T @ (x - m) / x.shape[0] for x, m in zip(q, mu)]))
    return np.stack(norms), np.stack(means), np.stack(covs)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_output_norms_and_query_stats_match_transformers(tmp_path, family):
    hf = build_hf(family, tmp_path)
    model = kvjax.load_model(tmp_path)
    cfg = model.config
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, cfg.vocab_size, n).tolist() for n in LENGTHS]
    B, T = len(prompts), max(LENGTHS) + 3  # extra padding columns
    tokens = np.zeros((B, T), np.int32)
    positions = np.full((B, T), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = np.arange(len(p))
    start = 4
    cache = KVCache.init(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, cfg.jnp_dtype)
    _, _, obs = extend(model.params, cfg, cache, jnp.asarray(tokens), jnp.asarray(positions), fresh=True,
                       observe=ObservationSpec(output_norms=True, query_stats=start))
    norms, mean, cov = np.asarray(obs.output_norms), np.asarray(obs.query_mean), np.asarray(obs.query_cov)
    assert norms.shape == (cfg.num_layers, B, cfg.num_kv_heads, T)
    assert obs.rope_inv_freq is not None and len(obs.rope_inv_freq) == cfg.head_dim // 2
    for b, p in enumerate(prompts):
        want_n, want_m, want_c = _hf_reference(hf, p, start)
        n = len(p)
        np.testing.assert_allclose(norms[:, b, :, :n], want_n, rtol=1e-4, atol=1e-6)
        assert (norms[:, b, :, n:] == 0).all()
        np.testing.assert_allclose(mean[:, b], want_m, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(cov[:, b], want_c, rtol=1e-4, atol=1e-6)


def test_specs_merge_and_conflict():
    a = ObservationSpec(window=4, output_norms=True)
    b = ObservationSpec(query_stats=4)
    m = a.merge(b)
    assert (m.window, m.output_norms, m.query_stats) == (4, True, 4)
    assert bool(ObservationSpec(query_stats=0)) and not bool(ObservationSpec())
    with pytest.raises(ValueError, match="query_stats"):
        b.merge(ObservationSpec(query_stats=2))
