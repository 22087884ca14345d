"""Reference kept sets of the prefill-time policies, from the spec (reads only hyperparameters)."""

from __future__ import annotations

import numpy as np

import pol_reference as R
from pol_helpers import HKV, Inputs
from kvjax.policies import (
    CAKE,
    H2O,
    TOVA,
    Ada,
    Cake,
    H2OPrefill,
    KNorm,
    LazyEviction,
    Pyramid,
    Random,
    SnapKV,
    StreamingLLM,
    Uniform,
)

Result = dict  # (l, b, h) -> (kept set, {pos: score}, protected set)


def row_budget(T, budget, ratio, compat="0.5.4"):
    return budget if ratio is None else R.n_kept(T, ratio, compat)


def layer_counts(alloc, T, L, w, budget, ratio):
    """Per-layer kept counts (window included) for the static allocators."""
    C = row_budget(T, budget, ratio)
    if isinstance(alloc, Uniform):
        return [min(C, T)] * L
    if isinstance(alloc, Pyramid):
        if alloc.rule == "paper":
            return R.pyramid_paper(T, C, w, L, alloc.beta)
        return R.pyramid_kvpress(T, ratio if ratio is not None else 1 - budget / T, w, L, alloc.beta)
    raise TypeError(alloc)


def reference_prefill(policy, inp: Inputs, budget=None, ratio=None) -> Result:
    out: Result = {}
    L = inp.num_layers
    for b, T in enumerate(inp.lengths):
        for l in range(L):
            q, k = inp.q[l, b].astype(np.float64), inp.k[l, b].astype(np.float64)
            for h, res in _one(policy, inp, l, b, T, q, k, budget, ratio).items():
                out[(l, b, h)] = res
    return out


def _one(policy, inp, l, b, T, q, k, budget, ratio):
    L = inp.num_layers
    if isinstance(policy, CAKE):
        return _cake(policy, inp, b, T, budget, ratio)[l]
    if isinstance(policy, SnapKV):
        w = policy.window
        s = R.snapkv_scores(q, k, T, w, policy.kernel, policy.pooling, policy.window_reduce, policy.gqa_reduce,
                            policy.gqa_order, HKV)
        return _allocated(policy.allocator, s, T, w, l, inp, b, budget, ratio)
    if isinstance(policy, KNorm):
        s = -np.linalg.norm(k[:, :T], axis=-1)
        if l in policy.skip_layers:
            return {h: _keep({j: s[h, j] for j in range(T)}, [], T) for h in range(HKV)}
        return _allocated(policy.allocator, s, T, 0, l, inp, b, budget, ratio)
    if isinstance(policy, Random):
        s = np.array([[float(R.random_score(policy.seed, l, h, j)) for j in range(T)] for h in range(HKV)])
        return _allocated(policy.allocator, s, T, 0, l, inp, b, budget, ratio)
    if isinstance(policy, H2OPrefill):
        w = policy.window
        m = inp.mass[l, b]
        norm = (lambda j: T - j) if policy.normalize else (lambda j: 1)
        count = min(row_budget(T, budget, ratio), T)
        return {h: _keep({j: m[h, j] / norm(j) for j in range(T - w)}, list(range(T - w, T)), count)
                for h in range(HKV)}
    if isinstance(policy, H2O):
        C = row_budget(T, budget, ratio)
        r = C // 2 if policy.recent is None else policy.recent
        return {h: _keep({j: inp.mass[l, b][h, j] for j in range(T - r)}, list(range(max(T - r, 0), T)), min(C, T))
                for h in range(HKV)}
    if isinstance(policy, TOVA):
        A = R.window_attention(q, k, T, 1)[:, 0, :T].mean(0)
        prot = [T - 1] if policy.protect_last else []
        count = min(row_budget(T, budget, ratio), T)
        sc = {j: A[j] for j in range(T) if j not in prot}
        return {h: _keep(sc, prot, count) for h in range(HKV)}
    if isinstance(policy, StreamingLLM):
        C = row_budget(T, budget, ratio)
        count = min(T, C - 1 if policy.decode else C)
        n = policy.n_sink
        keep = set(range(min(n, T))) | set(range(T - max(count - n, 0), T)) if count >= n else set(range(n - count, n))
        return {h: (keep, {j: float(j) for j in range(T)}, set(range(min(n, T)))) for h in range(HKV)}
    if isinstance(policy, LazyEviction):  # the prompt stays whole until the first eviction
        return {h: (set(range(T)), {}, set()) for h in range(HKV)}
    raise TypeError(policy)


