"""Issue 27: LookaheadKV's scores with Ada-KV's head budgets (`ada_lookahead_kv`), Layer-DefensiveKV's
global budget (`layer_lookahead_kv`), CAKE's layer budgets with the preference measured on the lookahead
tokens (`cake_lookahead_kv`) and CriticalKV's value-aware reweighting (`critical_lookahead_kv`; over Ada-KV's head
budgets, `critical_ada_lookahead_kv`).

On a tiny random GQA Llama (8 query heads over 2 KV heads, 2 layers) with a random adapter, the engine's
scores and kept positions equal a NumPy reference written from the definitions (policies.md §7, §8,
§11.3; kvjax/policies/critical.py, allocators.Global): the lookahead attention comes from a plain float64
forward of [prompt; lookahead tokens] with the LoRA on the tokens' rows (tests/lookahead/lkv_reference.py),
and the allocation / reweighting is redone below in NumPy. Kept sets are compared exactly (ties ordered
by position, then layer and head, as `select` and `rank` do; a near tie at a boundary fails loudly).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lookahead import lkv_reference as ref
from tiny_models import build_hf

import kvjax
import kvjax.lookahead as lk
from kvjax.engine import steps
from kvjax.observations import ObservationSpec
from kvjax.passes.lookahead import LookaheadTokens
from kvjax.policies import Cake, LookaheadKV, SnapKV, get
from kvjax.policies.registry import available, lookahead_presets, name_of
from kvjax.sampling import Sampler
import pol_reference as R
from pol_helpers import make_inputs

PRESETS = ("ada_lookahead_kv", "layer_lookahead_kv", "cake_lookahead_kv", "critical_lookahead_kv",
           "critical_ada_lookahead_kv", "critical_lookahead_kv_l2", "critical_ada_lookahead_kv_l2",
           "critical_lookahead_kv_rms")
LENGTHS = (40, 25, 33)
WIDTH = 64  # the engine's bucket for these prompts
ALPHA = 0.2  # Ada-KV's safeguard (ada_snapkv's)
EPS, FIRST = 1e-4, 0.5  # CriticalKV's epsilon and first-stage ratio (kvpress defaults)
MARGIN = 1e-5  # scores closer than this at a selection boundary would make the exact comparison fragile
RMS_BUDGET = 19  # a budget at which the group's RMS keeps other entries than its mean (see below)
NEAR_TIE_BUDGETS = {("critical_ada_lookahead_kv", 30): 28, ("critical_ada_lookahead_kv_l2", 30): 28,
                    ("critical_lookahead_kv_l2", 10): 11}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lkv27_llama3")
    build_hf("llama3", folder)
    return kvjax.load_model(folder)


@pytest.fixture(scope="module")
def adapter(tiny):
    """n = 4 tokens, rank 2, every LoRA B random (so the LoRA really changes the tokens' rows)."""
    a = lk.init_adapter(tiny, lk.LookaheadConfig(n_tokens=4, rank=2), jax.random.PRNGKey(1))
    key, lora = jax.random.PRNGKey(3), {}
    for p, f in a.params["lora"].items():
        key, k = jax.random.split(key)
        lora[p] = {"a": f["a"], "b": 0.3 * jax.random.normal(k, f["b"].shape)}
    return a.replace(params={"embeddings": a.params["embeddings"], "lora": lora})


@pytest.fixture(scope="module")
def ids(tiny):
    rng = np.random.RandomState(27)
    return [[1] + rng.randint(3, tiny.config.vocab_size, n - 1).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def numpy_rows(tiny, adapter, ids):
    """Per row, from the float64 forward: s̃-based scores [L,Hkv,T], the tokens' attention on the prompt
    [L,Hq,n,T] and the CriticalKV norms ||v_j W_o^g||_1 and ||v_j W_o^g||_2 (group means) [L,Hkv,T]."""
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(adapter.params)
    cfg, conf = tiny.config, adapter.config
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = Hq // Hkv
    out = []
    for prompt in ids:
        T, n = len(prompt), conf.n_tokens
        embeds = np.concatenate([P["embed"][np.asarray(prompt)], A["embeddings"]], 0)
        _, probs, _, v = ref.forward(P, cfg, embeds, np.arange(T + n) >= T, A["lora"], conf.alpha / conf.rank)
        la = probs[:, :, T:, :T]  # [L,Hq,n,T]: the softmax also covered the tokens' own causal keys
        scores = ref.scores(la.mean(2), cfg, conf, T)
        norms, norms_l2, sq = (np.zeros((cfg.num_layers, Hkv, T)) for _ in range(3))
        for l in range(cfg.num_layers):
            wo = P["layers"]["o"][l]  # [Hq*D, E]
            for h in range(Hq):
                projected = v[l, h // G, :T] @ wo[h * D:(h + 1) * D]
                norms[l, h // G] += np.abs(projected).sum(-1) / G
                norms_l2[l, h // G] += np.linalg.norm(projected, axis=-1) / G
                sq[l, h // G] += (projected ** 2).sum(-1) / G
        out.append({"T": T, "la": la, "scores": scores, "norms": norms, "norms_l2": norms_l2,
                    "norms_rms": np.sqrt(sq)})
    return out


# ----------------------------------------------------------------------------- NumPy reference


def row_budget(T, budget, ratio):
    return budget if ratio is None else int(T * (1 - ratio))


def ordered(cands, score):
    """Candidates (tuples ending in the position j, led by layer and head where they have them) by score
    descending, then position, then layer / head: `rank`'s order. Fails on a near tie (within MARGIN)
    between two different scores that the kept count would cut between (checked by the caller)."""
    return sorted(cands, key=lambda c: (-score(c), c[-1], *c[:-1]))


def cut(cands, score, n):
    """The first n of `ordered` candidates, asserting a clear margin at the cut."""
    order = ordered(cands, score)
    if 0 < n < len(order):
        a, b = score(order[n - 1]), score(order[n])
        assert a == b or a - b > MARGIN, f"near tie at the boundary ({a} vs {b}): pick another seed"
    return order[: max(n, 0)]


def ref_ada(row, C):
    """Ada-KV, rule "paper", w = 0 (policies.md §7): whole when C > T; else per layer the global top Hkv*C
    over heads gives count_h, cap_h = round(count_h (1 - alpha) + int(C alpha)), each head its top cap_h."""
    s, T = row["scores"], row["T"]
    L, H, _ = s.shape
    if C > T:
        return {(l, h): set(range(T)) for l in range(L) for h in range(H)}, None
    out, caps = {}, np.zeros((L, H), int)
    for l in range(L):
        chosen = cut([(h, j) for h in range(H) for j in range(T)], lambda c: s[l, c[0], c[1]], H * C)
        for h in range(H):
            count = sum(1 for c in chosen if c[0] == h)
            caps[l, h] = int(round(count * (1 - ALPHA) + int(C * ALPHA)))
            out[(l, h)] = {j for (j,) in cut([(j,) for j in range(T)], lambda c: s[l, h, c[0]], caps[l, h])}
    return out, caps


def ref_layer(row, C, ratio):
    """Global(across_layers=True), w = 0: whole when C >= T; else the row keeps Hkv*L*C entries
    (int(T (1 - r) Hkv L) for a ratio), the best scores over every (layer, head, position)."""
    s, T = row["scores"], row["T"]
    L, H, _ = s.shape
    if C >= T:
        return {(l, h): set(range(T)) for l in range(L) for h in range(H)}
    total = H * L * C if ratio is None else int(T * (1 - ratio) * H * L)
    chosen = cut([(l, h, j) for l in range(L) for h in range(H) for j in range(T)], lambda c: s[c], total)
    return {(l, h): {j for (ll, hh, j) in chosen if (ll, hh) == (l, h)} for l in range(L) for h in range(H)}


def ref_cake_preference(row):
    """CAKE's (H_l, V_l) of the lookahead tokens' attention: the entropy summed over heads, tokens and
    prompt slots, and the summed unbiased variance over the n tokens (policies.md §8, with the lookahead
    tokens in place of the window queries)."""
    la = row["la"]
    H = -(la * np.log(la + 1e-10)).sum((1, 2, 3))
    V = la.var(axis=2, ddof=1).sum((1, 2))
    return H, V


def ref_cake(row, C):
    """Cake allocator, tau1 = tau2 = 1, w = 0, parity off: whole when T <= C; else b_l = P_l / sum P * C L,
    cakekv's adjust_budgets at the bound min(T, 2 C); every head of layer l keeps its top b_l."""
    s, T = row["scores"], row["T"]
    L, H, _ = s.shape
    if T <= C:
        return {(l, h): set(range(T)) for l in range(L) for h in range(H)}, None
    ent, var = ref_cake_preference(row)
    pref = ent * var
    total, bound = C * L, min(T, 2 * C)
    b = R.cake_adjust(pref / pref.sum() * total, total, bound)
    out = {(l, h): {j for (j,) in cut([(j,) for j in range(T)], lambda c: s[l, h, c[0]], min(b[l], bound))}
           for l in range(L) for h in range(H)}
    return out, b


def ref_critical(row, C, caps=None, norm="norms"):
    """CriticalKV over LookaheadKV (n = min(C, T) per head, or caps[l, h]: Ada-KV's head budgets, CriticalAdaKV):
    the top int(n * 0.5) by s, then the rest of n by (s + 1e-4) * norm among the others (row[norm]: the L1
    norms, or "norms_l2")."""
    s, norms, T = row["scores"], row[norm], row["T"]
    L, H, _ = s.shape
    out = {}
    for l in range(L):
        for h in range(H):
            n = min(C, T) if caps is None else int(caps[l, h])
            if n >= T:
                out[(l, h)] = set(range(T))
                continue
            first = {j for (j,) in cut([(j,) for j in range(T)], lambda c: s[l, h, c[0]], int(n * FIRST))}
            rest = [(j,) for j in range(T) if j not in first]
            w = lambda c, l=l, h=h: (s[l, h, c[0]] + EPS) * norms[l, h, c[0]]  # noqa: E731
            out[(l, h)] = first | {j for (j,) in cut(rest, w, n - len(first))}
    return out


def ref_critical_ada(row, C, norm="norms"):
    """CriticalAdaKV over LookaheadKV: Ada-KV's caps (`ref_ada`; whole when C > T), then CriticalKV's two
    stages within each head's cap."""
    caps = ref_ada(row, C)[1]
    if caps is None:
        return {(l, h): set(range(row["T"])) for l in range(row["scores"].shape[0])
                for h in range(row["scores"].shape[1])}
    return ref_critical(row, C, caps, norm)


def reference(name, rows, budget, ratio):
    """{(layer, row, head): kept positions} of preset `name`."""
    out = {}
    for b, row in enumerate(rows):
        C = row_budget(row["T"], budget, ratio)
        kept = {"ada_lookahead_kv": lambda: ref_ada(row, C)[0], "layer_lookahead_kv": lambda: ref_layer(row, C, ratio),
                "cake_lookahead_kv": lambda: ref_cake(row, C)[0],
                "critical_lookahead_kv": lambda: ref_critical(row, C),
                "critical_ada_lookahead_kv": lambda: ref_critical_ada(row, C),
                "critical_lookahead_kv_l2": lambda: ref_critical(row, C, norm="norms_l2"),
                "critical_ada_lookahead_kv_l2": lambda: ref_critical_ada(row, C, "norms_l2"),
                "critical_lookahead_kv_rms": lambda: ref_critical(row, C, norm="norms_rms")}[name]()
        out.update({(l, b, h): v for (l, h), v in kept.items()})
    return out


# ----------------------------------------------------------------------------- the engine's side


def engine_kept(model, ids, policy, budget, ratio):
    """{(layer, row, head): kept positions} after kvjax.engine.compress (prefill, lookahead pass, eviction)."""
    cache = kvjax.engine.compress(model, ids, policy=policy, budget=budget, compression_ratio=ratio)
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    return {(l, b, h): {int(p) for p in pos[l, b, h][valid[l, b, h]]}
            for l in range(pos.shape[0]) for b in range(pos.shape[1]) for h in range(pos.shape[2])}


def engine_scores(model, ids, policy, budget):
    """The engine's prefill and lookahead pass, then the policy's `Scored` and its restricted observations."""
    toks = np.zeros((len(ids), WIDTH), np.int32)
    pos = -np.ones((len(ids), WIDTH), np.int32)
    for b, r in enumerate(ids):
        toks[b, : len(r)], pos[b, : len(r)] = r, np.arange(len(r))
    toks, pos = jnp.asarray(toks), jnp.asarray(pos)
    spec = steps.prefill_spec([policy])
    _, cache, obs, _ = steps.prefill(model.params, toks, pos, jax.random.PRNGKey(0), cfg=model.config,
                                     capacity=WIDTH, observe=spec, rope_mode="original", sampler=Sampler(), mesh=None)
    for o in policy.requirements().observe.producers:
        obs = obs.replace(**steps.produce(model.params, cache, toks, pos, policy.observation_inputs(),
                                          cfg=model.config, observation=o, rope_mode="original"))
    obs = obs.restrict(policy.requirements().observe)
    plan = policy.plan(tuple(map(len, ids)), model.config.num_layers, model.config.num_kv_heads, budget=budget)
    return policy.score(plan, cache, obs), obs


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", PRESETS)
def test_scores_and_observations_equal_the_numpy_reference(tiny, adapter, ids, numpy_rows, name):
    policy = get(name, adapter=adapter)
    scored, obs = engine_scores(tiny, ids, policy, budget=10)
    got = np.asarray(scored.scores)
    for b, row in enumerate(numpy_rows):
        T = row["T"]
        np.testing.assert_allclose(got[:, b, :, :T], row["scores"], rtol=1e-4, atol=2e-6)
        assert (got[:, b, :, T:] == 0).all()
    if name == "cake_lookahead_kv":  # the layer preference is the lookahead tokens' (log H_l + log V_l)
        want = np.stack([np.log(np.multiply(*ref_cake_preference(row))) for row in numpy_rows], 1)
        np.testing.assert_allclose(np.asarray(scored.layer_log_pref), want, rtol=1e-4, atol=1e-4)
        assert obs.window_queries is None  # measured on the lookahead tokens, not on the prompt's window
    else:
        assert scored.layer_log_pref is None and obs.query_sumsq is None
    if name.startswith("critical_"):  # the reweighting's input: ||v_j W_o||_1 (or _2) group mean, or _2's RMS
        field = {"l2": "output_norms_l2", "rms": "output_norms_rms"}.get(name.rsplit("_", 1)[1], "output_norms")
        norms = np.asarray(getattr(obs, field))
        others = {"output_norms", "output_norms_l2", "output_norms_rms"} - {field}
        assert all(getattr(obs, f) is None for f in others)  # only the norm it reads is recorded
        for b, row in enumerate(numpy_rows):
            np.testing.assert_allclose(norms[:, b, :, : row["T"]], row["norms" + field[len("output_norms"):]],
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("budget,ratio", [(10, None), (30, None), (None, 0.5)], ids=["C10", "C30", "r0.5"])
@pytest.mark.parametrize("name", PRESETS)
def test_kept_positions_equal_the_numpy_reference(tiny, adapter, ids, numpy_rows, name, budget, ratio):
    # where two reweighted scores of this random model sit within MARGIN at a head's cut, a budget near it
    budget = NEAR_TIE_BUDGETS.get((name, budget), budget)
    got = engine_kept(tiny, ids, get(name, adapter=adapter), budget, ratio)
    want = reference(name, numpy_rows, budget, ratio)
    assert got.keys() == want.keys()
    for key in sorted(want):
        assert got[key] == want[key], f"{name} (layer, row, head) = {key}: got-only {sorted(got[key] - want[key])}, " \
                                      f"reference-only {sorted(want[key] - got[key])}"


def test_rms_group_norm_keeps_the_reference_where_it_differs_from_the_mean(tiny, adapter, ids, numpy_rows):
    """critical_lookahead_kv_rms at a budget where the RMS and the mean of the group's L2 norms keep different
    entries: the engine keeps the RMS reference's, not the mean's."""
    got = engine_kept(tiny, ids, get("critical_lookahead_kv_rms", adapter=adapter), RMS_BUDGET, None)
    assert got == reference("critical_lookahead_kv_rms", numpy_rows, RMS_BUDGET, None)
    assert got != reference("critical_lookahead_kv_l2", numpy_rows, RMS_BUDGET, None)


def test_each_composition_changes_what_lookahead_kv_keeps(tiny, adapter, ids, numpy_rows):
    """The reference's allocations really differ from lookahead_kv's uniform top C (so the exact comparisons
    above pin the composition, not LookaheadKV alone): Ada's heads, the global budget's layers, CAKE's
    layers get other counts, and CriticalKV's reweighting swaps some entries at equal counts."""
    C, L, H = 10, tiny.config.num_layers, tiny.config.num_kv_heads
    compressed = [row for row in numpy_rows if row["T"] > C]
    caps = [ref_ada(row, C)[1] for row in compressed]
    assert any((c != C).any() for c in caps) and all((c.sum(1) - H * C <= H).all() for c in caps)
    layer = [ref_layer(row, C, None) for row in compressed]
    per_layer = [[sum(len(k[(l, h)]) for h in range(H)) for l in range(L)] for k in layer]
    assert all(sum(p) == H * L * C for p in per_layer) and any(p[0] != H * C for p in per_layer)
    budgets = [ref_cake(row, C)[1] for row in compressed]
    assert all(sum(b) == L * C for b in budgets) and any(b[0] != C for b in budgets)
    plain = lambda row: {(l, h): {j for (j,) in cut([(j,) for j in range(row["T"])],  # noqa: E731
                                                   lambda c: row["scores"][l, h, c[0]], C)}
                         for l in range(L) for h in range(H)}
    assert any(ref_critical(row, C) != plain(row) for row in compressed)
    # CriticalAdaKV: Ada's counts (not C) per head, and the reweighting swaps entries within them
    crit_ada = [ref_critical_ada(row, C) for row in compressed]
    assert all(len(k[(l, h)]) == c[l, h] for k, c in zip(crit_ada, caps) for l in range(L) for h in range(H))
    assert any(k != ref_ada(row, C)[0] for k, row in zip(crit_ada, compressed))
    # the L2 norm ranks otherwise than the L1 norm somewhere (so the _l2 presets' comparisons pin the norm)
    assert any(ref_critical(row, C, norm="norms_l2") != ref_critical(row, C) for row in compressed) or \
        any(ref_critical(row, 5, norm="norms_l2") != ref_critical(row, 5) for row in compressed)
    # and the group's RMS otherwise than its mean (the _rms preset's comparison pins the group norm)
    assert any(ref_critical(row, RMS_BUDGET, norm="norms_rms") != ref_critical(row, RMS_BUDGET, norm="norms_l2")
               for row in numpy_rows)


def test_cake_preference_is_the_lookahead_tokens_not_the_window(tiny, adapter, ids):
    """cake_lookahead_kv records no window and asks the lookahead pass for the moments; the other reading,
    LookaheadKV(allocator=Cake()) (preference from the prompt's last 32 queries), keeps other layer budgets."""
    ours = get("cake_lookahead_kv", adapter=adapter)
    spec = ours.requirements().observe
    assert spec.window == 0 and spec.get(LookaheadTokens).moments
    assert not get("lookahead_kv", adapter=adapter).requirements().observe.get(LookaheadTokens).moments
    windowed = LookaheadKV(adapter=adapter, allocator=Cake())
    assert windowed.requirements().observe.window == 32
    a, b = (engine_kept(tiny, ids, p, 10, None) for p in (ours, windowed))
    counts = lambda k: sorted((key, len(v)) for key, v in k.items())  # noqa: E731
    assert counts(a) != counts(b)


def test_one_lookahead_pass_serves_both_readings():
    conf, info = lk.LookaheadConfig(n_tokens=4), lk.ModelInfo(64, 2, 8, 2, 8, 101, 96)
    merged = ObservationSpec(LookaheadTokens(conf, info)).merge(ObservationSpec(LookaheadTokens(conf, info, True)))
    assert merged.get(LookaheadTokens) == LookaheadTokens(conf, info, moments=True)
    with pytest.raises(ValueError, match="one prefill records one LookaheadTokens"):
        ObservationSpec(LookaheadTokens(conf, info)).merge(
            ObservationSpec(LookaheadTokens(dataclasses.replace(conf, n_tokens=8), info)))


def test_cake_scorer_preference_needs_a_scorer_that_supplies_it():
    alloc = Cake(preference="scorer")
    assert alloc.requirements().observe.window == 0 and Cake().requirements().observe.window == 32
    with pytest.raises(ValueError, match="preference"):
        Cake(preference="lookahead")
    inp = make_inputs(5, num_layers=2)
    pol = SnapKV(window=4, allocator=alloc)  # SnapKV hands over no layer preference
    plan = pol.plan(inp.lengths, 2, 2, budget=10)
    with pytest.raises(ValueError, match=r"preference='scorer'.*layer_log_pref"):
        pol.prefill_keep(plan, inp.cache, inp.obs)


def test_presets_registered_with_the_adapter_rule(adapter, monkeypatch, tmp_path):
    assert set(PRESETS) <= set(available())
    assert lookahead_presets() == sorted([*PRESETS, "lookahead_kv"])
    for name in PRESETS:
        p = get(name, adapter=adapter)
        assert name_of(p) == name and p.query_aware and not p.supports_chunked_prefill and not p.decode_time
        assert p.observation_inputs() is adapter.params  # the engine's lookahead pass runs this adapter
        assert type(get(name)).__doc__.strip()  # a docstring says what it combines
    assert get("ada_lookahead_kv").allocator == get("ada_snapkv").allocator  # Ada-KV's, alpha 0.2
    assert get("layer_lookahead_kv").allocator == get("layer_defensivekv").budget_allocator()
    assert get("cake_lookahead_kv").allocator == Cake(preference="scorer")
    crit = get("critical_lookahead_kv")
    snap = get("critical_snapkv")
    assert (crit.epsilon, crit.first_stage_ratio) == (snap.epsilon, snap.first_stage_ratio) == (EPS, FIRST)
    assert crit.scorer == LookaheadKV()
    crit_ada = get("critical_ada_lookahead_kv")
    assert (crit_ada.epsilon, crit_ada.first_stage_ratio) == (EPS, FIRST)
    assert crit_ada.scorer == get("ada_lookahead_kv") and crit_ada.budget_allocator() == get("ada_snapkv").allocator
    assert (crit.value_norm, crit_ada.value_norm) == (1, 1)
    assert get("critical_lookahead_kv_l2") == dataclasses.replace(crit, value_norm=2)
    assert get("critical_ada_lookahead_kv_l2") == dataclasses.replace(crit_ada, value_norm=2)
    assert get("critical_lookahead_kv_rms") == dataclasses.replace(crit, value_norm=2, group_norm="rms")
    # building them loads no adapter: without a bundled one they still construct, and fail when run
    monkeypatch.setattr(lk.adapter, "BUNDLED", tmp_path / "absent")
    kvjax.policies.lookahead._load.cache_clear()
    try:
        for name in PRESETS:
            p = get(name)
            with pytest.raises(FileNotFoundError, match="no bundled LookaheadKV adapter"):
                p.requirements()
    finally:
        kvjax.policies.lookahead._load.cache_clear()


def test_eval_all_includes_them_only_with_an_adapter(monkeypatch):
    from kvjax.eval import cli

    parser = cli.build_parser()
    valid = sorted(["snapkv", "h2o", *lookahead_presets()])
    monkeypatch.setattr(cli, "_lookahead_adapter", lambda cfg, required=False: None)
    every = cli.resolve(parser.parse_args(["--policies", "all"]), parser, valid)["policies"]
    assert every == ["h2o", "snapkv"]
    named = cli.resolve(parser.parse_args(["--policies", "cake_lookahead_kv"]), parser, valid)["policies"]
    assert named == ["cake_lookahead_kv"]  # named explicitly: kept (the run then asks for the adapter)
    monkeypatch.setattr(cli, "_lookahead_adapter", lambda cfg, required=False: object())
    assert cli.resolve(parser.parse_args(["--policies", "all"]), parser, valid)["policies"] == valid
    default = cli.resolve(parser.parse_args(["--policies", "default"]), parser, valid)["policies"]
    assert "lookahead_kv" in default and not set(PRESETS) & set(default)  # the default group is unchanged


def test_generate_end_to_end_with_exact_totals(tiny, adapter, ids):
    """kvjax.generate runs each preset (the lookahead pass, the composition, decoding on the compacted
    cache): Ada keeps Hkv*C per layer up to rounding, the global budget Hkv*L*C per row, CAKE L*C per
    head, CriticalKV C per head (over Ada, Ada's total); a budget above every prompt changes no token."""
    C, L, H = 10, tiny.config.num_layers, tiny.config.num_kv_heads
    settings = [kvjax.engine.Setting(None)] + [kvjax.engine.Setting(get(n, adapter=adapter), budget=b)
                                               for n in PRESETS for b in (C, 64)]
    full, *outs = kvjax.engine.generate_settings(tiny, ids, settings, max_new_tokens=3, stop_tokens=[])
    for i, name in enumerate(PRESETS):
        small, big = outs[2 * i], outs[2 * i + 1]
        assert (small.tokens[:, 0] == full.tokens[:, 0]).all()  # the first token is the full prefill's
        np.testing.assert_array_equal(big.tokens, full.tokens)
        kept = np.asarray(small.kept) * L * H  # mean over layers and heads -> entries per row
        if "ada_" in name:
            assert (np.abs(kept - L * H * C) <= L * H / 2).all()
        else:
            np.testing.assert_allclose(kept, L * H * C, rtol=1e-6)
