"""Policies end to end through `kvjax.generate`: every preset, every model family, cache bytes."""

import jax
import numpy as np
import pytest

import kvjax
from kvjax import lookahead, policies
from kvjax.cache import KVCache
from kvjax.engine import STEP_BUCKETS, TRACE_COUNTS, bucket_length
from kvjax.policies.registry import lookahead_presets
from tiny_models import FAMILIES, build_hf

RNG = np.random.RandomState(7)
MAX_NEW = 8
# LazyEviction's default window (175) exceeds these short prompts; the engine tests use a small one
OVERRIDES = {"lazy_eviction": dict(window=8)}


_TESTS_PER_CLEAR = 16
_tests_run = [0]


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Each test compiles programs for a new (model, policy); drop them every `_TESTS_PER_CLEAR` tests
    so that a long run (the slow cross product) does not accumulate hundreds of executables in one
    process, while neighbouring presets still share the programs that do not depend on the policy
    (the decode loop of a prefill-time policy, the full cache's)."""
    yield
    _tests_run[0] += 1
    if _tests_run[0] % _TESTS_PER_CLEAR == 0:
        jax.clear_caches()


def _policy(name, model=None):
    if name in lookahead_presets():  # the bundled adapter is the bundled model's: a fresh one, its LoRA B random
        a = lookahead.init_adapter(model, lookahead.LookaheadConfig(n_tokens=8), jax.random.PRNGKey(0))
        lora = {p: {"a": f["a"], "b": 0.1 * jax.random.normal(jax.random.PRNGKey(i), f["b"].shape)}
                for i, (p, f) in enumerate(a.params["lora"].items())}
        return policies.get(name, adapter=a.replace(params={**a.params, "lora": lora}))
    return policies.get(name, **OVERRIDES.get(name, {}))


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


def _prompts(vocab, lengths=(90, 120, 71)):
    return [[1] + RNG.randint(3, vocab, n - 1).tolist() for n in lengths]


def _fixed_prompts(vocab):
    """The same three prompts for every preset on a model, so the full cache's answer is computed once."""
    rng = np.random.RandomState(11)
    return [[1] + rng.randint(3, vocab, n - 1).tolist() for n in (90, 120, 71)]


_FULL: dict = {}  # (model id, prompts) -> the full cache's GenerateOutput


def _full_cache(model, prompts):
    key = (id(model), tuple(map(tuple, prompts)))
    if key not in _FULL:
        _FULL[key] = (model, kvjax.generate(model, prompts, max_new_tokens=MAX_NEW, stop_tokens=[]))
    return _FULL[key][1]


def _check_generation(model, name, prompts):
    """Runs a preset at ratio 0.5 and with a budget above everything, which must change nothing."""
    full = _full_cache(model, prompts)
    out = kvjax.generate(model, prompts, policy=_policy(name, model), compression_ratio=0.5,
                         max_new_tokens=MAX_NEW, stop_tokens=[])
    assert out.tokens.shape == full.tokens.shape
    assert ((out.tokens >= 0) & (out.tokens < model.config.vocab_size)).all()
    # something was evicted: at prefill, or during decoding for decode-time policies
    assert (out.kept < out.prompt_lengths).all() or (out.kept_final < out.prompt_lengths + MAX_NEW).all()
    huge = max(map(len, prompts)) + MAX_NEW + 16
    same = kvjax.generate(model, prompts, policy=_policy(name, model), budget=huge, max_new_tokens=MAX_NEW,
                          stop_tokens=[])
    np.testing.assert_array_equal(same.tokens, full.tokens)
    np.testing.assert_allclose(same.kept, same.prompt_lengths)


@pytest.mark.parametrize("name", policies.available())
def test_every_policy_on_the_fixture(stories, name):
    _check_generation(stories, name, _fixed_prompts(512))


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family.replace(".", "_"))
        build_hf(family, folder)
        out[family] = kvjax.load_model(folder)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", ["snapkv", "h2o", "ada_snapkv"])
def test_representative_policies_on_every_family(family_models, family, name):
    model = family_models[family]
    _check_generation(model, name, _fixed_prompts(model.config.vocab_size))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", policies.available())
def test_every_policy_on_every_family(family_models, family, name):
    model = family_models[family]
    _check_generation(model, name, _fixed_prompts(model.config.vocab_size))


@pytest.mark.parametrize("name", ["snapkv", "knorm_kvpress", "streaming_llm_kvpress", "h2o_prefill"])
def test_uniform_budget_compacts_cache_to_the_budget(stories, name):
    prompts = _prompts(512, (200, 150, 230))
    cfg = stories.config
    budget = 64
    out = kvjax.generate(stories, prompts, policy=name, budget=budget, max_new_tokens=MAX_NEW, stop_tokens=[])
    np.testing.assert_allclose(out.kept, budget)
    room = bucket_length(MAX_NEW, STEP_BUCKETS)  # decode room: max_new_tokens rounded to its step bucket
    want = KVCache.init(cfg.num_layers, 3, cfg.num_kv_heads, budget + room, cfg.head_dim, cfg.jnp_dtype).nbytes()
    assert out.cache_bytes == want
    full = kvjax.generate(stories, prompts, max_new_tokens=MAX_NEW, stop_tokens=[])
    assert out.cache_bytes < full.cache_bytes / 3