def _allocated(alloc, s, T, w, l, inp, b, budget, ratio):
    """Kept sets of one (layer, row) for non-window scores s [Hkv, T-w] under any allocator."""
    L, window = inp.num_layers, list(range(T - w, T))
    if isinstance(alloc, Ada):
        return _ada(alloc, s, T, w, l, L, budget, ratio, window)
    if isinstance(alloc, Cake):
        raw = cake_raw_budgets(alloc, inp, b, T, budget, ratio, protect=w)
        if raw is None:
            return {h: (set(range(T)), {}, set(window)) for h in range(HKV)}
        count = min(max(R.cake_adjust(raw[0], raw[1], raw[2])[l], 0), raw[2]) + w
    else:
        count = layer_counts(alloc, T, L, w, budget, ratio)[l]
    return {h: _keep({j: s[h, j] for j in range(T - w)}, window, count) for h in range(HKV)}


def _keep(scores, protected, count):
    return R.keep_with_protected(scores, protected, count), scores, set(protected)


def _ada(alloc, s, T, w, l, L, budget, ratio, window):
    if alloc.rule == "kvpress":
        n = min(row_budget(T, budget, ratio), T)
        full = np.zeros((HKV, T))
        full[:, : T - w] = s
        counts = R.ada_kvpress(full, set(window), n, alloc.alpha)
        return {h: _keep({j: s[h, j] for j in range(T - w)}, window, counts[h]) for h in range(HKV)}
    C = row_budget(T, budget, ratio)
    bp = R.ada_pyram_base(T, C, w, L, alloc.pyramid_beta)[l] if alloc.pyramid_beta else C - w
    if C - w > T - w or bp > T - w:  # §1.1 table, then Ada-KV's per-layer test
        return {h: (set(range(T)), {j: s[h, j] for j in range(T - w)}, set(window)) for h in range(HKV)}
    sc = s
    if alloc.normalize:
        srt = -np.sort(-s, axis=1)
        sc = s * (srt[:, :bp].sum(1) / srt.sum(1))[:, None]
    caps = R.ada_paper(sc, T, w, bp, alloc.alpha, skip_layer=l < alloc.skip)
    return {h: _keep({j: sc[h, j] for j in range(T - w)}, window, caps[h] + w) for h in range(HKV)}


def cake_raw_budgets(policy, inp, b, T, budget, ratio, protect=None):
    """(raw float budgets P_l/sum P * Btot, Btot, clip, indicators) for one row, or None if no eviction.

    Statistics use the last `policy.window` queries; `protect` (default: the same window) is the
    protected count inside the budget."""
    w, L = policy.window, inp.num_layers
    p = w if protect is None else protect
    C = row_budget(T, budget, ratio)
    if T <= C + p:
        return None
    gamma = getattr(policy, "gamma", 0.0)
    stats = [R.cake_layer_stats(inp.q[l, b].astype(np.float64), inp.k[l, b].astype(np.float64), T, w, gamma, HKV)
             for l in range(L)]
    P = np.array([H ** (1 / policy.tau1) * V ** (1 / policy.tau2) for H, V, _ in stats])
    total = (C - p) * L
    clip = T - p if policy.parity else min(T - p, policy.cap_factor * (C - p))
    return P / P.sum() * total, total, clip, [ind for _, _, ind in stats]


def _cake(policy, inp, b, T, budget, ratio):
    w, L = policy.window, inp.num_layers
    window = list(range(T - w, T))
    raw = cake_raw_budgets(policy, inp, b, T, budget, ratio)
    if raw is None:
        return [{h: (set(range(T)), {}, set(window)) for h in range(HKV)} for _ in range(L)]
    budgets, total, clip, inds = raw
    bl = R.cake_adjust(budgets, total, clip)
    return [{h: _keep({j: inds[l][h, j] for j in range(T - w)}, window, min(max(bl[l], 0), clip) + w)
             for h in range(HKV)} for l in range(L)]
