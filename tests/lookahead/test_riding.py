"""LookaheadKV's tokens riding the prefill (`extend(..., riding=...)`, `steps.prefill(riding=...)`): in each layer
right after the prompt's rows, the same values as the pass after the prefill, and against the NumPy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import lkv_reference as ref
import numpy as np
import pytest
from conftest import prompts, with_random_b
from tiny_models import build_hf

import kvjax
import kvjax.lookahead as lk
from kvjax.engine import Setting, steps
from kvjax.models.forward import RidingRows, extend
from kvjax.models.local import init_cache
from kvjax.passes.lookahead import LookaheadTokens
from kvjax.policies import Cake, LookaheadKV
from kvjax.sampling import Sampler

LENGTHS = (21, 13, 17)
WIDTH = 32


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lkv_gemma3")
    build_hf("gemma3", folder)
    return kvjax.load_model(folder)


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
@pytest.mark.parametrize("moments", [False, True])
def test_riding_rows_give_the_pass_after_the_prefill(tiny, gemma, family, moments):
    """The prefill's logits and cache are those of the prefill without riding rows, and the rows record what
    the same rows record against the finished cache (the pass after the prefill), on a Llama and on a model
    with sliding-window layers."""
    model = tiny if family == "llama3" else gemma
    ad = with_random_b(lk.init_adapter(model, lk.LookaheadConfig(n_tokens=4, rank=2), jax.random.PRNGKey(1)))
    _, toks, pos = prompts(model.config.vocab_size, LENGTHS, WIDTH, seed=1)
    toks, pos = jnp.asarray(toks), jnp.asarray(pos)
    lengths = jnp.sum(pos >= 0, -1)
    rows = lk.lookahead_rows(model.config, ad.params, ad.config, lengths, moments=moments)

    def run(params, adapter_params, ride):
        r = lk.lookahead_rows(model.config, adapter_params, ad.config, lengths, moments=moments) if ride else None
        return extend(params, model.config, init_cache(model.config, 3, WIDTH), toks, pos, fresh=True,
                      logit_index=(lengths - 1)[:, None], riding=r)

    logits, cache, obs = jax.jit(run, static_argnums=2)(model.params, ad.params, True)
    logits0, cache0, obs0 = jax.jit(run, static_argnums=2)(model.params, ad.params, False)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert obs0.query_mass is None
    after = lk.lookahead_observations(model.params, model.config, ad.params, ad.config, cache0, lengths,
                                      moments=moments)
    assert set(after) == set(lk.lookahead_fields(moments)) == {f for o in rows.observe for f in o.fields}
    for f, want in after.items():
        got = getattr(obs, f)
        assert got.shape == want.shape == (model.config.num_global_layers, 3, model.config.num_heads, WIDTH)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    mass = np.asarray(obs.query_mass)
    for b, t in enumerate(LENGTHS):  # nothing on padding; the n tokens' mass on the prompt is below n
        assert (mass[:, b, :, t:] == 0).all()
        assert (mass[:, b].sum(-1) < ad.config.n_tokens).all() and (mass[:, b].sum(-1) > 0).all()


def test_riding_prefill_scores_match_numpy_reference(tiny, adapter):
    """The engine's prefill with the tokens riding it, then the policy's scores: the NumPy reference's (§11.3)."""
    ad = adapter.replace(config=dataclasses.replace(adapter.config, kernel=5, tail=3, tail_weight=0.5))
    policy = LookaheadKV(adapter=ad)
    rows, toks, pos = prompts(tiny.config.vocab_size, LENGTHS, WIDTH, seed=11)
    riding = steps.riding_pass([policy], "original")
    assert riding is not None and riding[0] == policy.requirements().observe.producers[0]
    _, cache, obs, _ = steps.prefill(tiny.params, jnp.asarray(toks), jnp.asarray(pos), jax.random.PRNGKey(0),
                                     cfg=tiny.config, capacity=WIDTH, observe=steps.prefill_spec([policy]),
                                     rope_mode="original", sampler=Sampler(), mesh=None, riding=riding[0],
                                     riding_inputs=riding[1])
    plan = policy.plan(LENGTHS, tiny.config.num_layers, tiny.config.num_kv_heads, budget=8)
    got = np.asarray(policy.score(plan, cache, obs).scores)
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(ad.params)
    for b, t in enumerate(LENGTHS):
        want = ref.scores(ref.predicted(P, tiny.config, rows[b], A, ad.config), tiny.config, ad.config, t)
        region = t - ad.config.protected
        np.testing.assert_allclose(got[:, b, :, :region], want[:, :, :region], atol=2e-6, rtol=1e-4)