def test_decode_time_policy_keeps_a_fixed_capacity_over_a_long_generation(stories):
    budget = 40
    out = kvjax.generate(stories, _prompts(512, (60, 45)), policy="h2o", budget=budget, max_new_tokens=300,
                         stop_tokens=[])
    cfg = stories.config
    assert out.cache_bytes == KVCache.init(cfg.num_layers, 2, cfg.num_kv_heads, budget + 1, cfg.head_dim,
                                           cfg.jnp_dtype).nbytes()
    assert (out.lengths == 300).all()


def test_one_compilation_per_bucket_policy_and_budget(stories):
    kvjax.generate(stories, _prompts(512, (70, 90, 100)), policy="snapkv", compression_ratio=0.5,
                   max_new_tokens=MAX_NEW, stop_tokens=[])
    before = dict(TRACE_COUNTS)
    kvjax.generate(stories, _prompts(512, (66, 127, 80)), policy="snapkv", compression_ratio=0.5,
                   max_new_tokens=MAX_NEW, stop_tokens=[])
    assert TRACE_COUNTS == before


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(policy="no_such_policy", budget=8), ValueError, "available: .*snapkv"),
        (dict(policy="snapkv"), ValueError, "exactly one of budget"),
        (dict(policy="snapkv", budget=40, compression_ratio=0.5), ValueError, "exactly one of budget"),
        (dict(policy="snapkv", budget=16), ValueError, "protected"),
        (dict(policy="snapkv", compression_ratio=1.5), ValueError, "compression_ratio"),
    ],
)
def test_policy_errors_through_generate(stories, kw, exc, match):
    with pytest.raises(exc, match=match):
        kvjax.generate(stories, _prompts(512, (80,)), max_new_tokens=4, **kw)


def test_invalid_hyperparameters():
    with pytest.raises(ValueError, match="kernel"):
        policies.SnapKV(kernel=4)
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        policies.get("snapkv", windw=3)


def _streaming_tokens(tmp_path, rope_mode):
    """One layer: cached keys/values depend only on their own token, so each decode step equals a
    transformers forward over the kept tokens (4 sinks + the newest) at re-indexed positions
    0..n-1 (cache_relative, the original pos_shift) or at their original positions.
    A small rope_theta makes the two position schemes give different tokens."""
    import torch

    folder = tmp_path / rope_mode
    hf = build_hf("llama3", folder, num_hidden_layers=1, rope_theta=100.0)
    model = kvjax.load_model(folder)
    budget, n_sink, steps = 16, 4, 10
    prompt = [1] + np.random.RandomState(7).randint(3, 101, 69).tolist()
    policy = policies.StreamingLLM(n_sink=n_sink, rope_mode=rope_mode)
    out = kvjax.generate(model, [prompt], policy=policy, budget=budget, max_new_tokens=steps, stop_tokens=[])

    def next_token(ids, positions):
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0, -1]
        return int(logits.argmax())

    seq = list(prompt)
    seq.append(next_token(seq, list(range(len(seq)))))  # the first token sees the whole prompt
    for _ in range(steps - 1):
        kept = list(range(n_sink)) + list(range(len(seq) - (budget - n_sink), len(seq)))
        positions = list(range(budget)) if rope_mode == "cache_relative" else kept
        seq.append(next_token([seq[i] for i in kept], positions))
    np.testing.assert_array_equal(out.tokens[0], seq[len(prompt):])
    return out.tokens[0]


def test_streaming_llm_positions_match_transformers_on_the_kept_window(tmp_path):
    relative = _streaming_tokens(tmp_path, "cache_relative")
    original = _streaming_tokens(tmp_path, "original")
    assert (relative != original).any()


def test_generate_settings_shares_the_prefill_and_matches_generate(stories):
    """One prefill for many settings (mixed RoPE modes, windows, column mass) gives each setting
    exactly what `generate` gives it alone, and compiles the model prefill once per RoPE mode."""
    from kvjax.engine import Setting, generate_settings

    contexts = _prompts(512, lengths=(200, 150, 230))
    questions = _prompts(512, lengths=(9, 12, 5))
    settings = [Setting(None), Setting("snapkv", compression_ratio=0.5), Setting("h2o", compression_ratio=0.75),
                Setting("streaming_llm", budget=64), Setting("tova", compression_ratio=0.5),
                Setting(_policy("lazy_eviction"), compression_ratio=0.5), Setting("knorm", budget=48)]
    before = TRACE_COUNTS["prefill"]
    outs = generate_settings(stories, contexts, settings, questions=questions, max_new_tokens=MAX_NEW,
                             stop_tokens=[])
    assert TRACE_COUNTS["prefill"] - before <= 2  # rotated keys, and un-rotated keys for StreamingLLM
    for st, out in zip(settings, outs):
        alone = kvjax.generate(stories, contexts, questions=questions, policy=st.policy, budget=st.budget,
                               compression_ratio=st.compression_ratio, max_new_tokens=MAX_NEW, stop_tokens=[])
        np.testing.assert_array_equal(out.tokens, alone.tokens, err_msg=str(st))
        np.testing.assert_allclose(out.kept, alone.kept, err_msg=str(st))
        assert out.cache_bytes == alone.cache_bytes
