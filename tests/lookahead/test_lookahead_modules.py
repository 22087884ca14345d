"""LookaheadKV modules and training math against a plain NumPy forward written from policies.md §11."""

import dataclasses

import jax
import jax.numpy as jnp
import lkv_reference as ref
import numpy as np
import pytest
from conftest import prompts, with_random_b

import kvjax.lookahead as lk
from kvjax.cache import KVCache
from kvjax.models import extend
from kvjax.observations import ObservationSpec

LENGTHS = (9, 5, 7)  # rows of different lengths, right-padded to WIDTH
WIDTH = 12


def _batch(model, seed=0):
    rows, toks, pos = prompts(model.config.vocab_size, LENGTHS, WIDTH, seed)
    return rows, jnp.asarray(toks), jnp.asarray(pos)


def test_predicted_attention_matches_numpy_forward_with_lora(tiny, adapter):
    rows, toks, pos = _batch(tiny)
    cache = lk.prompt_cache(tiny.params, tiny.config, toks, pos)
    got = np.asarray(lk.predicted_attention(tiny.params, tiny.config, adapter.params, adapter.config, cache,
                                            jnp.asarray(LENGTHS)))
    assert got.shape == (tiny.config.num_layers, len(LENGTHS), tiny.config.num_heads, WIDTH)
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(adapter.params)
    for b, t in enumerate(LENGTHS):
        want = ref.predicted(P, tiny.config, rows[b], A, adapter.config)
        np.testing.assert_allclose(got[:, b, :, :t], want, atol=2e-6, rtol=1e-4)
        np.testing.assert_array_equal(got[:, b, :, t:], 0.0)  # padding slots
        # the lookahead keys take part of the mass: the prompt share is below 1
        assert (want.sum(-1) < 1 - 1e-3).all()


