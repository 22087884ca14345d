"""Decode-time policies: a naive per-token NumPy simulation of the spec, and 2,000-step schedules."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import pol_reference as R
from kvjax.policies import CAKE, H2O, TOVA, LazyEviction, StreamingLLM, get
from pol_decode import run_decode
from pol_helpers import HKV, G, assert_same_kept, make_inputs
from pol_prefill_ref import reference_prefill

LENGTHS = (21, 9, 15)


@functools.lru_cache(maxsize=None)
def inputs(window=8):
    return make_inputs(5, lengths=LENGTHS, window=window, num_layers=2)


def _plan(policy, inp, budget, steps):
    return policy.plan(inp.lengths, inp.num_layers, HKV, budget=budget, max_new_tokens=steps + 1)


def _record(policy, inp, budget, steps, **kw):
    plan = _plan(policy, inp, budget, steps)
    n_valid, rec, _, _ = run_decode(policy, plan, inp.cache, inp.obs, steps=steps, group=G, record=True, **kw)
    return plan, np.asarray(n_valid), [np.asarray(x) for x in rec]


def _probs_by_pos(pos, valid, probs):
    """{position: probs [G]} for one (layer, row, head) at one step."""
    return {int(p): probs[:, s] for s, p in enumerate(pos) if valid[s]}


def _check_step(t, idx, present_ref, pos, valid, keep, ref_keep, scores, prot, tol=1e-5):
    present = {int(p) for p in pos[valid]}
    assert present == present_ref, f"step {t} {idx}: cache holds {sorted(present)}, reference {sorted(present_ref)}"
    got = {int(p) for p in pos[valid & keep]}
    assert_same_kept(got, ref_keep, scores, prot, tol=tol, where=f"step {t} {idx}")
    return got  # follow the policy through tolerated boundary ties


def simulate(policy, budget, steps, update, sharpness=12.0):
    """Runs the JAX policy and replays every (layer, row, head) with `update(t, idx, tokens, probs_by_pos)`,
    which returns (reference kept set, scores, protected) and updates its own token state."""
    inp = inputs()
    plan, _, (pos, valid, probs, written, keep) = _record(policy, inp, budget, steps, sharpness=sharpness)
    prefill = reference_prefill(policy, inp, budget)
    for idx in np.ndindex(pos.shape[1:4]):
        l, b, h = idx
        T = inp.lengths[b]
        tokens = {p: {} for p in prefill[idx][0]}
        update.init(idx, tokens, inp)
        for t in range(1, steps + 1):
            s = t - 1
            tokens[T + t - 1] = {}
            pb = _probs_by_pos(pos[s][idx], valid[s][idx], probs[s][idx])
            ref_keep, scores, prot = update(t, idx, tokens, pb)
            got = _check_step(t, idx, set(tokens), pos[s][idx], valid[s][idx], keep[s][idx], ref_keep, scores, prot)
            for p in set(tokens) - got:
                del tokens[p]
    return plan


class H2ORef:
    def __init__(self, budget, recent):
        self.budget, self.recent = budget, recent

    def init(self, idx, tokens, inp):
        l, b, h = idx
        for p in tokens:
            tokens[p]["acc"] = inp.mass[l, b, h, p]

    def __call__(self, t, idx, tokens, pb):
        for p, tok in tokens.items():
            tok["acc"] = tok.get("acc", 0.0) + float(pb[p].sum())
        order = sorted(tokens)
        prot = order[-self.recent :] if self.recent else []
        scores = {p: tokens[p]["acc"] for p in order if p not in prot}
        return R.keep_with_protected(scores, prot, self.budget), scores, set(prot)


class TOVARef:
    def __init__(self, budget):
        self.budget = budget

    def init(self, idx, tokens, inp):
        pass

    def __call__(self, t, idx, tokens, pb):
        # TOVA averages over all query heads of the layer; the harness feeds one head at a time, so
        # the caller supplies the layer-wide mean through `pb` (see test_tova_decode_matches_reference).
        scores = {p: float(v) for p, v in pb.items()}
        return R.keep_with_protected(scores, [], self.budget), scores, set()


class StreamingRef:
    def __init__(self, budget, n_sink):
        self.budget, self.n_sink = budget, n_sink

    def init(self, idx, tokens, inp):
        pass

    def __call__(self, t, idx, tokens, pb):
        order = sorted(tokens)
        sinks = [p for p in order if p < self.n_sink]
        scores = {p: float(p) for p in order if p >= self.n_sink}
        return R.keep_with_protected(scores, sinks, self.budget - 1), scores, set(sinks)


class LazyRef:
    def __init__(self, budget, window, alpha):
        self.budget, self.window, self.alpha = budget, window, alpha

    def init(self, idx, tokens, inp):
        for tok in tokens.values():
            tok.update(ts=0, mri=0)

    def __call__(self, t, idx, tokens, pb):
        for p, tok in tokens.items():
            if "ts" not in tok:
                tok.update(ts=t - 1, mri=0)
            if pb[p].max() >= self.alpha:
                tok["mri"] = max(tok["mri"], t - tok["ts"])
                tok["ts"] = t
        order = sorted(tokens)
        if t % self.window or len(tokens) <= self.budget:
            return set(tokens), {p: 0.0 for p in tokens}, set(tokens)
        prot = order[-self.window :]
        # float32 priorities, ties broken by larger TS then smaller position (policies.md §10.3)
        pri = {p: float(np.float32(R.lazy_priority(t, tokens[p]["ts"], tokens[p]["mri"]))) for p in order}
        rest = sorted((p for p in order if p not in prot), key=lambda p: (-pri[p], -tokens[p]["ts"], p))
        keep = set(prot) | set(rest[: self.budget - self.window])
        return keep, {p: pri[p] - 1e-3 * (tokens[p]["ts"] - t) for p in order}, set(prot)


class CakeRef:
    def __init__(self, budget, window, limits):
        self.budget, self.window, self.limits = budget, window, limits

    def init(self, idx, tokens, inp):
        pass

    def __call__(self, t, idx, tokens, pb):
        l, b, _ = idx
        limit = self.limits[(l, b)]
        order = sorted(tokens)
        if len(order) <= limit:
            return set(order), {}, set(order)
        w = self.window
        old = order[:-w]
        mean = np.array([pb[p].mean() for p in old])
        pooled = R.pool(mean, 5, "avg")
        scores = {p: pooled[i] for i, p in enumerate(old)}
        return R.keep_with_protected(scores, order[-w:], limit), scores, set(order[-w:])


def test_h2o_decode_matches_reference():
    simulate(H2O(), 10, 40, H2ORef(10, 5))
    simulate(H2O(recent=2), 9, 30, H2ORef(9, 2))


def test_streaming_decode_matches_reference():
    simulate(StreamingLLM(), 10, 30, StreamingRef(10, 4))


def test_lazy_eviction_decode_matches_reference():
    simulate(LazyEviction(window=5, alpha=0.02), 13, 60, LazyRef(13, 5, 0.02))


def test_cake_decode_matches_reference():
    inp = inputs()
    policy = CAKE(window=4)
    budget = 8
    prefill = reference_prefill(policy, inp, budget)
    limits = {}
    for b, T in enumerate(inp.lengths):
        for l in range(inp.num_layers):
            limits[(l, b)] = len(prefill[(l, b, 0)][0]) if T > budget + 4 else budget
    simulate(policy, budget, 30, CakeRef(budget, 4, limits))


def test_tova_decode_matches_reference():
    inp = inputs()
    policy, budget, steps = TOVA(), 10, 30
    plan, _, (pos, valid, probs, written, keep) = _record(policy, inp, budget, steps)
    prefill = reference_prefill(policy, inp, budget)
    for l in range(inp.num_layers):
        for b, T in enumerate(inp.lengths):
            tokens = set(prefill[(l, b, 0)][0])
            for t in range(1, steps + 1):
                s = t - 1
                tokens.add(T + t - 1)
                mean = {}
                for h in range(HKV):  # all heads share one slot layout; average over every query head
                    for p, v in _probs_by_pos(pos[s][l, b, h], valid[s][l, b, h], probs[s][l, b, h]).items():
                        mean[p] = mean.get(p, 0.0) + float(v.sum()) / (HKV * G)
                ref_keep, scores, prot = TOVARef(budget)(t, None, tokens, mean)
                for h in range(HKV):
                    got = _check_step(t, (l, b, h), tokens, pos[s][l, b, h], valid[s][l, b, h], keep[s][l, b, h],
                                      ref_keep, scores, prot)
                tokens = got


# ----------------------------------------------------------------------------- 2,000 steps


STEPS = 2000


def _expected_counts(start, limit_after, steps, evict_at=None):
    """n after each update when one token arrives per step and eviction brings n down to `limit_after`."""
    out, n = [], start
    for t in range(1, steps + 1):
        n += 1
        if (evict_at is None or evict_at(t)) and n > limit_after:
            n = limit_after
        out.append(n)
    return np.array(out)


@pytest.mark.parametrize(
    "name,policy,budget",
    [
        ("h2o", H2O(), 12),
        ("tova", TOVA(), 12),
        ("streaming_llm", StreamingLLM(), 12),
        ("cake", CAKE(window=4), 8),
        ("lazy_eviction", LazyEviction(window=7, alpha=0.02), 14),
    ],
)
def test_two_thousand_steps_fixed_capacity_and_schedule(name, policy, budget):
    inp = inputs()
    plan = _plan(policy, inp, budget, STEPS)
    n_valid, _, cache, n_written = run_decode(policy, plan, inp.cache, inp.obs, steps=STEPS, group=G)
    n_valid = np.asarray(n_valid)  # [steps, L, B, Hkv]
    assert cache.capacity == plan.capacity  # the buffer never grows
    assert n_valid.max() <= plan.capacity - 1  # the next write always finds a free slot
    np.testing.assert_array_equal(np.asarray(n_written)[1:], n_valid[:-1] + 1)  # ... and adds one entry
    for l in range(inp.num_layers):
        for b, T in enumerate(inp.lengths):
            got = n_valid[:, l, b]
            assert (got == got[:, :1]).all()  # every head follows the same schedule
            got = got[:, 0]
            if name == "lazy_eviction":
                want = _expected_counts(T, budget, STEPS, evict_at=lambda t: t % policy.window == 0)
                evicted = np.flatnonzero(np.diff(np.concatenate([[T], got])) < 0) + 1
                assert (evicted % policy.window == 0).all()  # evictions happen only every W steps
            elif name == "streaming_llm":
                want = _expected_counts(min(T, budget - 1), budget - 1, STEPS)
            elif name == "cake":
                kept = len(reference_prefill(policy, inp, budget)[(l, b, 0)][0])
                limit = budget if T <= budget + policy.window else kept  # C, or what prefill kept
                want = _expected_counts(kept, limit, STEPS)
            else:
                want = _expected_counts(min(T, budget), budget, STEPS)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} layer {l} row {b}")


def test_prefill_only_policies_never_evict_while_decoding():
    inp = inputs()
    policy = get("snapkv", window=4)
    plan = _plan(policy, inp, 8, 20)
    n_valid, _, cache, _ = run_decode(policy, plan, inp.cache, inp.obs, steps=20, group=G)
    n_valid = np.asarray(n_valid)
    start = np.minimum(np.asarray(inp.lengths), 8)
    np.testing.assert_array_equal(n_valid[:, 0, :, 0], start[None, :] + np.arange(1, 21)[:, None])
    assert cache.capacity == plan.capacity == 8 + 21


@pytest.mark.parametrize(
    "policy,budget",
    [(H2O(), 10), (TOVA(), 10), (StreamingLLM(), 10), (CAKE(window=4), 8), (LazyEviction(window=5, alpha=0.02), 12)],
    ids=lambda x: type(x).__name__ if not isinstance(x, int) else str(x),
)
def test_question_tokens_fed_without_updates_fit(policy, budget):
    """Context-then-question mode: tokens appended without decode_update need room beyond the budget."""
    inp, q, steps = inputs(), 6, 40
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=budget, max_new_tokens=q + steps, question_tokens=q)
    n_valid, _, cache, n_written = run_decode(policy, plan, inp.cache, inp.obs, steps=steps, group=G, question=q)
    n_valid, n_written = np.asarray(n_valid), np.asarray(n_written)
    assert n_written.max() <= plan.capacity
    np.testing.assert_array_equal(n_written[1:], n_valid[:-1] + 1)
    kept_after_prefill = np.asarray(run_decode(policy, plan, inp.cache, inp.obs, steps=1, group=G)[3])[0] - 1
    np.testing.assert_array_equal(n_written[0], kept_after_prefill + q + 1)  # every question token was stored
    if not isinstance(policy, LazyEviction):  # evicts at once back to its limit (Lazy: at t % W == 0)
        assert (n_valid[0] <= np.maximum(kept_after_prefill, budget)).all()
        np.testing.assert_array_equal(n_valid[1:], n_valid[:-1])

