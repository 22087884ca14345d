"""KVzip: the engine's reconstruction observation against transformers + NumPy (subsampled softmax
of the repeat pass), and the kept sets against a NumPy global selection (GQA 8/2, padded batch)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvzip_reference import hf_kvzip_scores
from pol_helpers import HKV, assert_same_kept, kept_positions, make_inputs
from tiny_models import build_hf

import kvjax
from kvjax.cache import KVCache
from kvjax.passes.reconstruction import (
    Reconstruction,
    reconstruction_scores,
    subsampled_column_max,
    subsampled_column_max_reference,
)
from kvjax.models import extend
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies import KVzip, get

SPEC = Reconstruction(chunk_size=8, n_sink=2, postfix=3, first_ids=(5, 6, 7), next_ids=(8, 9), suffix_ids=(10,))
LENGTHS = (13, 21, 8)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_reconstruction_matches_transformers(tmp_path, family):
    hf = build_hf(family, tmp_path)
    model = kvjax.load_model(tmp_path)
    cfg = model.config
    rng = np.random.RandomState(5)
    prompts = [rng.randint(11, cfg.vocab_size, n).tolist() for n in LENGTHS]
    B, T = len(prompts), 24  # a bucket wider than the longest prompt
    tokens = np.zeros((B, T), np.int32)
    positions = np.full((B, T), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = np.arange(len(p))
    cache = KVCache.init(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, cfg.jnp_dtype)
    _, cache, _ = extend(model.params, cfg, cache, jnp.asarray(tokens), jnp.asarray(positions), fresh=True)
    got = np.asarray(jax.jit(reconstruction_scores, static_argnums=(1, 5))(
        model.params, cfg, cache, jnp.asarray(tokens), jnp.asarray(positions), SPEC))
    for b, p in enumerate(prompts):
        want = hf_kvzip_scores(hf, p, SPEC)
        np.testing.assert_allclose(got[:, b, :, : len(p)], want, rtol=2e-4, atol=1e-6)
        assert (got[:, b, :, len(p):] == 0).all()


def kvzip_reference(policy, s, lengths, L, budget=None, ratio=None):
    """Sinks kept; the rest of the budget to the best scores over (layer, head) or (head) per layer."""
    out = {}
    for b, T in enumerate(lengths):
        n0 = policy.n_sink
        C = budget if ratio is None else int(T * (1 - ratio))
        sinks = set(range(min(n0, T)))
        if min(C, T) >= T:
            for l in range(L):
                for h in range(HKV):
                    out[(l, b, h)] = (set(range(T)), {}, sinks)
            continue
        groups = [list(range(L))] if not policy.layerwise else [[l] for l in range(L)]
        for ls in groups:
            S = HKV * len(ls)
            if ratio is None:
                total = S * C
            elif policy.rule == "kvpress":
                total = S * T - int(S * T * ratio)
            else:
                total = int(T * (1 - ratio) * S)
            cands = [(l, h, j) for l in ls for h in range(HKV) for j in range(n0, T)]
            order = sorted(cands, key=lambda c: (-s[c[0], b, c[1], c[2]], c[2], c[0], c[1]))
            chosen = set(order[: total - S * len(sinks)])
            for l in ls:
                for h in range(HKV):
                    kept = sinks | {j for (ll, hh, j) in chosen if (ll, hh) == (l, h)}
                    out[(l, b, h)] = (kept, {j: s[l, b, h, j] for j in range(n0, T)}, sinks)
    return out


@functools.cache
def inputs():
    return make_inputs(2, lengths=(29, 17, 23), window=8, num_layers=3)


@pytest.mark.parametrize(
    "policy,budget,ratio",
    [
        (KVzip(), 8, None),
        (KVzip(layerwise=True), 8, None),
        (get("kvzip_kvpress"), None, 0.5),
        (get("kvzip_kvpress", layerwise=True), None, 0.7),
        (KVzip(n_sink=2), None, 0.6),
    ],
    ids=["global-C8", "layerwise-C8", "kvpress-r0.5", "kvpress-layerwise-r0.7", "paper-r0.6"],
)
def test_kept_sets_equal_reference(policy, budget, ratio):
    inp = inputs()
    s = np.asarray(inp.obs.reconstruction, np.float64)
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=budget, compression_ratio=ratio, max_new_tokens=2)
    keep = np.asarray(jax.jit(lambda p, c, o: policy.prefill_keep(p, c, o)[0])(plan, inp.cache, inp.obs))
    got = kept_positions(keep, inp.cache.pos)
    for idx, (kept, scores, prot) in kvzip_reference(policy, s, inp.lengths, inp.num_layers, budget, ratio).items():
        assert_same_kept(got[idx], kept, scores, prot, where=f"kvzip {idx}")


def test_presets_and_errors():
    k = get("kvzip")
    assert (k.chunk_size, k.n_sink, k.postfix, k.layerwise, k.rule) == (2048, 4, 8, False, "paper")
    assert k.requirements().observe.reconstruction == Reconstruction()
    assert get("kvzip_kvpress").rule == "kvpress"
    with pytest.raises(TypeError, match="first_ids"):
        KVzip(first_ids=[1, 2])
    with pytest.raises(ValueError, match="chunk_size"):
        KVzip(chunk_size=0)
    with pytest.raises(ValueError, match="reconstruction"):
        ObservationSpec(reconstruction=Reconstruction()).merge(ObservationSpec(reconstruction=Reconstruction(n_sink=1)))

    class Tok:
        def encode(self, text, add_special_tokens):
            return [len(w) for w in text.split()]

    t = KVzip.for_tokenizer(Tok(), chunk_size=512)
    assert t.first_ids == (6, 3, 8, 7, 8) and t.chunk_size == 512 and t.next_ids[-2:] == (8, 4)


@pytest.mark.slow
def test_engine_compress_uses_the_reconstruction_scores(stories_path):
    """Through the public engine (padded batch, several chunks): each row keeps exactly
    L*Hkv*T - int(L*Hkv*T*r) entries, the sinks, and the global top scores of the reconstruction pass
    recomputed here from the model alone (up to float noise between the two bucket lengths)."""
    model = kvjax.load_model(stories_path)
    cfg = model.config
    rng = np.random.RandomState(11)
    lengths = (70, 45)
    prompts = [[1] + rng.randint(3, cfg.vocab_size, n - 1).tolist() for n in lengths]
    policy = KVzip(chunk_size=24, first_ids=(5, 6), next_ids=(7,), suffix_ids=(8,), rule="kvpress", query_aware=False)
    cache = kvjax.engine.compress(model, prompts, policy=policy, compression_ratio=0.5)
    valid, pos = np.asarray(cache.valid), np.asarray(cache.pos)
    T = 72
    tokens = np.zeros((2, T), np.int32)
    positions = np.full((2, T), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = np.arange(len(p))
    full = KVCache.init(cfg.num_layers, 2, cfg.num_kv_heads, T, cfg.head_dim, cfg.jnp_dtype)
    _, full, _ = extend(model.params, cfg, full, jnp.asarray(tokens), jnp.asarray(positions), fresh=True)
    s = np.asarray(reconstruction_scores(model.params, cfg, full, jnp.asarray(tokens), jnp.asarray(positions),
                                         policy.reconstruction()), np.float64)
    L = cfg.num_layers
    for b, n in enumerate(lengths):
        numel = L * cfg.num_kv_heads * n
        assert valid[:, b].sum() == numel - int(numel * 0.5)
        kept = np.zeros((L, cfg.num_kv_heads, n), bool)
        for l in range(L):
            for h in range(cfg.num_kv_heads):
                kept[l, h, pos[l, b, h][valid[l, b, h]]] = True
        assert kept[:, :, : policy.n_sink].all()
        sc = s[:, b, :, policy.n_sink : n]
        k = kept[:, :, policy.n_sink :]
        assert sc[k].min() >= sc[~k].max() - 1e-5  # a global threshold over layers and heads
        assert len({kept[l].sum() for l in range(L)}) > 1  # budgets differ across layers


# ---- the blocked scoring (log-sum-exp per query, never the [queries x keys] probabilities) ----------------


def _random_case(seed, B, Hq, Hkv, D, n, S, m, q_scale=3.0):
    """Pass queries [B,Hq,n,D] after prompts of random lengths, context keys [B,Hkv,S,D] (sinks + a chunk
    that the shorter rows end inside), own keys [B,Hkv,m,D] at the pass's positions; right padding."""
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(B, Hq, n, D)) * q_scale).astype(np.float32)
    kc = rng.normal(size=(B, Hkv, S, D)).astype(np.float32)
    ko = rng.normal(size=(B, Hkv, m, D)).astype(np.float32)
    T = S + 50  # prompt length of a full row; context keys sit at positions 0..S-1
    ctx_pos = np.broadcast_to(np.arange(S), (B, Hkv, S)).copy()
    real = rng.integers(1, n + 1, size=B)  # real pass tokens per row
    real[0] = n
    if B > 2:
        real[-1] = 0  # a row that sits this pass out
        ctx_pos[1, :, S // 2:] = -1  # a row whose prompt ends inside the chunk
    qpos = np.full((B, n), -1)
    own_pos = np.full((B, Hkv, m), -1)
    for b in range(B):
        r = min(real[b], m)
        qpos[b, n - r:] = T + np.arange(r)  # right-aligned, as the window queries are
        own_pos[b, :, :r] = T + np.arange(r)
    return [jnp.asarray(x) for x in (q, qpos.astype(np.int32), kc, ctx_pos.astype(np.int32), ko,
                                     own_pos.astype(np.int32))]


@pytest.mark.parametrize("B,Hq,Hkv,n,S,m,block,key_block", [
    (3, 8, 2, 37, 21, 37, 8, 8),  # several query and own-key blocks, ragged ends, a row out, a short row
    (2, 4, 4, 64, 70, 64, 16, 32),  # no GQA, blocks that divide
    (1, 6, 2, 19, 5, 19, None, None),  # default blocks (one of each)
    (3, 8, 1, 130, 40, 130, 32, 16),  # one KV head for all, query and key blocks of different sizes
])
def test_blocked_column_max_equals_materialized_probabilities(B, Hq, Hkv, n, S, m, block, key_block):
    q, qpos, kc, cpos, ko, opos = _random_case(B * 100 + n, B, Hq, Hkv, 16, n, S, m)
    scale = 16 ** -0.5
    got = np.asarray(jax.jit(functools.partial(subsampled_column_max, scale=scale, block=block,
                                               key_block=key_block))(q, qpos, kc, cpos, ko, opos))
    want = np.asarray(subsampled_column_max_reference(q, qpos, kc, cpos, ko, opos, scale=scale), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert (want[:, :, :] > 0.05).any()  # not all near-uniform: some keys take real attention
    assert (got[np.asarray(cpos) < 0] == 0).all()  # keys past a row's prompt score nothing
    if B > 2:
        assert (got[-1] == 0).all()  # a row that sits the pass out scores nothing
    # the same top-k per (row, head)
    k = S // 3
    for b in range(B):
        for h in range(Hkv):
            assert set(np.argsort(-got[b, h], kind="stable")[:k]) == set(np.argsort(-want[b, h], kind="stable")[:k])


@functools.cache
def _tiny_llama(tmp):
    hf = build_hf("llama3", tmp, seed=1)
    return kvjax.load_model(tmp), hf


@pytest.mark.parametrize("spec,lengths", [
    (SPEC, LENGTHS),
    # chunks of 5 after a prefix of 3: ragged last chunks, a postfix longer than a chunk, sinks from the prefix
    (Reconstruction(chunk_size=5, n_sink=4, postfix=8, first_ids=(5,), next_ids=(8, 9, 4), suffix_ids=(10, 11),
                    prefix=3), (13, 21, 9)),
    # one chunk covers the shortest row's whole context
    (Reconstruction(chunk_size=11, n_sink=2, postfix=8, first_ids=(), next_ids=(7,), suffix_ids=()), (30, 10)),
], ids=["chunk8", "chunk5-prefix3", "chunk11-bare"])
def test_blocked_scores_equal_materialized_and_keep_the_same(tmp_path_factory, spec, lengths):
    """On a model's real pass: the blocked scores equal the materialised reference within float
    tolerance, and KVzip keeps the same entries from either (global and layer-wise budgets)."""
    model, _ = _tiny_llama(tmp_path_factory.mktemp("llama3"))
    cfg = model.config
    rng = np.random.RandomState(sum(lengths))
    B, T = len(lengths), max(lengths) + 3
    tokens = np.zeros((B, T), np.int32)
    positions = np.full((B, T), -1, np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.randint(11, cfg.vocab_size, n)
        positions[b, :n] = np.arange(n)
    cache = KVCache.init(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, cfg.jnp_dtype)
    _, cache, _ = extend(model.params, cfg, cache, jnp.asarray(tokens), jnp.asarray(positions), fresh=True)
    run = jax.jit(reconstruction_scores, static_argnums=(1, 5, 6, 7))
    args = (model.params, cfg, cache, jnp.asarray(tokens), jnp.asarray(positions), spec, "original")
    got, want = (np.asarray(run(*args, impl)) for impl in ("blocked", "materialized"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    for b, n in enumerate(lengths):
        scored = np.zeros(T, bool)
        scored[spec.prefix:n] = True
        assert (got[:, b][..., scored] > 0).all() and (got[:, b][..., ~scored] == 0).all()
    for policy, ratio in ((KVzip(n_sink=spec.n_sink, prefix=spec.prefix, rule="kvpress"), 0.5),
                          (KVzip(n_sink=spec.n_sink, prefix=spec.prefix, layerwise=True), 0.3)):
        plan = policy.plan(lengths, cfg.num_layers, cfg.num_kv_heads, compression_ratio=ratio, max_new_tokens=1)
        keep = jax.jit(lambda p, c, s, policy=policy: policy.prefill_keep(
            p, c, Observations(reconstruction=s, lengths=jnp.asarray(lengths, jnp.int32)))[0])
        a, b = (np.asarray(keep(plan, cache, jnp.asarray(s))) for s in (got, want))
        assert (a == b).all()
        assert 0 < a.sum() < np.asarray(cache.valid).sum()
