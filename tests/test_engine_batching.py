"""Batches of mixed lengths: split into sub-batches by bucket, each padded only to its own bucket,
outputs in the caller's order and equal to each prompt alone; bounded compilations per bucket."""

import jax
import numpy as np
import pytest
from compile_counter import BackendCompiles

import kvjax
from kvjax.bench import __main__ as bench_main
from kvjax.engine import TRACE_COUNTS, Setting, bucket_length, generate_settings
from kvjax.engine.inputs import split_rows

RNG = np.random.RandomState(7)
N = 8  # new tokens
SETTINGS = [Setting(None), Setting("snapkv", compression_ratio=0.5), Setting("h2o", budget=40)]
# buckets 256, 128, 512, 128, 256, 128, 128: groups of 4 (128), 2 (256) and 1 (512)
MIXED = (150, 70, 300, 90, 200, 100, 75)


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


def _prompts(lengths, vocab=512):
    return [[1] + RNG.randint(3, vocab, n - 1).tolist() for n in lengths]


def _sizes(parts):
    return [len(p) for p in parts]


def test_split_rows_groups_by_bucket_in_power_of_two_sub_batches():
    lengths = np.array([10, 40, 20, 50, 60, 33, 62, 61, 30, 31])  # 4 rows in the 32 bucket, 6 in the 64 one
    parts = split_rows(lengths)
    assert [p.tolist() for p in parts] == [[0, 2, 8, 9], [1, 3, 4, 5], [6, 7]]  # shortest bucket first, 6 = 4 + 2
    assert _sizes(split_rows(np.array([40] * 7 + [10]))) == [1, 4, 2, 1]  # 7 = 4 + 2 + 1
    # a multiple of the mesh's data axis: a group is topped up with copies of its last row
    assert [p.tolist() for p in split_rows(np.array([10, 40, 50, 60]), multiple=2)] == [[0, 0], [1, 2, 3, 3]]
    assert _sizes(split_rows(np.array([10] * 6 + [40]), multiple=2)) == [4, 2, 2]
    # one bucket, or split=None: one batch of the caller's rows, in order, whatever its size
    assert [p.tolist() for p in split_rows(np.array([33, 64, 40]))] == [[0, 1, 2]]
    assert [p.tolist() for p in split_rows(np.array([33, 64, 40]), multiple=2)] == [[0, 1, 2]]
    assert [p.tolist() for p in split_rows(lengths, split=None)] == [list(range(10))]
    with pytest.raises(ValueError, match="split='rows'"):
        split_rows(lengths, split="rows")


