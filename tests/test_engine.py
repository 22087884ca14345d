"""The generation engine: compile counts, context-then-question mode, stop tokens, sharding."""

import types

import jax
import numpy as np
import pytest
from compile_counter import BackendCompiles

import kvjax
from kvjax.engine import TRACE_COUNTS, bucket_length

RNG = np.random.RandomState(1)


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


def _prompts(lengths, vocab=512):
    return [[1] + RNG.randint(3, vocab, n - 1).tolist() for n in lengths]


def test_one_compilation_per_bucket_and_batch(stories):
    # 5 prompts of different lengths, all in the 64-token bucket
    assert {bucket_length(n) for n in (33, 40, 47, 55, 64)} == {64}
    before = dict(TRACE_COUNTS)
    kvjax.generate(stories, _prompts((33, 40, 47, 55, 64)), max_new_tokens=8, stop_tokens=[])
    assert TRACE_COUNTS["prefill"] - before.get("prefill", 0) == 1
    assert TRACE_COUNTS["decode"] - before.get("decode", 0) == 1
    # other lengths in the same bucket with the same batch size: no compilation at all
    with BackendCompiles() as compiles:
        kvjax.generate(stories, _prompts((35, 61, 42, 50, 58)), max_new_tokens=8, stop_tokens=[])
    assert compiles.count == 0
    assert TRACE_COUNTS["prefill"] - before.get("prefill", 0) == 1
    assert TRACE_COUNTS["decode"] - before.get("decode", 0) == 1


def test_context_then_question_equals_one_prompt_with_full_cache(stories):
    contexts = _prompts((30, 12, 21))
    questions = [RNG.randint(3, 512, n).tolist() for n in (5, 9, 2)]
    split = kvjax.generate(stories, contexts, questions=questions, max_new_tokens=12, stop_tokens=[])
    joined = kvjax.generate(stories, [c + q for c, q in zip(contexts, questions)], max_new_tokens=12, stop_tokens=[])
    np.testing.assert_array_equal(split.tokens, joined.tokens)


def test_stop_tokens_end_rows_and_pad_after(stories):
    prompts = _prompts((20, 9))
    free = kvjax.generate(stories, prompts, max_new_tokens=10, stop_tokens=[])
    stop = int(free.tokens[0, 3])
    out = kvjax.generate(stories, prompts, max_new_tokens=10, stop_tokens=[stop])
    first_hit = int(np.flatnonzero(free.tokens[0] == stop)[0])
    assert out.lengths[0] == first_hit + 1
    np.testing.assert_array_equal(out.tokens[0, : first_hit + 1], free.tokens[0, : first_hit + 1])
    assert (out.tokens[0, first_hit + 1:] == out.pad_id).all()
    # the other row is unaffected by row 0 stopping
    hit1 = np.flatnonzero(free.tokens[1] == stop)
    n1 = hit1[0] + 1 if len(hit1) else 10
    np.testing.assert_array_equal(out.tokens[1, :n1], free.tokens[1, :n1])


def test_sampling_is_reproducible_and_key_dependent(stories):
    prompts = _prompts((16, 30))
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95, stop_tokens=[])
    a = kvjax.generate(stories, prompts, key=jax.random.PRNGKey(0), **kw).tokens
    b = kvjax.generate(stories, prompts, key=jax.random.PRNGKey(0), **kw).tokens
    c = kvjax.generate(stories, prompts, key=jax.random.PRNGKey(1), **kw).tokens
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    greedy = kvjax.generate(stories, prompts, max_new_tokens=16, stop_tokens=[]).tokens
    top1 = kvjax.generate(stories, prompts, key=jax.random.PRNGKey(5), **{**kw, "top_k": 1}).tokens
    np.testing.assert_array_equal(top1, greedy)


def test_sharded_generation_equals_single_device(stories_path):
    assert len(jax.devices()) == 8
    prompts = _prompts((10, 37, 22, 50))
    single = kvjax.generate(kvjax.load_model(stories_path), prompts, max_new_tokens=12, stop_tokens=[])
    mesh = kvjax.make_mesh(data=2, model=4)
    sharded_model = kvjax.load_model(stories_path, mesh=mesh)
    q = sharded_model.params["layers"]["q"]
    assert q.sharding.spec[2] == "model" and len(q.sharding.device_set) == 8
    sharded = kvjax.generate(sharded_model, prompts, max_new_tokens=12, stop_tokens=[])
    np.testing.assert_array_equal(sharded.tokens, single.tokens)


def test_mesh_rejects_bad_shape():
    with pytest.raises(ValueError, match="model=3"):
        kvjax.make_mesh(model=3)


def test_continuation_logits_equal_full_forward(stories):
    import jax.numpy as jnp

    from kvjax.engine import continuation_logits
    from kvjax.models import extend

    contexts = _prompts((20, 33))
    conts = [RNG.randint(3, 512, n).tolist() for n in (7, 4)]
    got = continuation_logits(stories, contexts, conts)
    for b in range(2):
        seq = np.asarray(contexts[b] + conts[b])[None]
        ref, _, _ = extend(stories.params, stories.config, None, jnp.asarray(seq), jnp.arange(seq.shape[1])[None],
                           fresh=True)
        np.testing.assert_allclose(got[b], np.asarray(ref)[0, len(contexts[b]):], atol=1e-4)