@pytest.mark.parametrize("span", [4, 11])
def test_spread_lookahead_positions_match_numpy_forward(tiny, adapter, span):
    """span S: token i of n at T + floor(i * S / n); S = n is the contiguous default exactly, and a wider
    span moves the tokens (RoPE distances), which changes what they attend to."""
    rows, toks, pos = _batch(tiny)
    cache = lk.prompt_cache(tiny.params, tiny.config, toks, pos)
    conf = dataclasses.replace(adapter.config, span=span)
    assert conf.offsets == tuple(i * span // conf.n_tokens for i in range(conf.n_tokens))
    got = np.asarray(lk.predicted_attention(tiny.params, tiny.config, adapter.params, conf, cache,
                                            jnp.asarray(LENGTHS)))
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(adapter.params)
    for b, t in enumerate(LENGTHS):
        np.testing.assert_allclose(got[:, b, :, :t], ref.predicted(P, tiny.config, rows[b], A, conf),
                                   atol=2e-6, rtol=1e-4)
    base = np.asarray(lk.predicted_attention(tiny.params, tiny.config, adapter.params, adapter.config, cache,
                                             jnp.asarray(LENGTHS)))
    if span == conf.n_tokens:
        np.testing.assert_array_equal(got, base)
    else:
        assert np.abs(got - base).max() > 1e-4


def test_response_attention_matches_full_attention(tiny):
    rows, toks, pos = _batch(tiny, seed=1)
    rng = np.random.RandomState(2)
    y_len = (6, 3, 0)  # the last row has no response: zeros
    Y = 7
    r_toks = np.zeros((3, Y), np.int32)
    r_pos = -np.ones((3, Y), np.int32)
    resp = []
    for b, (t, y) in enumerate(zip(LENGTHS, y_len)):
        r = list(rng.randint(3, tiny.config.vocab_size, y))
        resp.append(r)
        r_toks[b, :y] = r
        r_pos[b, :y] = t + np.arange(y)
    cache = lk.prompt_cache(tiny.params, tiny.config, toks, pos)
    got = np.asarray(lk.response_attention(tiny.params, tiny.config, cache, jnp.asarray(r_toks),
                                           jnp.asarray(r_pos), chunk=3))
    whole = np.asarray(lk.response_attention(tiny.params, tiny.config, cache, jnp.asarray(r_toks),
                                             jnp.asarray(r_pos), chunk=64))
    np.testing.assert_allclose(got, whole, atol=1e-6)  # chunking changes nothing
    P = ref.to_numpy(tiny.params)
    for b, t in enumerate(LENGTHS):
        if y_len[b] == 0:
            np.testing.assert_array_equal(got[:, b], 0.0)
            continue
        want = ref.response(P, tiny.config, rows[b], resp[b])
        np.testing.assert_allclose(got[:, b, :, :t], want, atol=2e-6, rtol=1e-4)
        np.testing.assert_array_equal(got[:, b, :, t:], 0.0)


def _target(model, seed=5):
    rng = np.random.RandomState(seed)
    L, Hq = model.config.num_layers, model.config.num_heads
    t = rng.exponential(size=(L, len(LENGTHS), Hq, WIDTH)).astype(np.float32)
    t[..., :2] = np.where(rng.rand(L, len(LENGTHS), Hq, 2) < 0.5, 0.0, t[..., :2])  # some exact zeros
    return t


def test_kl_loss_and_loss_fn_match_numpy(tiny, adapter):
    rows, toks, pos = _batch(tiny)
    target = _target(tiny)
    batch = {"tokens": toks, "positions": pos, "target": jnp.asarray(target)}
    loss = float(lk.loss_fn(adapter.params, tiny.params, tiny.config, adapter.config, batch))
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(adapter.params)
    per_row = []
    for b, t in enumerate(LENGTHS):
        pred = ref.predicted(P, tiny.config, rows[b], A, adapter.config)
        per_row.append(ref.kl(target[:, b, :, :t].astype(np.float64), pred).mean())
    np.testing.assert_allclose(loss, np.mean(per_row), rtol=1e-4)
    remat = float(lk.loss_fn(adapter.params, tiny.params, tiny.config, adapter.config, batch, remat=True))
    np.testing.assert_allclose(remat, loss, rtol=1e-6)
    # kl_loss alone: zero for identical distributions (up to scale), positive otherwise
    mask = jnp.asarray(pos >= 0)
    assert abs(float(lk.kl_loss(jnp.asarray(target), 3.0 * jnp.asarray(target), mask))) < 1e-6
    # padding slots of either input never count
    noisy = np.where((pos >= 0)[None, :, None, :], target, 1e3)
    np.testing.assert_allclose(float(lk.kl_loss(jnp.asarray(noisy), jnp.asarray(target), mask)), 0.0, atol=1e-6)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_topk_loss_and_loss_fn_match_numpy(tiny, adapter, fraction):
    """The ranking objective: -log of the predicted mass on the target's top ceil(fraction * T) prompt slots."""
    rows, toks, pos = _batch(tiny)
    target = _target(tiny)
    target[0, 1, 2, :4] = 2.0  # a tie at the top
    batch = {"tokens": toks, "positions": pos, "target": jnp.asarray(target)}
    fn = lk.objective("topk", fraction)
    loss = float(lk.loss_fn(adapter.params, tiny.params, tiny.config, adapter.config, batch, objective=fn))
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(adapter.params)
    per_row = []
    for b, t in enumerate(LENGTHS):
        pred = ref.predicted(P, tiny.config, rows[b], A, adapter.config)
        per_row.append(ref.topk(target[:, b, :, :t].astype(np.float64), pred, fraction).mean())
    np.testing.assert_allclose(loss, np.mean(per_row), rtol=1e-4, atol=1e-6)
    if fraction == 1.0:
        assert abs(loss) < 1e-6  # every slot is in the top set: all the mass is on it
    else:
        assert loss > 0.05
    mask = jnp.asarray(pos >= 0)
    # a prediction that puts its mass on the target's top slots only costs nothing; padding never counts
    onehot = np.where(target >= np.sort(np.where((pos >= 0)[None, :, None, :], target, -np.inf), -1)[..., -1:],
                      1.0, 0.0)
    np.testing.assert_allclose(float(lk.topk_loss(jnp.asarray(target), jnp.asarray(onehot), mask, 0.01)), 0.0,
                               atol=1e-6)
    g = jax.grad(lambda p: lk.topk_loss(jnp.asarray(target), p, mask, fraction))(jnp.asarray(target))
    assert np.isfinite(np.asarray(g)).all()
    with pytest.raises(ValueError, match=r"loss must be one of \('kl', 'topk'\)"):
        lk.objective("rank")
    with pytest.raises(ValueError, match=r"topk_fraction must be in \(0, 1\]"):
        lk.objective("topk", 0.0)


def test_kl_loss_clamps_and_stays_finite():
    t = jnp.asarray([[[[0.5, 0.5, 0.0]]]])
    p = jnp.asarray([[[[1.0, 0.0, 0.0]]]])
    mask = jnp.asarray([[True, True, True]])
    got = float(lk.kl_loss(t, p, mask))
    np.testing.assert_allclose(got, 0.5 * np.log(0.5 / 1.0) + 0.5 * (np.log(0.5) - np.log(1e-10)), rtol=1e-5)
    g = jax.grad(lambda p: lk.kl_loss(t, p, mask))(p)
    assert np.isfinite(np.asarray(g)).all()


def test_gradients_only_for_the_adapter_and_they_are_right(tiny, adapter):
    _, toks, pos = _batch(tiny)
    batch = {"tokens": toks, "positions": pos, "target": jnp.asarray(_target(tiny))}
    f = jax.jit(lambda a: lk.loss_fn(a, tiny.params, tiny.config, adapter.config, batch))
    g = jax.grad(f)(adapter.params)
    assert float(jnp.abs(g["embeddings"]).max()) > 0
    for p in adapter.config.projections:
        assert float(jnp.abs(g["lora"][p]["a"]).max()) > 0, p
        assert float(jnp.abs(g["lora"][p]["b"]).max()) > 0, p

    # directional derivatives (embeddings, LoRA B of q) equal central differences, at a milder B
    mild = with_random_b(lk.init_adapter(tiny, adapter.config, jax.random.PRNGKey(1)), scale=0.02).params
    g = jax.grad(f)(mild)
    d = jax.random.normal(jax.random.PRNGKey(7), mild["embeddings"].shape)
    db = jax.random.normal(jax.random.PRNGKey(8), mild["lora"]["q"]["b"].shape)
    eps = 3e-3

    def shift(s, which):
        if which == "embeddings":
            return {**mild, "embeddings": mild["embeddings"] + s * d}
        q = {"a": mild["lora"]["q"]["a"], "b": mild["lora"]["q"]["b"] + s * db}
        return {**mild, "lora": {**mild["lora"], "q": q}}

    for which, dg in (("embeddings", jnp.sum(g["embeddings"] * d)), ("b", jnp.sum(g["lora"]["q"]["b"] * db))):
        fd = (float(f(shift(eps, which))) - float(f(shift(-eps, which)))) / (2 * eps)
        np.testing.assert_allclose(float(dg), fd, rtol=2e-2, atol=1e-4, err_msg=which)
    # with B = 0 (the init), dL/dA is exactly zero and dL/dB is not
    fresh = lk.init_adapter(tiny, adapter.config, jax.random.PRNGKey(1))
    g0 = jax.grad(f)(fresh.params)
    assert float(jnp.abs(g0["lora"]["q"]["a"]).max()) == 0.0
    assert float(jnp.abs(g0["lora"]["q"]["b"]).max()) > 0


def test_model_params_get_no_gradient(tiny, adapter):
    """The model params are constants of the loss (stop_gradient): no gradient flows to them."""
    _, toks, pos = _batch(tiny)
    batch = {"tokens": toks, "positions": pos, "target": jnp.asarray(_target(tiny))}
    gm = jax.jit(jax.grad(lambda mp: lk.loss_fn(adapter.params, mp, tiny.config, adapter.config, batch)))(tiny.params)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(gm))


