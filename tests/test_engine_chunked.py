"""Chunked prefill with eviction (`generate(..., prefill_chunk=N)`, README "Chunked prefill"):
the kept sets against a NumPy reference written from the definition, equality with the one-shot
prefill when the prompt fits in one chunk, the bounded cache, one compiled program per bucket, and
the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
import kvjax.engine
from kvjax import policies
from kvjax.cache import KVCache
from kvjax.engine import TRACE_COUNTS, Setting, steps
from kvjax.models import extend
from kvjax.observations import ObservationSpec
from kvjax.policies.registry import chunked_presets

RNG = np.random.RandomState(11)


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


def _prompts(lengths, vocab=512):
    return [[1] + RNG.randint(3, vocab, n - 1).tolist() for n in lengths]


def _kept(cache: KVCache) -> list:
    """Kept prompt positions per [layer][row][head], as sorted tuples."""
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    L, B, H, _ = valid.shape
    return [[[tuple(sorted(pos[l, b, h][valid[l, b, h]].tolist())) for h in range(H)] for b in range(B)]
            for l in range(L)]


# ----------------------------------------------------------------------------- the NumPy reference


def _chunks(T: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a T-token prompt, aligned on its end (the first holds the rest)."""
    ends = list(range(T, 0, -chunk))[::-1]
    return [(max(0, e - chunk), e) for e in ends]


def _softmax_rows(logits, mask):
    z = np.where(mask, logits, -np.inf)
    z = z - z.max(-1, keepdims=True)
    e = np.where(mask, np.exp(z), 0.0)
    return e / e.sum(-1, keepdims=True)