@pytest.mark.parametrize("with_questions", [False, True])
def test_mixed_batch_equals_each_prompt_alone_in_the_callers_order(stories, with_questions):
    """Tokens, lengths, kept counts and budgets of every row equal what its prompt gives alone, for
    the full cache, a prefill policy (SnapKV at r=0.5) and a decode-time one (H2O)."""
    prompts = _prompts(MIXED)
    questions = [RNG.randint(3, 512, n).tolist() for n in (5, 70, 9, 3, 12, 7, 66)] if with_questions else None
    outs = generate_settings(stories, prompts, SETTINGS, questions=questions, max_new_tokens=N, stop_tokens=[])
    for b, p in enumerate(prompts):
        alone = generate_settings(stories, [p], SETTINGS, questions=None if questions is None else [questions[b]],
                                  max_new_tokens=N, stop_tokens=[])
        for st, out, one in zip(SETTINGS, outs, alone):
            msg = f"row {b}, {st}"
            np.testing.assert_array_equal(out.tokens[b], one.tokens[0], err_msg=msg)
            assert out.lengths[b] == one.lengths[0] and out.prompt_lengths[b] == len(p), msg
            for field in ("kept", "kept_final", "kept_peak", "kept_mean", "kv_bytes_peak", "budget", "budget_reached"):
                a, c = getattr(out, field), getattr(one, field)
                assert (a is None) == (c is None), msg
                if a is not None:
                    np.testing.assert_allclose(a[b], c[0], err_msg=f"{msg}: {field}")
    np.testing.assert_allclose(outs[1].kept, np.array(MIXED) // 2)  # kvpress's int(T * (1 - r)), row by row


def test_output_order_is_the_callers(stories):
    prompts = _prompts(MIXED)
    out = kvjax.generate(stories, prompts, max_new_tokens=N, stop_tokens=[])
    perm = [3, 0, 6, 2, 5, 1, 4]
    shuffled = kvjax.generate(stories, [prompts[i] for i in perm], max_new_tokens=N, stop_tokens=[])
    np.testing.assert_array_equal(shuffled.tokens, out.tokens[perm])
    np.testing.assert_array_equal(shuffled.prompt_lengths, np.array(MIXED)[perm])


def test_split_and_one_padded_batch_agree_and_split_allocates_less(stories):
    prompts = _prompts(MIXED)
    split = kvjax.generate(stories, prompts, max_new_tokens=N, stop_tokens=[])
    padded = kvjax.generate(stories, prompts, max_new_tokens=N, stop_tokens=[], split=None)
    np.testing.assert_array_equal(split.tokens, padded.tokens)
    np.testing.assert_allclose(split.kept, padded.kept)
    # cache_bytes of a split batch: the sum of its sub-batches' decode caches
    parts = split_rows(np.array(MIXED))
    want = sum(kvjax.generate(stories, [prompts[i] for i in p], max_new_tokens=N, stop_tokens=[]).cache_bytes
               for p in parts)
    assert split.cache_bytes == want < padded.cache_bytes


def test_no_recompilation_inside_a_bucket(stories):
    """Other lengths in the same buckets compile nothing new, nor does another mix of group sizes
    whose power-of-two sub-batches were all seen (3 rows of a bucket run as 2 + 1)."""
    kw = dict(policy="snapkv", compression_ratio=0.5, max_new_tokens=N, stop_tokens=[])
    first = (150, 70, 300, 90, 200, 100, 75)  # 128: 4 rows, 256: 2, 512: 1
    kvjax.generate(stories, _prompts(first), **kw)
    kvjax.generate(stories, _prompts((80, 90, 100, 300)), **kw)  # 128: 3 rows (2 + 1), 512: 1
    before = dict(TRACE_COUNTS)
    with BackendCompiles() as compiles:
        kvjax.generate(stories, _prompts((140, 66, 400, 127, 250, 99, 80)), **kw)  # the same buckets and sizes
        kvjax.generate(stories, _prompts((140, 66, 400, 127, 250, 99)), **kw)  # 128: 2 + 1; 256: 2; 512: 1
        kvjax.generate(stories, _prompts((400, 66)), **kw)  # 512: 1, 128: 1
    assert dict(TRACE_COUNTS) == before
    assert compiles.count == 0
    assert {bucket_length(n) for n in first} == {128, 256, 512}


def test_a_batch_in_one_bucket_runs_as_before(stories):
    """All rows in one bucket: one batch of the caller's size (3, not 2 + 1), the same output as
    split=None, field by field, and the same sampled draws."""
    prompts = _prompts((70, 120, 99))
    before = TRACE_COUNTS["prefill"]
    out = kvjax.generate(stories, prompts, max_new_tokens=N, stop_tokens=[], policy="snapkv", compression_ratio=0.5)
    assert TRACE_COUNTS["prefill"] - before <= 1  # a batch of 3 (compiled here unless an earlier test did)
    one = kvjax.generate(stories, prompts, max_new_tokens=N, stop_tokens=[], policy="snapkv", compression_ratio=0.5,
                         split=None)
    for field in ("tokens", "lengths", "kept", "kept_final", "kept_peak", "kept_mean", "budget", "budget_reached"):
        np.testing.assert_array_equal(getattr(out, field), getattr(one, field), err_msg=field)
    assert out.cache_bytes == one.cache_bytes
    kw = dict(max_new_tokens=N, stop_tokens=[], temperature=1.0, key=jax.random.PRNGKey(3))
    np.testing.assert_array_equal(kvjax.generate(stories, prompts, **kw).tokens,
                                  kvjax.generate(stories, prompts, split=None, **kw).tokens)


def test_sampling_a_split_batch_is_reproducible(stories):
    prompts = _prompts(MIXED)
    kw = dict(max_new_tokens=N, stop_tokens=[], temperature=1.0, top_k=50)
    a = kvjax.generate(stories, prompts, key=jax.random.PRNGKey(0), **kw).tokens
    b = kvjax.generate(stories, prompts, key=jax.random.PRNGKey(0), **kw).tokens
    c = kvjax.generate(stories, prompts, key=jax.random.PRNGKey(1), **kw).tokens
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_continuation_logits_of_a_mixed_batch_equal_each_alone(stories):
    contexts = _prompts((150, 40, 300))
    conts = [RNG.randint(3, 512, n).tolist() for n in (7, 40, 4)]
    got = kvjax.engine.continuation_logits(stories, contexts, conts)
    for b in range(3):
        alone = kvjax.engine.continuation_logits(stories, [contexts[b]], [conts[b]])[0]
        assert got[b].shape == (len(conts[b]), stories.config.vocab_size)
        np.testing.assert_allclose(got[b], alone, atol=1e-5)


def test_split_batch_on_a_mesh_equals_single_device(stories, stories_path):
    """On a data=2 mesh every sub-batch is a multiple of 2 rows (a lone row of a bucket runs beside
    a copy of itself, dropped), and the answers equal the single-device ones."""
    assert len(jax.devices()) == 8
    prompts = _prompts((150, 70, 300, 90, 200))  # 128: 2 rows, 256: 2, 512: 1 (+ a copy)
    settings = [Setting(None), Setting("snapkv", compression_ratio=0.5)]
    single = generate_settings(stories, prompts, settings, max_new_tokens=N, stop_tokens=[])
    sharded_model = kvjax.load_model(stories_path, mesh=kvjax.make_mesh(data=2, model=4))
    sharded = generate_settings(sharded_model, prompts, settings, max_new_tokens=N, stop_tokens=[])
    for a, b in zip(single, sharded):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.kept, a.kept)
    # the copy's cache is allocated, so it is counted: 6 rows' caches on the mesh for 5 on one device
    assert sharded[0].cache_bytes > single[0].cache_bytes