def test_prompt_rows_bit_identical_with_adapter(tiny, adapter):
    """[X; P] in one pass: with the LoRA on the P rows, the prompt rows' logits and KV are exactly the
    frozen model's; and a hook whose mask is all False changes nothing at all."""
    cfg = tiny.config
    rows, toks, pos = _batch(tiny)
    n = adapter.config.n_tokens
    B = len(LENGTHS)
    S = WIDTH + n
    embeds = np.zeros((B, S, cfg.hidden_size), np.float32)
    positions = -np.ones((B, S), np.int32)
    mask = np.zeros((B, S), bool)
    table = np.asarray(tiny.params["embed"])
    for b, t in enumerate(LENGTHS):
        embeds[b, :t] = table[rows[b]]
        embeds[b, t:t + n] = np.asarray(adapter.params["embeddings"])
        positions[b, :t + n] = np.arange(t + n)
        mask[b, t:t + n] = True
    hook = lk.adapter_hook(adapter.params, adapter.config, jnp.asarray(mask))
    empty = lambda: KVCache.init(cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim, jnp.float32)
    run = lambda h: extend(tiny.params, cfg, empty(), None, jnp.asarray(positions), fresh=True,
                           inputs_embeds=jnp.asarray(embeds), adapter=h)
    (lo_a, c_a, _), (lo_f, c_f, _) = run(hook), run(None)
    prompt = ~mask & (positions >= 0)
    lo_a, lo_f = np.asarray(lo_a), np.asarray(lo_f)
    assert np.array_equal(lo_a[prompt], lo_f[prompt])
    slot_prompt = np.broadcast_to(prompt[None, :, None, :], c_a.valid.shape)
    assert np.array_equal(np.asarray(c_a.k)[slot_prompt], np.asarray(c_f.k)[slot_prompt])
    assert np.array_equal(np.asarray(c_a.v)[slot_prompt], np.asarray(c_f.v)[slot_prompt])
    assert not np.allclose(lo_a[mask], lo_f[mask])  # the LoRA does act on the lookahead rows
    # the frozen prompt prefill alone, with the hook present but masked off everywhere
    off = lk.adapter_hook(adapter.params, adapter.config, jnp.zeros(toks.shape, bool))
    cache0 = KVCache.init(cfg.num_layers, B, cfg.num_kv_heads, WIDTH, cfg.head_dim, jnp.float32)
    a = extend(tiny.params, cfg, cache0, toks, pos, fresh=True, adapter=off)
    f = extend(tiny.params, cfg, cache0, toks, pos, fresh=True)
    for x, y in zip(jax.tree.leaves(a[:2]), jax.tree.leaves(f[:2])):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_zero_lora_b_gives_the_frozen_models_lookahead_queries(tiny):
    cfg = tiny.config
    fresh = lk.init_adapter(tiny, lk.LookaheadConfig(n_tokens=4, rank=2), jax.random.PRNGKey(4))
    _, toks, pos = _batch(tiny)
    cache = lk.prompt_cache(tiny.params, cfg, toks, pos)
    lengths = jnp.asarray(LENGTHS)
    n, B = 4, len(LENGTHS)
    la_pos = (lengths[:, None] + jnp.arange(n)).astype(jnp.int32)
    embeds = jnp.broadcast_to(fresh.params["embeddings"][None], (B, n, cfg.hidden_size))
    spec = ObservationSpec(window=n, query_mass=True)
    hook = lk.adapter_hook(fresh.params, fresh.config, jnp.ones((B, n), bool))
    _, _, with_hook = extend(tiny.params, cfg, cache, None, la_pos, fresh=False, commit=False, observe=spec,
                             inputs_embeds=embeds, adapter=hook)
    _, _, frozen = extend(tiny.params, cfg, cache, None, la_pos, fresh=False, commit=False, observe=spec,
                          inputs_embeds=embeds)
    assert np.array_equal(np.asarray(with_hook.window_queries), np.asarray(frozen.window_queries))
    assert np.array_equal(np.asarray(with_hook.query_mass), np.asarray(frozen.query_mass))
    # and with a random B they differ
    other = with_random_b(fresh)
    hook = lk.adapter_hook(other.params, other.config, jnp.ones((B, n), bool))
    _, _, changed = extend(tiny.params, cfg, cache, None, la_pos, fresh=False, commit=False, observe=spec,
                           inputs_embeds=embeds, adapter=hook)
    assert not np.allclose(np.asarray(changed.window_queries), np.asarray(frozen.window_queries))