def _snapkv_keep(q, qpos, k, pos, cur, count, *, window, kernel, scale):
    """SnapKV on one head's surviving entries (sorted by position): q [G,w,D] the chunk's last
    `window` queries at positions qpos [w]; k [S,D], pos [S]. Window attention (softmax over the
    entries each query sees), summed over the window, group mean, max-pooled over the candidates
    (pos < cur - window) in position order; the last `window` positions protected; keep `count`."""
    logits = np.einsum("gwd,sd->gws", q, k) * scale
    a = _softmax_rows(logits, pos[None, None, :] <= qpos[None, :, None]).sum(1).mean(0)  # [S]
    cand = pos < cur - window
    c = np.flatnonzero(cand)
    pooled = np.array([a[c[max(0, i - kernel // 2): i + kernel // 2 + 1]].max() for i in range(len(c))])
    order = sorted(range(len(c)), key=lambda i: (-pooled[i], pos[c[i]]))
    keep = ~cand
    keep[c[order[: max(0, count - int((~cand).sum()))]]] = True
    return keep


def _h2o_keep(mass, pos, cur, count, *, window):
    """H2O prefill on one head: score = accumulated mass, the last `window` positions protected."""
    cand = pos < cur - window
    c = np.flatnonzero(cand)
    order = sorted(c, key=lambda j: (-mass[j], pos[j]))
    keep = ~cand
    keep[order[: max(0, count - int((~cand).sum()))]] = True
    return keep


def reference_chunked(model, prompt, chunk, budget, kind, **hp):
    """Chunked prefill by its definition, one prompt: for each chunk (aligned on the prompt's end),
    append it to the surviving entries (the model's forward over that cache: `extend`), score the
    surviving entries plus the chunk with the chunk's own queries, keep the protected tokens and
    the best-scored up to the budget. Scoring, selection and the cache bookkeeping are NumPy.
    Returns kept positions per [layer][head]."""
    cfg = model.config
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // H
    scale = D**-0.5
    T = len(prompt)
    count = min(budget, T)
    C = budget + chunk
    # surviving entries per (layer, head): positions, keys, values (and accumulated mass)
    surv = [[dict(pos=np.zeros(0, int), k=np.zeros((0, D)), v=np.zeros((0, D)), mass=np.zeros(0))
             for _ in range(H)] for _ in range(L)]
    run = jax.jit(functools.partial(extend, cfg=cfg, fresh=False), static_argnames=("observe",))
    for start, end in _chunks(T, chunk):
        n = end - start
        k = np.zeros((L, 1, H, C, D), np.float32)
        v = np.zeros((L, 1, H, C, D), np.float32)
        pos = np.full((L, 1, H, C), -1, np.int32)
        for l in range(L):
            for h in range(H):
                s = surv[l][h]
                m = len(s["pos"])
                k[l, 0, h, :m], v[l, 0, h, :m], pos[l, 0, h, :m] = s["k"], s["v"], s["pos"]
        cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(v), pos=jnp.asarray(pos), valid=jnp.asarray(pos >= 0))
        tokens = jnp.asarray([prompt[start:end]], jnp.int32)
        positions = jnp.arange(start, end, dtype=jnp.int32)[None]
        _, cache, obs = run(model.params, cache=cache, tokens=tokens, positions=positions,
                            observe=ObservationSpec(window=n))
        q_all = np.asarray(obs.window_queries, np.float64)[:, 0]  # [L,Hq,n,D]: every query of the chunk
        ck, cv = np.asarray(cache.k, np.float64)[:, 0], np.asarray(cache.v, np.float64)[:, 0]
        cpos, cvalid = np.asarray(cache.pos)[:, 0], np.asarray(cache.valid)[:, 0]
        qpos = np.arange(start, end)
        for l in range(L):
            for h in range(H):
                idx = np.flatnonzero(cvalid[l, h])
                idx = idx[np.argsort(cpos[l, h, idx])]
                p, kk, vv = cpos[l, h, idx], ck[l, h, idx], cv[l, h, idx]
                q = q_all[l, h * G:(h + 1) * G]  # [G,n,D]
                mass = np.concatenate([surv[l][h]["mass"], np.zeros(len(p) - len(surv[l][h]["mass"]))])
                if kind == "snapkv":
                    w = hp["window"]
                    keep = _snapkv_keep(q[:, -w:], qpos[-w:], kk, p, end, count, window=w, kernel=hp["kernel"],
                                        scale=scale)
                else:  # h2o_prefill: accumulated column mass (group sum) of every query so far
                    probs = _softmax_rows(np.einsum("gnd,sd->gns", q, kk) * scale, p[None, None] <= qpos[None, :, None])
                    mass = mass + probs.sum((0, 1))
                    keep = _h2o_keep(mass, p, end, count, window=hp["window"])
                surv[l][h] = dict(pos=p[keep], k=kk[keep], v=vv[keep], mass=mass[keep])
    return [[tuple(sorted(surv[l][h]["pos"].tolist())) for h in range(H)] for l in range(L)]


@pytest.mark.parametrize("kind,policy", [
    ("snapkv", policies.SnapKV(window=8, kernel=5)),
    ("h2o_prefill", policies.H2OPrefill(window=4)),
])
def test_kept_sets_equal_the_numpy_reference(stories, kind, policy):
    """Two rows of one bucket (one batch), prompts several chunks long, the last chunk of each
    row full and the first partial: the engine's kept positions per layer and head equal the
    reference's, built row by row."""
    lengths, chunk, budget = (150, 201), 32, 40
    prompts = _prompts(lengths)
    cache = kvjax.engine.compress(stories, prompts, policy=policy, budget=budget, prefill_chunk=chunk)
    got = _kept(cache)
    hp = dict(window=policy.window, kernel=getattr(policy, "kernel", None))
    for b, prompt in enumerate(prompts):
        want = reference_chunked(stories, prompt, chunk, budget, kind, **hp)
        for l in range(len(want)):
            for h in range(len(want[l])):
                assert len(got[l][b][h]) == budget
                assert got[l][b][h] == want[l][h], (b, l, h)
    # and chunking changed the decision (the test is not vacuous): one-shot keeps other entries
    one = _kept(kvjax.engine.compress(stories, prompts, policy=policy, budget=budget))
    assert one != got


# ----------------------------------------------------------------------------- one chunk = one shot


@pytest.mark.parametrize("name", ["snapkv", "h2o_prefill", "tova", "streaming_llm", "knorm", "ada_snapkv",
                                  "pyramidkv", "h2o"])
def test_a_prompt_in_one_chunk_equals_the_one_shot_prefill(stories, name):
    policy = policies.get(name, window=8) if "snap" in name or "pyramid" in name else policies.get(name)
    prompts = _prompts((90, 61))
    kw = dict(policy=policy, budget=30)
    one = _kept(kvjax.engine.compress(stories, prompts, **kw))
    chunked = _kept(kvjax.engine.compress(stories, prompts, prefill_chunk=128, **kw))
    assert chunked == one
    if name not in ("snapkv", "h2o"):  # the whole path (first token, decode) for two of them
        return
    a = kvjax.generate(stories, prompts, max_new_tokens=6, stop_tokens=[], **kw)
    b = kvjax.generate(stories, prompts, max_new_tokens=6, stop_tokens=[], prefill_chunk=90, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.kept, b.kept)


def test_chunked_prefill_on_a_mesh_equals_single_device(stories, stories_path):
    """data=2, model=4 over the 8 fake devices: the same kept counts and tokens as one device."""
    assert len(jax.devices()) == 8
    prompts = _prompts((150, 97, 120, 64))
    kw = dict(policy=policies.get("snapkv", window=8), budget=40, max_new_tokens=6, stop_tokens=[], prefill_chunk=32)
    single = kvjax.generate(stories, prompts, **kw)
    sharded = kvjax.generate(kvjax.load_model(stories_path, mesh=kvjax.make_mesh(data=2, model=4)), prompts, **kw)
    np.testing.assert_array_equal(sharded.tokens, single.tokens)
    np.testing.assert_array_equal(sharded.kept, single.kept)


def test_streaming_keeps_the_same_sets_chunked_or_not(stories):
    """StreamingLLM's kept set depends on positions only: sinks + the most recent, whatever the chunks."""
    prompts = _prompts((150, 201))
    kw = dict(policy="streaming_llm", budget=40)
    assert _kept(kvjax.engine.compress(stories, prompts, prefill_chunk=16, **kw)) == \
        _kept(kvjax.engine.compress(stories, prompts, **kw))


def test_a_budget_above_the_prompt_changes_nothing(stories):
    prompts = _prompts((150, 97))
    full = kvjax.generate(stories, prompts, max_new_tokens=6, stop_tokens=[])
    for name in ("snapkv", "h2o", "tova"):
        policy = policies.get(name, window=8) if name == "snapkv" else name
        out = kvjax.generate(stories, prompts, policy=policy, budget=400, max_new_tokens=6, stop_tokens=[],
                             prefill_chunk=32)
        np.testing.assert_array_equal(out.tokens, full.tokens)
        np.testing.assert_allclose(out.kept, [150, 97])
    # context then question: the question is fed after the chunked prefill, as after a one-shot one
    questions = _prompts((9, 14))
    full = kvjax.generate(stories, prompts, questions=questions, max_new_tokens=4, stop_tokens=[])
    out = kvjax.generate(stories, prompts, questions=questions, policy=policies.get("snapkv", window=8), budget=400,
                         max_new_tokens=4, stop_tokens=[], prefill_chunk=32)
    np.testing.assert_array_equal(out.tokens, full.tokens)


# ----------------------------------------------------------------------------- memory and compilation


def test_the_cache_never_exceeds_budget_plus_chunk(stories, monkeypatch):
    """Every chunk program gets a cache of (kept capacity + decode room) + chunk slots, far below
    the prompt; no one-shot prefill runs; the cache after prefill has the plan's capacity."""
    seen, finals = [], []
    chunk_step, finish = steps.prefill_chunk, steps.finish_chunks

    def record(params, cache, *args, **kw):
        seen.append(cache.k.shape)
        out = chunk_step(params, cache, *args, **kw)
        seen.append(out[1].k.shape)
        return out

    def record_finish(cache, *args, **kw):
        out = finish(cache, *args, **kw)
        finals.append(out[0].k.shape)
        return out

    def no_prefill(*args, **kw):
        raise AssertionError("the one-shot prefill ran")

    monkeypatch.setattr(steps, "prefill_chunk", record)
    monkeypatch.setattr(steps, "finish_chunks", record_finish)
    monkeypatch.setattr(steps, "prefill", no_prefill)
    budget, chunk, new = 40, 32, 4
    prompts = _prompts((230, 180))
    out = kvjax.generate(stories, prompts, policy=policies.get("snapkv", window=8), budget=budget,
                         max_new_tokens=new, stop_tokens=[], prefill_chunk=chunk)
    room = kvjax.engine.bucket_length(new, kvjax.engine.STEP_BUCKETS)  # decode room: the step bucket
    cfg = stories.config
    assert len(seen) == 2 * 8  # ceil(230 / 32) chunks, each the same shape in and out
    for shape in seen:
        assert shape == (cfg.num_layers, 2, cfg.num_kv_heads, budget + room + chunk, cfg.head_dim)
    assert finals == [(cfg.num_layers, 2, cfg.num_kv_heads, budget + room, cfg.head_dim)]
    np.testing.assert_allclose(out.kept, budget)
    assert out.cache_bytes < 2 * 230 * cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim * 4


def test_no_recompilation_across_chunks_and_calls_in_a_bucket(stories):
    """One chunk program for every chunk of a prompt, and for other prompts (other lengths, another
    number of chunks) of the same bucket and batch size, by budget and by ratio."""
    policy = policies.get("snapkv", window=8, kernel=3)  # a configuration no other test compiles
    for kw in (dict(budget=40), dict(compression_ratio=0.7)):
        before = dict(TRACE_COUNTS)
        for lengths in ((150, 201), (240, 130), (129, 256)):  # 5 to 8 chunks, all in bucket 256
            kvjax.generate(stories, _prompts(lengths), policy=policy, max_new_tokens=4, stop_tokens=[],
                           prefill_chunk=32, **kw)
        grew = {k: TRACE_COUNTS[k] - before.get(k, 0) for k in ("prefill_chunk", "finish_chunks", "prefill")}
        assert grew == {"prefill_chunk": 1, "finish_chunks": 1, "prefill": 0}, (kw, grew)


# ----------------------------------------------------------------------------- errors and support


def test_which_policies_support_it():
    supported = set(chunked_presets())
    assert {"streaming_llm", "knorm", "snapkv", "pyramidkv", "ada_snapkv", "tova", "h2o_prefill", "h2o",
            "cake"} <= supported
    for name in ("kvzip", "lookahead_kv", "lazy_eviction", "critical_snapkv", "defensivekv", "expected_attention",
                 "cake_cascade"):
        assert name not in supported and not policies.get(name).supports_chunked_prefill


def test_clear_errors(stories):
    prompts = _prompts((100, 120))
    with pytest.raises(ValueError, match=r"'kvzip' does not support chunked prefill.*snapkv"):
        kvjax.generate(stories, prompts, policy="kvzip", budget=40, prefill_chunk=32)
    with pytest.raises(ValueError, match="positive"):
        kvjax.generate(stories, prompts, policy="snapkv", budget=40, prefill_chunk=0)
    with pytest.raises(ValueError, match="positive"):
        Setting("snapkv", budget=40, prefill_chunk=-8)
    with pytest.raises(TypeError, match="prefill_chunk must be an int"):
        Setting("snapkv", budget=40, prefill_chunk=32.5)
    with pytest.raises(ValueError, match=r"prefill_chunk=16 is smaller than the 32 tokens"):
        kvjax.generate(stories, prompts, policy="snapkv", budget=40, prefill_chunk=16)  # window 32
    with pytest.raises(ValueError, match="full-cache setting"):
        Setting(None, prefill_chunk=32)
    # in a batch of settings, on_error="return" puts the error in the setting's slot
    ok, bad = kvjax.engine.generate_settings(
        stories, prompts, [Setting("snapkv", budget=40), Setting("lazy_eviction", budget=200)], prefill_chunk=32,
        max_new_tokens=2, on_error="return")
    assert isinstance(bad, ValueError) and "lazy_eviction" in str(bad) and not isinstance(ok, ValueError)
