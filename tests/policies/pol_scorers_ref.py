"""NumPy references (float64, loops) for ExpectedAttention, CriticalKV, DefensiveKV and CAKE's
cascading mode, written from the papers / authors' code (kvpress ExpectedAttentionPress and
CriticalKVPress, FFY0/DefensiveKV efficient_defensivekv_press.py, antgroup/cakekv cake_cache.py).

Results use pol_prefill_ref's layout: {(l, b, h): (kept set, {pos: score}, protected set)}.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pol_reference as R
from pol_helpers import HKV, INV_FREQ, D, G, Inputs, assert_same_kept, kept_positions, output_norms_np
from pol_prefill_ref import cake_raw_budgets, reference_prefill, row_budget

from kvjax.policies import Ada


@functools.partial(jax.jit, static_argnums=(0, 1))
def _keep(policy, plan, cache, obs):
    return policy.prefill_keep(plan, cache, obs)[0]


def check_kept(policy, inp: Inputs, want: dict, budget=None, ratio=None, tol=1e-5):
    """The policy's kept sets equal `want` (boundary ties excepted); exact counts; returns (plan, keep)."""
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=budget, compression_ratio=ratio, max_new_tokens=4)
    keep = np.asarray(_keep(policy, plan, inp.cache, inp.obs))
    got = kept_positions(keep, inp.cache.pos)
    assert set(got) == set(want)
    for idx, (ref_kept, scores, prot) in want.items():
        assert_same_kept(got[idx], ref_kept, scores, prot, tol=tol, where=f"{type(policy).__name__} (l,b,h)={idx}")
    assert keep.sum(-1).max() <= plan.capacity - plan.max_new_tokens
    return plan, keep


def _topk_keyed(cands, key, n):
    return set(sorted(cands, key=key)[: max(n, 0)])


# ----------------------------------------------------------------------------- ExpectedAttention


def rope_matrix(p: int) -> np.ndarray:
    """The HF rotate-half RoPE matrix at position p: x -> x cos + rotate_half(x) sin."""
    half = D // 2
    m = np.zeros((D, D))
    for i in range(half):
        a = p * INV_FREQ[i]
        m[i, i] = m[i + half, i + half] = math.cos(a)
        m[i, i + half] = -math.sin(a)  # rotate_half: first half gets -x2
        m[i + half, i] = math.sin(a)
    return m


def expected_scores(policy, inp: Inputs, l: int, b: int, T: int) -> np.ndarray:
    """[Hkv, T] ExpectedAttention scores (sinks included as 0)."""
    n0 = policy.n_sink
    q = inp.q[l, b, :, n0:T].astype(np.float64)  # pre-RoPE queries after the sinks [Hq, n, D]
    mu = q.mean(1)
    cov = np.stack([(x - m).T @ (x - m) / q.shape[1] for x, m in zip(q, mu)])
    rbar = np.mean([rope_matrix(p) for p in range(T, T + policy.n_future_positions)], axis=0)
    out = np.zeros((HKV, T))
    for h in range(HKV):
        k = inp.k[l, b, h, n0:T].astype(np.float64)
        acc = np.zeros(T - n0)
        for g in range(G):
            hq = h * G + g
            z = k @ (rbar @ mu[hq]) / math.sqrt(D)
            if policy.use_covariance:
                c = rbar @ cov[hq] @ rbar.T
                z = z + np.einsum("jd,de,je->j", k, c, k) / D / 2
            e = np.exp(z - z.max())
            acc += e / e.sum() / G
        if policy.use_vnorm:
            acc = (acc + policy.epsilon) * np.linalg.norm(inp.v[l, b, h, n0:T].astype(np.float64), axis=-1)
        out[h, n0:] = acc
    return out


def expected_reference(policy, inp: Inputs, budget=None, ratio=None):
    out = {}
    n0 = policy.n_sink
    for b, T in enumerate(inp.lengths):
        C = row_budget(T, budget, ratio, policy.kvpress_compat)
        for l in range(inp.num_layers):
            s = expected_scores(policy, inp, l, b, T)
            prot = list(range(min(n0, T)))
            alloc = policy.budget_allocator()
            if not isinstance(alloc, Ada):
                counts = [min(C, T)] * HKV
            elif alloc.rule == "kvpress":
                counts = R.ada_kvpress(s, set(prot), min(C, T), alloc.alpha, policy.kvpress_compat)
            elif C > T:
                counts = [T] * HKV
            else:  # Ada-KV paper rule over the non-sink candidates (indices shifted by n0)
                caps = R.ada_paper(s[:, n0:], T, n0, C - n0, alloc.alpha)
                counts = [c + n0 for c in caps]
            for h in range(HKV):
                sc = {j: s[h, j] for j in range(n0, T)}
                out[(l, b, h)] = (R.keep_with_protected(sc, prot, counts[h]), sc, set(prot))
    return out


# ----------------------------------------------------------------------------- CriticalKV