def test_lookahead_pass_does_not_touch_the_cache(tiny, adapter):
    _, toks, pos = _batch(tiny)
    cache = lk.prompt_cache(tiny.params, tiny.config, toks, pos)
    B, n = len(LENGTHS), adapter.config.n_tokens
    la_pos = (jnp.asarray(LENGTHS)[:, None] + jnp.arange(n)).astype(jnp.int32)
    embeds = jnp.broadcast_to(adapter.params["embeddings"][None], (B, n, tiny.config.hidden_size))
    _, out, _ = extend(tiny.params, tiny.config, cache, None, la_pos, fresh=False, commit=False,
                       inputs_embeds=embeds, adapter=lk.adapter_hook(adapter.params, adapter.config,
                                                                      jnp.ones((B, n), bool)))
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(cache)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_positions_must_fit(tiny, adapter):
    _, toks, pos = _batch(tiny)
    small = dataclasses.replace(tiny.config, max_position_embeddings=WIDTH + adapter.config.n_tokens - 1)
    cache = lk.prompt_cache(tiny.params, tiny.config, toks, pos)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        lk.loss_fn(adapter.params, tiny.params, small, adapter.config,
                   {"tokens": toks, "positions": pos, "target": jnp.zeros((2, 3, 8, WIDTH))})
    with pytest.raises(ValueError, match="n_tokens=4 lookahead tokens"):
        lk.predicted_attention(tiny.params, small, adapter.params, adapter.config, cache,
                               jnp.asarray([WIDTH, 3, 3]))
    # spread over a span, the last token sits at T + floor((n-1) * S / n)
    spread = dataclasses.replace(adapter.config, span=8)  # offsets 0, 2, 4, 6: T + 7 positions
    fits = dataclasses.replace(tiny.config, max_position_embeddings=WIDTH + 7)
    lk.check_positions(fits, WIDTH, spread)
    with pytest.raises(ValueError, match="spread over span=8 needs 19 positions"):
        lk.check_positions(dataclasses.replace(fits, max_position_embeddings=WIDTH + 6), WIDTH, spread)