def test_bench_batch_subcommand(tmp_path, capsys):
    out = tmp_path / "batch.md"
    assert bench_main.main(["batch", "--lengths", "70,150,300", "--hidden", "64", "--layers", "1", "--heads", "4",
                            "--kv-heads", "2", "--vocab", "128", "--new-tokens", "4", "--repeats", "1",
                            "--out", str(out)]) == 0
    text = out.read_text()
    assert "same generated tokens in all three ways: yes" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| way")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["batch (split)", "one by one", "batch (one padded)"]
    assert "ratio to one by one" in capsys.readouterr().out


def test_texts_of_a_split_batch_are_in_the_callers_order():
    model = kvjax.load_model("bundled")
    prompts = ["The magic number is 7. " * 12, "Anna lives in Paris.", "The key is blue. " * 30]
    lengths = [len(ids) for ids in kvjax.engine.encode_prompts(model, prompts)]
    assert len({bucket_length(n) for n in lengths}) == 3
    out = kvjax.generate(model, prompts, max_new_tokens=6, stop_tokens=[])
    for b, p in enumerate(prompts):
        alone = kvjax.generate(model, [p], max_new_tokens=6, stop_tokens=[])
        assert out.texts[b] == alone.texts[0]
        np.testing.assert_array_equal(out.tokens[b], alone.tokens[0])
