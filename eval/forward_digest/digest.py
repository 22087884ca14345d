"""A digest of a fixed set of runs through the forward pass, to prove that a refactor changes no result.

    python eval/forward_digest/digest.py record OUT.npz     # every array below, saved
    python eval/forward_digest/digest.py compare A.npz B.npz [--json SUMMARY.json]

What it records (CPU, float32; models: the bundled model, tiny random Gemma 2 / Gemma 3 built with
transformers in a temp folder):
- every registered preset at r=0.5 on the bundled model: kept positions per (layer, row, head) after
  `kvjax.compress`, and greedy tokens with and without a question after the context
  (`generate_settings`, one shared prefill, as the eval runs them);
- a 1,500-token prompt (the 2,048 bucket, so blocked attention and the two-pass column mass run) for
  the presets whose observations differ there;
- teacher-forced logits (`continuation_logits`) for the full cache and four policies;
- Gemma 2 / Gemma 3 (sliding-window layers, soft-caps): tokens and kept sets;
- the ragged decode layout and chunked prefill: tokens;
- `extend` itself: every observation of a prefill, of a chunk against a filled cache and of a decode step.

`compare` requires equal integer arrays (kept sets, tokens) and reports the largest float difference.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

RATIO = 0.5
NEW = 8


def _prose(n_words: int, seed: int) -> str:
    rng = np.random.RandomState(seed)
    words = ("the river runs past old stone houses where children play and dogs sleep in warm light "
             "while traders count coins and sailors mend their nets before the storm").split()
    text = " ".join(words[i] for i in rng.randint(0, len(words), n_words))
    return text.replace(" the storm", " the storm. The magic number is 4817.", 1)


def _kept(cache) -> np.ndarray:
    """[L,B,Hkv,C] positions of valid slots, sorted per head (-1 after), as int32."""
    pos = np.where(np.asarray(cache.valid), np.asarray(cache.pos), np.iinfo(np.int32).max)
    pos = np.sort(pos, axis=-1)
    return np.where(pos == np.iinfo(np.int32).max, -1, pos).astype(np.int32)


def _record_bundled(out: dict[str, np.ndarray]) -> None:
    import kvjax
    from kvjax import engine
    from kvjax.engine import Setting

    model = kvjax.load_model("bundled")
    contexts = [_prose(180, 0), _prose(420, 1)]
    questions = ["What is the magic number?", "What is the magic number mentioned?"]
    names = kvjax.policies.available()
    settings = [Setting()] + [Setting(n, compression_ratio=RATIO) for n in names]
    for tag, qs in (("agnostic", questions), ("aware", None)):
        prompts = contexts if qs else [c + " " + q for c, q in zip(contexts, questions)]
        outs = engine.generate_settings(model, prompts, settings, questions=qs, max_new_tokens=NEW, stop_tokens=[],
                                       on_error="return")
        for st, o in zip(settings, outs):
            if isinstance(o, Exception):
                print(f"{tag} {st.policy_name}: {o}", file=sys.stderr)
                continue
            out[f"bundled/{tag}/{st.policy_name}/tokens"] = np.asarray(o.tokens)
            out[f"bundled/{tag}/{st.policy_name}/kept"] = np.asarray(o.kept, np.float64)
        jax.clear_caches()
    for n in names:
        try:
            out[f"bundled/compress/{n}"] = _kept(engine.compress(model, contexts, policy=n, compression_ratio=RATIO))
        except ValueError as err:
            print(f"compress {n}: {err}", file=sys.stderr)
        jax.clear_caches()  # every compiled CPU program holds memory maps; thousands pass vm.max_map_count
    conts = ["The magic number is 4817 and the river runs on.", "Sailors mend their nets."]
    for n in (None, "snapkv", "streaming_llm", "knorm", "h2o_prefill"):
        logits = engine.continuation_logits(model, contexts, conts, policy=n,
                                           compression_ratio=None if n is None else RATIO)
        for b, x in enumerate(logits):
            out[f"bundled/logits/{n or 'full'}/{b}"] = x
    jax.clear_caches()
    long_ctx = [_prose(1100, 2)]
    long_names = ["snapkv", "h2o_prefill", "observed_attention_kvpress", "tova", "kvzip", "expected_attention",
                  "lookahead_kv", "defensivekv", "cake"]
    outs = engine.generate_settings(model, long_ctx, [Setting()] + [Setting(n, compression_ratio=RATIO)
                                                                   for n in long_names],
                                   questions=questions[:1], max_new_tokens=NEW, stop_tokens=[])
    for n, o in zip(["full"] + long_names, outs):
        out[f"bundled/long/{n}/tokens"] = np.asarray(o.tokens)
    for n in long_names:
        out[f"bundled/long/{n}/kept"] = _kept(engine.compress(model, long_ctx, policy=n, compression_ratio=RATIO))
        jax.clear_caches()
    for n in ("pyramidkv", "ada_snapkv", "cake", "snapkv"):
        o = kvjax.generate(model, contexts, questions=questions, policy=n, compression_ratio=RATIO,
                           max_new_tokens=NEW, stop_tokens=[], cache_layout="ragged")
        out[f"bundled/ragged/{n}/tokens"] = np.asarray(o.tokens)
        out[f"bundled/ragged/{n}/bytes"] = np.asarray([o.cache_bytes])
        jax.clear_caches()
    for n in ("snapkv", "h2o", "tova", "streaming_llm", "pyramidkv"):
        o = kvjax.generate(model, contexts, questions=questions, policy=n, compression_ratio=RATIO,
                           max_new_tokens=NEW, stop_tokens=[], prefill_chunk=128)
        out[f"bundled/chunked/{n}/tokens"] = np.asarray(o.tokens)
        out[f"bundled/chunked/{n}/kept"] = _kept(engine.compress(model, contexts, policy=n, compression_ratio=RATIO,
                                                                prefill_chunk=128))
        jax.clear_caches()
    _record_extend(model, out)


def _record_extend(model, out: dict[str, np.ndarray]) -> None:
    """`extend` directly: a prefill, a chunk and a decode step, every observation."""
    from kvjax.models import extend
    from kvjax.models.local import init_cache
    from kvjax.observations import ObservationSpec

    cfg, params = model.config, model.params
    rng = np.random.RandomState(3)
    B, T = 2, 96
    tokens = jnp.asarray(rng.randint(3, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.asarray(np.where(np.arange(T)[None] < np.array([[70], [96]]), np.arange(T)[None], -1), jnp.int32)
    spec = ObservationSpec(window=8, column_mass=True, output_norms=True, query_stats=10)
    cache = init_cache(cfg, B, 160)
    logits, cache, obs = extend(params, cfg, cache, tokens, positions, fresh=True, observe=spec)
    out["extend/prefill/logits"] = np.asarray(logits)
    for f in ("window_queries", "window_positions", "column_mass", "output_norms", "query_mean", "query_cov"):
        out[f"extend/prefill/{f}"] = np.asarray(getattr(obs, f))
    chunk = jnp.asarray(rng.randint(3, cfg.vocab_size, (B, 16)), jnp.int32)
    cpos = jnp.asarray(np.array([[70], [96]]) + np.arange(16)[None], jnp.int32)
    spec = ObservationSpec(window=4, column_mass=True, step_probs=True, query_mass=True)
    logits, cache2, obs = extend(params, cfg, cache, chunk, cpos, fresh=False, observe=spec)
    out["extend/chunk/logits"] = np.asarray(logits)
    for f in ("window_queries", "column_mass", "step_probs", "query_mass"):
        out[f"extend/chunk/{f}"] = np.asarray(getattr(obs, f))
    logits, _, obs = extend(params, cfg, cache, chunk, cpos, fresh=False, observe=ObservationSpec(query_mass=True),
                            commit=False)
    out["extend/nocommit/logits"] = np.asarray(logits)
    out["extend/nocommit/query_mass"] = np.asarray(obs.query_mass)
    step = jnp.asarray([[5], [7]], jnp.int32)
    spos = jnp.asarray([[86], [112]], jnp.int32)
    logits, _, obs = extend(params, cfg, cache2, step, spos, fresh=False, observe=ObservationSpec(step_probs=True))
    out["extend/decode/logits"] = np.asarray(logits)
    out["extend/decode/step_probs"] = np.asarray(obs.step_probs)
    logits, _, obs = extend(params, cfg, cache2, step, spos, fresh=False, rope_mode="cache_relative")
    out["extend/relative/logits"] = np.asarray(logits)
    logits, _, _ = extend(params, cfg, None, tokens, positions, fresh=True)
    out["extend/nocache/logits"] = np.asarray(logits)


def _record_gemma(out: dict[str, np.ndarray]) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
    from tiny_models import GEMMA_FAMILIES, build_hf

    import kvjax
    from kvjax import engine

    rng = np.random.RandomState(5)
    for family in GEMMA_FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            build_hf(family, pathlib.Path(tmp))
            model = kvjax.load_model(tmp)
        prompts = [rng.randint(3, model.config.vocab_size, n).tolist() for n in (80, 150)]
        qs = [rng.randint(3, model.config.vocab_size, 6).tolist() for _ in prompts]
        for n in (None, "snapkv", "streaming_llm", "h2o", "tova", "pyramidkv", "knorm"):
            o = kvjax.generate(model, prompts, questions=qs, policy=n, compression_ratio=None if n is None else RATIO,
                               max_new_tokens=NEW, stop_tokens=[])
            out[f"{family}/{n or 'full'}/tokens"] = np.asarray(o.tokens)
            if n is not None:
                out[f"{family}/{n}/kept"] = _kept(engine.compress(model, prompts, policy=n, compression_ratio=RATIO))
        for n in ("snapkv", "h2o"):
            o = kvjax.generate(model, prompts, questions=qs, policy=n, compression_ratio=RATIO, max_new_tokens=NEW,
                               stop_tokens=[], prefill_chunk=32)
            out[f"{family}/chunked/{n}/tokens"] = np.asarray(o.tokens)


def record(path: str) -> None:
    out: dict[str, np.ndarray] = {}
    _record_gemma(out)
    _record_bundled(out)
    np.savez_compressed(path, **out)
    print(f"{len(out)} arrays -> {path}")


def compare(a_path: str, b_path: str, summary: str | None) -> int:
    a, b = np.load(a_path), np.load(b_path)
    missing = sorted(set(a.files) ^ set(b.files))
    ints_differ, worst = [], {}
    for k in sorted(set(a.files) & set(b.files)):
        x, y = a[k], b[k]
        if x.shape != y.shape:
            ints_differ.append(f"{k}: shape {x.shape} vs {y.shape}")
        elif np.issubdtype(x.dtype, np.floating):
            worst[k] = float(np.nanmax(np.abs(x - y))) if x.size else 0.0
        elif not np.array_equal(x, y):
            ints_differ.append(k)
    top = max(worst.values(), default=0.0)
    print(f"{len(a.files)} vs {len(b.files)} arrays; only in one: {missing or 'none'}")
    print(f"integer arrays (kept sets, tokens) that differ: {ints_differ or 'none'}")
    print(f"largest float difference: {top:.3g}" + (f" ({max(worst, key=worst.get)})" if worst else ""))
    if summary:
        pathlib.Path(summary).write_text(json.dumps({
            "arrays": len(a.files), "only_in_one": missing, "integer_arrays_differing": ints_differ,
            "exact_integer_arrays": sum(1 for k in a.files if not np.issubdtype(a[k].dtype, np.floating)),
            "float_arrays": len(worst), "float_arrays_bit_identical": sum(v == 0 for v in worst.values()),
            "largest_float_difference": top}, indent=2) + "\n")
    return 1 if missing or ints_differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--json")
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out)
        return 0
    return compare(args.a, args.b, args.json)


if __name__ == "__main__":
    sys.exit(main())
