"""Probe: which prefill attention is fast on this accelerator? (issue 28, the device check)

The device report showed kvjax's prefill at 0.19x / 0.09x of torch sdpa at 8K / 32K on an H200. The engine's
prefill over a cache runs `flash_xla` (a blocked online softmax under lax loops). This times, on
[1, 32 q heads, n, 64] bf16 queries over 8 KV heads, causal, median of 5 after a compile:
  flash_xla (kvjax's), jax.nn.dot_product_attention xla / cudnn (with return_residual: out + lse),
  Pallas GPU mha (Triton; KV heads repeated), torch sdpa (GQA via enable_gqa),
and checks each output against flash_xla's (max abs diff). Then the bf16 logits drift of the bench model:
kvjax bf16 vs kvjax float32 and torch bf16 vs torch float32 at the same prompt (is kvjax's bf16 worse?).

    python eval/device/probes/prefill_attention.py [--tiny] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels.attention import flash_xla


def timed(fn, *args, repeats=5):
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def attention_rows(lengths, hq=32, hkv=8, d=64, emit=print):
    scale = d ** -0.5
    for n in lengths:
        ks = jax.random.split(jax.random.PRNGKey(n), 3)
        q = jax.random.normal(ks[0], (1, hq, n, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, hkv, n, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, hkv, n, d), jnp.bfloat16)
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        kpos = jnp.broadcast_to(pos[:, None], (1, hkv, n))
        flops = 4 * hq * n * n * d / 2  # causal
        ref = None

        def flash(q, k, v):
            return flash_xla.flash_attention(q, k, v, pos, kpos, scale)[0]

        def dpa(impl):
            def f(q, k, v):
                out, lse = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                                        v.transpose(0, 2, 1, 3), scale=scale, is_causal=True,
                                                        implementation=impl, return_residual=True)
                return out.transpose(0, 2, 1, 3)
            return f

        def pallas_mha(q, k, v):
            from jax.experimental.pallas.ops.gpu import attention as pa
            g = hq // hkv
            kk, vv = (jnp.repeat(x, g, axis=1).transpose(0, 2, 1, 3) for x in (k, v))
            out = pa.mha(q.transpose(0, 2, 1, 3), kk, vv, None, sm_scale=scale, causal=True)
            return out.transpose(0, 2, 1, 3)

        cands = [("flash_xla", flash), ("dpa_xla", dpa("xla")), ("dpa_cudnn", dpa("cudnn")), ("pallas_mha", pallas_mha)]
        for name, fn in cands:
            try:
                t, out = timed(jax.jit(fn), q, k, v)
                if ref is None:
                    ref = out
                diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                emit(dict(part="attention", n=n, impl=name, ms=t * 1e3, tflops=flops / t / 1e12, max_abs_diff=diff))
            except Exception as err:  # noqa: BLE001
                emit(dict(part="attention", n=n, impl=name, error=f"{type(err).__name__}: {str(err)[:300]}"))
        try:
            import torch
            import torch.nn.functional as F
            if torch.cuda.is_available():
                tq, tk, tv = (torch.from_dlpack(np.asarray(x.astype(jnp.float32))).cuda().to(torch.bfloat16)
                              for x in (q, k, v))
                def tf():
                    o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale, enable_gqa=True)
                    torch.cuda.synchronize()
                    return o
                tf()
                times = []
                for _ in range(5):
                    t0 = time.perf_counter(); o = tf(); times.append(time.perf_counter() - t0)
                t = float(np.median(times))
                diff = float((o.float().cpu() - torch.from_numpy(np.asarray(ref.astype(jnp.float32)))).abs().max())
                emit(dict(part="attention", n=n, impl="torch_sdpa", ms=t * 1e3, tflops=flops / t / 1e12,
                          max_abs_diff=diff))
        except Exception as err:  # noqa: BLE001
            emit(dict(part="attention", n=n, impl="torch_sdpa", error=f"{type(err).__name__}: {str(err)[:300]}"))


def drift_rows(size, length, emit=print):
    """kvjax bf16 vs f32 and torch bf16 vs f32 on the device bench's model: the last position's logits."""
    import torch
    import transformers
    from kvjax.bench import device as dev
    from kvjax.models.export import save_hf
    from kvjax.models.model import Model

    sz = dev.SIZES[size]
    model = dev.build_model(sz)
    cfg = model.config
    k16 = np.asarray(dev.kvjax_prefill(model, length)()[3][0], np.float64)
    model32 = Model(config=dataclasses.replace(cfg, dtype="float32"),
                    params=jax.tree.map(lambda x: x.astype(np.float32), model.params))
    with jax.default_matmul_precision("highest"):
        k32 = np.asarray(dev.kvjax_prefill(model32, length)()[3][0], np.float64)
    del model32
    where = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"
    with tempfile.TemporaryDirectory() as folder:
        save_hf(folder, model.params, cfg)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="sdpa").eval().to(where)
    ids = torch.tensor([dev.prompt_ids(length, cfg.vocab_size)], device=where)
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        t32 = hf(ids, logits_to_keep=1).logits[0, -1].double().cpu().numpy()
        hf.to(torch.bfloat16)
        t16 = hf(ids, logits_to_keep=1).logits[0, -1].double().cpu().numpy()

    def rel(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max()), bool(a.argmax() == b.argmax())

    for name, a, b in [("kvjax bf16 vs kvjax f32", k16, k32), ("torch bf16 vs torch f32", t16, t32),
                       ("kvjax f32 vs torch f32", k32, t32), ("kvjax bf16 vs torch bf16", k16, t16)]:
        d, same = rel(a, b)
        emit(dict(part="drift", tokens=length, pair=name, rel_max_diff=d, argmax_same=same,
                  max_abs_logit=float(np.abs(b).max())))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    emit(dict(part="env", backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__))
    for part in ("attention", "drift"):
        try:
            if part == "attention":
                attention_rows((256, 512) if args.tiny else (8192, 32768), emit=emit)
            else:
                drift_rows("tiny" if args.tiny else "full", 256 if args.tiny else 8192, emit=emit)
        except Exception:  # noqa: BLE001
            emit(dict(part=part, error=traceback.format_exc()[-1500:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
