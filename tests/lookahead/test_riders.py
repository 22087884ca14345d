"""LookaheadKV's tokens riding along the prompt's prefill (`kvjax.models.forward.Riders`) instead of a second
pass over the model: the same fields as the pass, against the NumPy reference (§11.3), with the prompt's own
prefill left bit-identical; and the engine's choice of when they ride."""

import dataclasses

import jax
import jax.numpy as jnp
import lkv_reference as ref
import numpy as np
import pytest
from conftest import prompts, with_random_b

import kvjax
import kvjax.lookahead as lk
from kvjax.engine import TRACE_COUNTS, Setting, steps
from kvjax.models.forward import Riders, extend
from kvjax.models.local import init_cache
from kvjax.observations import ObservationSpec
from kvjax.policies import CakeLookaheadKV, LookaheadKV
from kvjax.sampling import Sampler

LENGTHS = (21, 13, 17)
WIDTH = 32


def _prefill(model, policy, toks, pos, ride):
    spec = steps.prefill_spec([policy])
    o, inputs = steps.rider([policy], model.config) if ride else (None, None)
    return steps.prefill(model.params, toks, pos, jax.random.PRNGKey(0), cfg=model.config, capacity=WIDTH + 4,
                         observe=spec, rope_mode="original", sampler=Sampler(), mesh=None, ride=o, ride_inputs=inputs)


@pytest.mark.parametrize("changes", [{}, {"span": 9}])
def test_riding_tokens_match_the_reference_and_leave_the_prompt_bit_identical(tiny, adapter, changes):
    ad = adapter.replace(config=dataclasses.replace(adapter.config, **changes))
    policy = LookaheadKV(adapter=ad)
    rows, toks, pos = prompts(tiny.config.vocab_size, LENGTHS, WIDTH, seed=5)
    first0, cache0, _, logits0 = _prefill(tiny, policy, jnp.asarray(toks), jnp.asarray(pos), ride=False)
    first1, cache1, obs, logits1 = _prefill(tiny, policy, jnp.asarray(toks), jnp.asarray(pos), ride=True)
    np.testing.assert_array_equal(logits1, logits0)  # the prompt never sees its riders
    for a, b in zip(jax.tree.leaves(cache1), jax.tree.leaves(cache0)):
        np.testing.assert_array_equal(a, b)  # nothing of theirs is stored
    mass = np.asarray(obs.query_mass)  # [L,B,Hq,C]: the pass's field, padded to the capacity
    assert mass.shape == (tiny.config.num_layers, 3, tiny.config.num_heads, WIDTH + 4)
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(ad.params)
    for b, t in enumerate(LENGTHS):
        want = ref.predicted(P, tiny.config, rows[b], A, ad.config)  # [L,Hq,t]: mean over the n tokens
        np.testing.assert_allclose(mass[:, b, :, :t] / ad.config.n_tokens, want, atol=2e-6, rtol=1e-4)
        assert (mass[:, b, :, t:] == 0).all()


def test_riders_record_the_moments_the_pass_records(tiny, adapter):
    """CAKE's layer preference from the tokens (query_sumsq, query_entropy) rides along too."""
    policy = CakeLookaheadKV(adapter=adapter)
    _, toks, pos = prompts(tiny.config.vocab_size, LENGTHS, WIDTH, seed=6)
    toks, pos = jnp.asarray(toks), jnp.asarray(pos)
    _, cache, obs, _ = _prefill(tiny, policy, toks, pos, ride=True)
    (o,) = policy.requirements().observe.producers
    assert o.moments and o.rides(tiny.config)
    passed = steps.produce(tiny.params, cache, toks, pos, policy.observation_inputs(), cfg=tiny.config,
                           observation=o, rope_mode="original")
    assert set(passed) == {"query_mass", "query_sumsq", "query_entropy"}
    for f, want in passed.items():
        np.testing.assert_allclose(getattr(obs, f), want, atol=1e-6, rtol=1e-5)


def test_the_engine_rides_one_pass_and_runs_two_after_the_prefill(tiny, adapter):
    ids = [[1] + np.random.RandomState(s).randint(3, tiny.config.vocab_size, n - 1).tolist()
           for s, n in enumerate((40, 29, 35))]
    one = LookaheadKV(adapter=adapter)
    other = LookaheadKV(adapter=with_random_b(lk.init_adapter(tiny, adapter.config, jax.random.PRNGKey(9)), seed=4))
    before = TRACE_COUNTS["produce:lookahead"]
    alone = [kvjax.generate(tiny, ids, policy=p, budget=12, max_new_tokens=4, stop_tokens=[]) for p in (one, other)]
    assert TRACE_COUNTS["produce:lookahead"] == before  # each rode along its prefill: no pass was traced
    both = kvjax.engine.generate_settings(tiny, ids, [Setting(one, budget=12), Setting(other, budget=12)],
                                          max_new_tokens=4, stop_tokens=[])
    assert TRACE_COUNTS["produce:lookahead"] > before  # two adapters' tokens would see each other: two passes
    for got, want in zip(both, alone):
        np.testing.assert_array_equal(got.tokens, want.tokens)
    assert steps.rider([one, None], tiny.config) is not None
    assert steps.rider([one, other], tiny.config) is None
    assert steps.rider([one], tiny.config, "cache_relative") is None
    ensemble = LookaheadKV(adapter=lk.stack([adapter, adapter]))
    assert steps.rider([ensemble], tiny.config) is None  # an ensemble's members must not see each other


def test_riders_errors(tiny, adapter):
    cfg = tiny.config
    toks = jnp.ones((1, 8), jnp.int32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    riders = lk.lookahead_riders(adapter.params, adapter.config, jnp.array([8], jnp.int32))
    assert isinstance(riders, Riders)
    cache = init_cache(cfg, 1, 8)
    with pytest.raises(ValueError, match="riders= ride along a prefill"):
        extend(tiny.params, cfg, cache, toks, pos, fresh=False, riders=riders)
    with pytest.raises(ValueError, match="riders= ride along a prefill"):
        extend(tiny.params, cfg, cache, toks, pos, fresh=True, rope_mode="cache_relative", riders=riders)
    with pytest.raises(ValueError, match=r"both record \['query_mass'\]"):
        extend(tiny.params, cfg, cache, toks, pos, fresh=True, observe=ObservationSpec(query_mass=True), riders=riders)
    gemma = dataclasses.replace(cfg, family="gemma2", sliding_window=4, layer_types=("sliding_attention",) +
                                ("full_attention",) * (cfg.num_layers - 1))
    assert gemma.local_layer_ids
    with pytest.raises(NotImplementedError, match="sliding-window layers"):
        extend(tiny.params, gemma, init_cache(gemma, 1, 8), toks, pos, fresh=True, riders=riders)