def critical_reference(policy, inp: Inputs, budget=None, ratio=None):
    """Stage 1: protected + top int(n * first_stage_ratio) by the base score; stage 2: the rest of the
    n by (s + eps) * ||v W_o||_1 (group mean). n per head comes from the scorer's own reference."""
    base = reference_prefill(policy.scorer, inp, budget, ratio)
    norms = output_norms_np(inp.v, inp.wo, inp.lengths)
    out = {}
    for (l, b, h), (kept, scores, prot) in base.items():
        n = len(kept)
        if not scores:  # the scorer left the row whole
            out[(l, b, h)] = (kept, {}, prot)
            continue
        n1 = int(n * policy.first_stage_ratio)
        stage1 = R.keep_with_protected(scores, sorted(prot), n1)
        forced = stage1 | prot
        weighted = {j: (s + policy.epsilon) * norms[l, b, h, j] for j, s in scores.items()}
        if n <= len(forced):
            want = R.keep_with_protected(scores, sorted(forced), n)
        else:
            rest = {j: s for j, s in weighted.items() if j not in forced}
            want = forced | R.topk(rest, n - len(forced))
        out[(l, b, h)] = (want, weighted, forced)
    return out


# ----------------------------------------------------------------------------- DefensiveKV


def defensive_layer(policy, inp: Inputs, l: int, b: int, T: int, n_kept: int):
    """(s [Hkv, T-w], forced sets per head) of one (layer, row), from the authors' score()."""
    w, k = policy.window, policy.kernel
    A = R.window_attention(inp.q[l, b].astype(np.float64), inp.k[l, b].astype(np.float64), T, w)[:, :, : T - w]
    Ag = A.reshape(HKV, G, w, T - w)
    ave = Ag.mean(1).mean(1)  # [Hkv, T-w]
    base = A.sum(-1, keepdims=True)
    pooled = R.pool(A, k, "avg")
    pooled = pooled / pooled.sum(-1, keepdims=True) * base
    mx = pooled.reshape(HKV, G, w, T - w).max(1).max(1)
    s = np.maximum(mx, mx.mean(-1, keepdims=True))
    bias = A[..., -w:].sum(-1).mean()  # the code slices the last w *non-window* keys
    norms = output_norms_np(inp.v, inp.wo, inp.lengths)[l, b, :, : T - w]
    s = s * norms / norms.sum(0, keepdims=True)
    thr = 0.9 - bias
    forced = []
    for h in range(HKV):
        order = sorted(range(T - w), key=lambda j: (-ave[h, j], j))
        csum = np.cumsum(ave[h, order] / ave[h].sum())
        hit = np.nonzero(csum >= thr)[0]
        count = int(hit[0]) if len(hit) else 0
        count = max(0, min(count, n_kept - w))
        forced.append(set(order[:count]) | set(range(T - w, T)))
    return s, forced


def defensive_reference(policy, inp: Inputs, budget=None, ratio=None):
    out = {}
    w, L = policy.window, inp.num_layers
    for b, T in enumerate(inp.lengths):
        C = row_budget(T, budget, ratio, policy.kvpress_compat)
        n_kept = min(C, T)
        window = set(range(T - w, T))
        if n_kept >= T:
            for l in range(L):
                for h in range(HKV):
                    out[(l, b, h)] = (set(range(T)), {}, window)
            continue
        scale = HKV * (L if policy.layer_wise else 1)
        total = int(T * (1 - ratio) * scale) if ratio is not None else scale * C
        layers = [defensive_layer(policy, inp, l, b, T, n_kept) for l in range(L)]
        if n_kept <= w:
            for l, (s, forced) in enumerate(layers):
                for h in range(HKV):
                    out[(l, b, h)] = (set(range(T - n_kept, T)), {}, window)
            continue
        groups = [list(range(L))] if policy.layer_wise else [[l] for l in range(L)]
        for ls in groups:
            cands = [(l, h, j) for l in ls for h in range(HKV) for j in range(T - w) if j not in layers[l][1][h]]
            left = total - sum(len(layers[l][1][h]) for l in ls for h in range(HKV))
            chosen = _topk_keyed(cands, lambda c, ls_=layers: (-ls_[c[0]][0][c[1], c[2]], c[2], c[0], c[1]), left)
            for l in ls:
                s, forced = layers[l]
                for h in range(HKV):
                    kept = forced[h] | {j for (ll, hh, j) in chosen if ll == l and hh == h}
                    out[(l, b, h)] = (kept, {j: s[h, j] for j in range(T - w)}, forced[h])
    return out


# ----------------------------------------------------------------------------- CAKE cascading


def cake_cascade_reference(policy, inp: Inputs, budget=None, ratio=None):
    """cakekv's cascading prefill: after layer l, budgets of layers 0..l from P_m / sum_{k<=l} P_k of the
    whole total, fixed up over those layers, clipped; each seen layer is re-evicted (nested top-k)."""
    out = {}
    w, L = policy.window, inp.num_layers
    for b, T in enumerate(inp.lengths):
        window = list(range(T - w, T))
        raw = cake_raw_budgets(policy, inp, b, T, budget, ratio)
        if raw is None:
            for l in range(L):
                for h in range(HKV):
                    out[(l, b, h)] = (set(range(T)), {}, set(window))
            continue
        budgets, total, clip, inds = raw
        P = np.asarray(budgets) / total  # the one-shot shares P_l / sum P
        final = [None] * L
        for step in range(L):
            share = P[: step + 1] / P[: step + 1].sum()
            bl = R.cake_adjust(share * total, total, clip)
            for m in range(step + 1):
                bm = min(max(bl[m], 0), clip)
                final[m] = bm if final[m] is None else min(final[m], bm)
        for l in range(L):
            for h in range(HKV):
                sc = {j: inds[l][h, j] for j in range(T - w)}
                out[(l, b, h)] = (R.keep_with_protected(sc, window, final[l] + w), sc, set(window))
    return out