def _ids(model, lengths, seed):
    rng = np.random.RandomState(seed)
    return [[1] + rng.randint(3, model.config.vocab_size, n - 1).tolist() for n in lengths]


def _count_passes(monkeypatch):
    calls = []
    produce = steps.produce

    def counted(*args, observation, **kwargs):
        calls.append(observation.keyword)
        return produce(*args, observation=observation, **kwargs)

    monkeypatch.setattr(steps, "produce", counted)
    return calls


def test_engine_rides_one_adapter_and_runs_the_rest_after(tiny, adapter, monkeypatch):
    """generate rides one adapter's tokens on the prefill (no pass after it) and answers exactly as with the
    pass after the prefill; an ensemble, or two policies with different adapters, run their passes after."""
    ids = _ids(tiny, (40, 25, 33), 3)
    cake = LookaheadKV(adapter=adapter, allocator=Cake(preference="scorer"))  # the moments ride too
    settings = [Setting(LookaheadKV(adapter=adapter), budget=10), Setting(cake, budget=12)]
    run = lambda s: kvjax.engine.generate_settings(tiny, ids, s, max_new_tokens=5, stop_tokens=[])  # noqa: E731
    calls = _count_passes(monkeypatch)
    compress = lambda s: kvjax.engine.compress(tiny, ids, policy=s.policy, budget=s.budget)  # noqa: E731
    for one in settings:
        (rode,), rode_cache = run([one]), compress(one)
        assert calls == []
        with monkeypatch.context() as m:
            m.setattr(LookaheadTokens, "rides_prefill", lambda self: False)
            (after,), after_cache = run([one]), compress(one)
        assert calls and set(calls) == {"lookahead"}
        calls.clear()
        np.testing.assert_array_equal(rode.tokens, after.tokens)
        np.testing.assert_array_equal(rode.kept, after.kept)
        np.testing.assert_array_equal(np.asarray(rode_cache.pos), np.asarray(after_cache.pos))
        np.testing.assert_allclose(np.asarray(rode_cache.k), np.asarray(after_cache.k), rtol=1e-6, atol=1e-6)
    other = with_random_b(lk.init_adapter(tiny, adapter.config, jax.random.PRNGKey(7)), seed=8)
    run([Setting(LookaheadKV(adapter=adapter), budget=10), Setting(LookaheadKV(adapter=other), budget=10)])
    assert len(calls) >= 2 and set(calls) == {"lookahead"}
    calls.clear()
    run([Setting(LookaheadKV(adapter=lk.stack([adapter, other])), budget=10)])
    assert calls and set(calls) == {"lookahead"}


def test_riding_errors(tiny, adapter):
    lengths = jnp.asarray(LENGTHS)
    rows = lk.lookahead_rows(tiny.config, adapter.params, adapter.config, lengths)
    _, toks, pos = prompts(tiny.config.vocab_size, LENGTHS, WIDTH)
    cache = init_cache(tiny.config, 3, WIDTH)
    with pytest.raises(ValueError, match="riding rows need a prefill"):
        extend(tiny.params, tiny.config, cache, jnp.asarray(toks), jnp.asarray(pos), fresh=True,
               rope_mode="cache_relative", riding=rows)
    with pytest.raises(ValueError, match=r"riding rows' observations \['query_mass'\] are also the prefill's"):
        extend(tiny.params, tiny.config, cache, jnp.asarray(toks), jnp.asarray(pos), fresh=True,
               observe=rows.observe, riding=rows)
    assert isinstance(rows, RidingRows) and rows.positions.shape == (3, adapter.config.n_tokens)
    np.testing.assert_array_equal(np.asarray(rows.positions)[:, 0], np.asarray(lengths) + adapter.config.offsets[0])