def test_answer_caps_in_one_step_bucket_share_the_decode_program(stories):
    prompts = _prompts((30, 41))
    long = kvjax.generate(stories, prompts, max_new_tokens=40, stop_tokens=[])
    before = dict(TRACE_COUNTS)
    short = kvjax.generate(stories, prompts, max_new_tokens=33, stop_tokens=[])  # same 64-step bucket
    assert TRACE_COUNTS == before
    assert short.tokens.shape == (2, 33) and (short.lengths == 33).all()
    np.testing.assert_array_equal(short.tokens, long.tokens[:, :33])


def test_compress_returns_the_entries_the_policy_keeps(stories):
    """StreamingLLM keeps its 4 sinks and the newest positions in every layer and head (budget - 1
    entries: it leaves the slot the next decoded token is written to); a scored policy keeps exactly
    `budget` entries of each row's own prompt."""
    prompts = _prompts([40, 30])
    cache = kvjax.engine.compress(stories, prompts, policy="streaming_llm", budget=16)
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    for b, n in enumerate((40, 30)):
        for l in range(pos.shape[0]):
            for h in range(pos.shape[2]):
                assert sorted(pos[l, b, h][valid[l, b, h]]) == [0, 1, 2, 3] + list(range(n - 11, n))
    cache = kvjax.engine.compress(stories, _prompts([120, 90]), policy="snapkv", budget=48)
    valid, pos = np.asarray(cache.valid), np.asarray(cache.pos)
    assert (valid.sum(-1) == 48).all() and (pos[:, 1][valid[:, 1]] < 90).all()
    with pytest.raises(ValueError, match="needs a policy"):
        kvjax.engine.compress(stories, prompts, policy=None)


def test_decode_tokens_shares_one_program_across_max_new_tokens(stories):
    """`decode_tokens`: calls with different `max_new_tokens` run the loop compiled for the larger
    bucket, stop at their own cap (tokens [B, max_new_tokens]) and answer as without it, for a
    prefill-time and a decode-time policy."""
    from kvjax.engine import Setting, generate_settings

    contexts = _prompts((120, 97))
    settings = [Setting(None), Setting("snapkv", compression_ratio=0.5), Setting("h2o", budget=40)]
    plain = {n: generate_settings(stories, contexts, settings, max_new_tokens=n, stop_tokens=[]) for n in (5, 40)}
    generate_settings(stories, contexts, settings, max_new_tokens=40, decode_tokens=100, stop_tokens=[])
    with BackendCompiles() as compiles:
        shared = {n: generate_settings(stories, contexts, settings, max_new_tokens=n, decode_tokens=100,
                                       stop_tokens=[]) for n in (5, 40)}
    assert compiles.count == 0
    for n in (5, 40):
        for a, b in zip(plain[n], shared[n]):
            assert b.tokens.shape == (2, n)
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.kept, b.kept)
    with pytest.raises(ValueError, match="decode_tokens"):
        kvjax.generate(stories, contexts, max_new_tokens=5, decode_tokens=-1)


def test_question_tokens_pads_questions_into_one_program_without_changing_answers(stories):
    """`question_tokens`: questions of different lengths share the compiled programs of the padded
    bucket, and the padding changes no answer, for prefill-time and decode-time policies alike."""
    from kvjax.engine import Setting, generate_settings

    contexts = _prompts((120, 97))
    short_q = [RNG.randint(3, 512, n).tolist() for n in (5, 9)]
    long_q = [RNG.randint(3, 512, n).tolist() for n in (70, 90)]  # past the 64-token question bucket
    settings = [Setting(None), Setting("snapkv", compression_ratio=0.5), Setting("h2o", budget=40),
                Setting("tova", budget=40)]
    plain = generate_settings(stories, contexts, settings, questions=short_q, max_new_tokens=10, stop_tokens=[])
    padded = generate_settings(stories, contexts, settings, questions=short_q, max_new_tokens=10, stop_tokens=[],
                               question_tokens=128)
    for a, b in zip(plain, padded):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    with BackendCompiles() as compiles:
        generate_settings(stories, contexts, settings, questions=long_q, max_new_tokens=10, stop_tokens=[],
                          question_tokens=128)
    assert compiles.count == 0


def test_decode_layer_loop_answers_as_the_scan(stories, monkeypatch):
    """On a GPU decode runs its layers in a Python loop over per-layer params (no per-step weight copies):
    the same answers and kept entries as the scan over stacked params, for the full cache, a prefill-time and
    a decode-time policy (h2o evicts inside the loop)."""
    from kvjax.engine import Setting, generate_settings, steps

    contexts = _prompts((90, 71))
    settings = [Setting(None), Setting("snapkv", compression_ratio=0.5), Setting("h2o", budget=40)]
    stacked, per_layer = types.SimpleNamespace(stacked=True), types.SimpleNamespace(stacked=False)
    assert not steps.layers_in_a_loop(stacked) and steps.layers_in_a_loop(per_layer)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert steps.layers_in_a_loop(stacked)
    assert steps.decode_program() is not steps._DECODE_PROGRAMS[None]  # compiled with the command buffer option
    monkeypatch.undo()

    def run(loop: bool):
        monkeypatch.setattr(steps, "layers_in_a_loop", lambda cache: loop)
        steps.decode_program().clear_cache()
        try:
            return generate_settings(stories, contexts, settings, max_new_tokens=12, stop_tokens=[])
        finally:
            steps.decode_program().clear_cache()

    scan, loop = run(False), run(True)
    for a, b in zip(scan, loop):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.kept, b.kept)
