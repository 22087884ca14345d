"""quantized_decode_attention: the Pallas kernels (TPU in interpret mode, Triton in the generic interpreter)
against the XLA reference, plus an independent float64 NumPy attention over `kv_quant.dequantize`d
rows; the in-kernel decoders exhaustively against NumPy's float16 / float8; dispatch and fallback.

Invisible slots hold garbage (random bytes: fp8 NaN codes, float16 NaN / inf scales), slots past S too;
a head that sees nothing must give zeros (lse MASK_VALUE), never NaN. Shapes stay small: each case is one
interpreted kernel (a second or two on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_helpers import gpu_only, tpu_only
from kvjax import kv_quant
from kvjax.kernels import _dispatch
from kvjax.kernels._common import MASK_VALUE
from kvjax.kernels.quantized_attention import _unpack, api, pallas_gpu, pallas_tpu, reference
from kvjax.kv_quant import KVQuant, Quantized

SCALE = 0.3
TOL = dict(rtol=2e-5, atol=2e-5)  # float32 queries: dequantized rows are exact, dots at HIGHEST precision


def _garbage(rng, x: jax.Array, where: np.ndarray) -> jax.Array:
    """x with the entries selected by `where` (broadcast over trailing axes) replaced by random bytes."""
    a = np.asarray(x).copy()
    bits = a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16)
    noise = rng.integers(0, 256 ** a.dtype.itemsize, size=bits.shape).astype(bits.dtype)
    if a.dtype == np.float16:  # make sure NaN and inf scales are among the garbage
        noise.flat[::7] = 0x7E00
        noise.flat[3::11] = 0x7C00
    mask = np.broadcast_to(where.reshape(where.shape + (1,) * (a.ndim - where.ndim)), a.shape)
    bits[mask] = noise[mask]
    return jnp.asarray(a)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(x: jax.Array, cfg: KVQuant) -> tuple[Quantized, Quantized]:
    return kv_quant.quantize(x[0], cfg, per_channel=cfg.key_axis == "channel"), kv_quant.quantize(x[1], cfg)


def make_case(cfg: KVQuant, *, b=1, hkv=2, g=4, s=200, d=64, extra=0, p_visible=0.6, seed=0, qdtype=jnp.float32):
    """Quantized keys / values over S' = s + extra slots (rounded up to the key slot group for
    per-channel keys), visible [b,hkv,s]; every invisible slot and every slot past s holds garbage."""
    rng = np.random.default_rng(seed)
    channel = cfg.key_axis == "channel"
    sp = s + extra
    if channel:
        sp = -(-sp // cfg.slot_group) * cfg.slot_group
    x = rng.normal(size=(2, b, hkv, sp, d)).astype(np.float32)
    x[..., : d // 8] *= 5.0  # outlier channels
    x[..., 1::4, :] *= 1e-4  # tiny rows: subnormal float16 scales
    qk, qv = _quantize(jnp.asarray(x), cfg)
    visible = rng.random((b, hkv, s)) < p_visible
    hidden = np.concatenate([~visible, np.ones((b, hkv, sp - s), bool)], axis=-1)
    if channel:  # a key scale row is garbage only where its whole slot group is
        rows = hidden.reshape(b, hkv, sp // cfg.slot_group, cfg.slot_group).all(-1)
        qk = Quantized(_garbage(rng, qk.codes, hidden), _garbage(rng, qk.scale, rows),
                       None if qk.zero is None else _garbage(rng, qk.zero, rows))
    else:
        qk = jax.tree.map(lambda a: _garbage(rng, a, hidden), qk)
    qv = jax.tree.map(lambda a: _garbage(rng, a, hidden), qv)
    query = jnp.asarray(rng.normal(size=(b, hkv * g, d)), qdtype)
    return query, qk, qv, jnp.asarray(visible)


def run_tpu(cfg, args, softcap=None, **kw):
    fn = functools.partial(pallas_tpu.quantized_decode_attention, scale=SCALE, config=cfg, softcap=softcap,
                           interpret=True, **kw)
    return jax.jit(fn)(*args)


def run_gpu(cfg, args, softcap=None, **kw):
    fn = functools.partial(pallas_gpu.quantized_decode_attention, scale=SCALE, config=cfg, softcap=softcap,
                           interpret=True, **kw)
    return jax.jit(fn)(*args)


def run_ref(cfg, args, softcap=None):
    fn = functools.partial(reference.quantized_decode_attention, scale=SCALE, config=cfg, softcap=softcap)
    return jax.jit(fn)(*args)


def assert_matches(got, want, visible, tol=TOL):
    out, lse, logits = (np.asarray(a) for a in got)
    w_out, w_lse, w_logits = (np.asarray(a) for a in want)
    for a in (out, lse, logits):
        assert np.isfinite(a).all(), "non-finite values escaped"
    assert out.shape == w_out.shape and out.dtype == np.float32
    assert lse.shape == w_lse.shape and logits.shape == w_logits.shape
    np.testing.assert_allclose(logits, w_logits, **tol)
    hidden = ~np.asarray(visible)[:, :, None, :].repeat(logits.shape[2], 2)
    assert np.all(logits[hidden] == MASK_VALUE)
    np.testing.assert_allclose(lse, w_lse, **tol)
    np.testing.assert_allclose(out, w_out, **tol)


# Every format, both key axes, symmetric and asymmetric, groups, GQA 1 / 4 / 8, head_dim 64 and 128, softcap.
CASES = [
    # (id, config, g, d, softcap)
    ("int8", KVQuant("int8"), 4, 64, None),
    ("int8-asym-g32-d128", KVQuant("int8", group=32, asymmetric=True), 8, 128, None),
    ("int8-kivi", KVQuant("int8", key_axis="channel", group=32, residual=32, asymmetric=True), 1, 64, 20.0),
    ("fp8-d128", KVQuant("fp8"), 8, 128, None),
    ("fp8-g16-kivi", KVQuant("fp8", key_axis="channel", group=16, residual=32), 4, 64, None),
    ("int4-preset", kv_quant.PRESETS["int4"], 4, 128, None),
    ("int4-sym-d64", KVQuant("int4"), 1, 64, 5.0),
    ("int4-g48", KVQuant("int4", group=48, asymmetric=True), 4, 96, None),  # a group straddles the halves
    ("int4-kivi-d128", kv_quant.PRESETS["int4_kivi"], 4, 128, None),
    ("int4-kivi-sym-d64", KVQuant("int4", key_axis="channel", group=32, residual=32), 8, 64, None),
    ("int4-kivi-g12", KVQuant("int4", key_axis="channel", group=12, residual=12), 4, 64, None),  # G % 8 != 0
    ("int2-preset-d64", kv_quant.PRESETS["int2"], 4, 64, 10.0),
    ("int2-sym-g16-d128", KVQuant("int2", group=16), 8, 128, None),
    ("int2-kivi-d64", kv_quant.PRESETS["int2_kivi"], 1, 64, None),
    ("int2-kivi-d128", kv_quant.PRESETS["int2_kivi"], 4, 128, 30.0),
    ("int2-hadamard", kv_quant.PRESETS["int2_hadamard"], 4, 64, None),
]


# The fast set still covers every format, both key axes, symmetric and asymmetric, softcap, GQA 1 / 4 / 8,
# head_dim 64 and 128 and each scale-spreading path; these five repeat combinations already covered.
TPU_SLOW = ("fp8-g16-kivi", "int4-sym-d64", "int4-kivi-sym-d64", "int2-kivi-d128", "int2-hadamard")
TPU_CASES = [pytest.param(*c, id=c[0], marks=pytest.mark.slow if c[0] in TPU_SLOW else ()) for c in CASES]


class TestTpuKernelInterpret:
    """The Pallas TPU kernel in interpret mode (NaN-poisoned scratch), against the XLA reference."""

    @pytest.mark.parametrize("name, cfg, g, d, softcap", TPU_CASES)
    def test_matches_reference(self, name, cfg, g, d, softcap):
        args = make_case(cfg, g=g, d=d, extra=5, seed=len(name))
        assert_matches(run_tpu(cfg, args, softcap), run_ref(cfg, args, softcap), args[3])

    @pytest.mark.parametrize("cfg", [kv_quant.PRESETS["int4"], KVQuant("int2", key_axis="channel", group=8, residual=8,
                                                                       asymmetric=True)], ids=["int4", "int2_kivi_g8"])
    def test_several_blocks_with_empty_ones(self, cfg):
        """S = 700 over key blocks of 128 (int4) or 256 (kivi over groups of 8 slots: 32 scale rows a block),
        with a leading, a middle and a trailing run of invisible slots (skipped blocks), S' > S and a last
        block that runs past the stored slots."""
        q, k, v, vis = make_case(cfg, b=2, hkv=1, g=4, s=700, d=64, extra=40, seed=3)
        vis = vis.at[0, 0, :300].set(False).at[1, 0, 130:520].set(False).at[1, 0, 600:].set(False)
        bk, _ = pallas_tpu.plan_blocks(_unpack.layout(cfg, 64), 700, cfg.asymmetric, 128)
        assert -(-700 // bk) >= 2
        args = (q, k, v, vis)
        assert_matches(run_tpu(cfg, args, block_k=128), run_ref(cfg, args), vis)

    def test_head_that_sees_nothing_gives_zeros(self):
        cfg = kv_quant.PRESETS["int4"]
        q, k, v, vis = make_case(cfg, b=2, hkv=2, g=4, s=200, d=64, seed=4)
        vis = vis.at[1, 0].set(False)
        out, lse, logits = (np.asarray(a) for a in run_tpu(cfg, (q, k, v, vis)))
        assert np.all(out[1, 0:4] == 0.0) and np.all(lse[1, 0:4] == MASK_VALUE)
        assert np.all(logits[1, 0] == MASK_VALUE)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        assert_matches((out, lse, logits), run_ref(cfg, (q, k, v, vis)), vis)

    def test_bfloat16_query(self):
        """bfloat16 queries dot in bfloat16 (the dequantized rows rounded to bfloat16, 2^-9 relative): each
        logit within scale · Σ|q||k| · 2^-8 of the float32 reference, the output within 2% of its range."""
        cfg = kv_quant.PRESETS["int4"]
        q, k, v, vis = args = make_case(cfg, g=8, d=128, seed=5, qdtype=jnp.bfloat16)
        out, lse, logits = (np.asarray(a) for a in run_tpu(cfg, args))
        w_out, w_lse, w_logits = (np.asarray(a) for a in run_ref(cfg, args))
        seen = np.broadcast_to(np.asarray(vis)[:, :, None, :], logits.shape)
        assert np.all(logits[~seen] == MASK_VALUE)
        qa = np.abs(np.asarray(q, np.float32)).reshape(1, 2, 8, 128)
        bound = SCALE * np.einsum("bhgd,bhsd->bhgs", qa, np.abs(np.asarray(kv_quant.dequantize(k, cfg)))) * 2.0 ** -8
        assert np.all(np.abs(logits - w_logits)[seen] <= bound[seen])
        assert np.abs(lse - w_lse).max() <= 0.05
        assert np.abs(out - w_out).max() <= 0.02 * np.abs(w_out).max()
        assert np.abs(logits - w_logits)[seen].max() > 0  # really bfloat16 (not silently float32)

    def test_against_numpy_attention_over_dequantized_rows(self):
        """Independent of the reference: float64 NumPy softmax attention over `kv_quant.dequantize`d keys and
        values, written out per (row, query head)."""
        cfg = KVQuant("int4", group=16, asymmetric=True)
        q, k, v, vis = make_case(cfg, b=2, hkv=2, g=2, s=150, d=64, extra=10, seed=6)
        out, lse, logits = (np.asarray(a, np.float64) for a in run_tpu(cfg, (q, k, v, vis), softcap=7.0))
        keys = np.asarray(kv_quant.dequantize(k, cfg), np.float64)
        values = np.asarray(kv_quant.dequantize(v, cfg), np.float64)
        qn, vn = np.asarray(q, np.float64), np.asarray(vis)
        for bi in range(2):
            for h in range(4):
                kv, gi = h // 2, h % 2
                cols = np.flatnonzero(vn[bi, kv])
                s = keys[bi, kv, cols] @ qn[bi, h] * SCALE
                s = np.tanh(s / 7.0) * 7.0
                p = np.exp(s - s.max())
                np.testing.assert_allclose(out[bi, h], p @ values[bi, kv, cols] / p.sum(), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(lse[bi, h], s.max() + np.log(p.sum()), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(logits[bi, kv, gi, cols], s, rtol=1e-5, atol=1e-5)
                assert np.all(np.delete(logits[bi, kv, gi], cols) == np.float32(MASK_VALUE))


def _gpu_ok(cfg, d) -> bool:
    try:
        pallas_gpu.check_supported(_unpack.layout(cfg, d))
        return True
    except NotImplementedError:
        return False


# A few cases in the fast set (one per code path: token scales with several groups in a piece, packed
# per-channel keys, int2 at head_dim 64); the whole list is `slow`.
GPU_FAST = ("int8-asym-g32-d128", "int4-kivi-d128", "int2-preset-d64")
GPU_CASES = [pytest.param(*c, id=c[0], marks=() if c[0] in GPU_FAST else pytest.mark.slow)
             for c in CASES if _gpu_ok(c[1], c[3])]


class TestGpuKernelInterpret:
    """The Pallas Triton kernel in the generic Pallas interpreter (logic only), against the XLA reference."""

    @pytest.mark.parametrize("name, cfg, g, d, softcap", GPU_CASES)
    def test_matches_reference(self, name, cfg, g, d, softcap):
        args = make_case(cfg, g=g, d=d, extra=5, seed=len(name))
        assert_matches(run_gpu(cfg, args, softcap), run_ref(cfg, args, softcap), args[3])

    def test_splits_and_fp8_decoded_from_bits(self):
        """Several splits of several blocks (S not a multiple of the block); fp8 decoded from its bits
        (GPUs older than sm_89)."""
        cfg = KVQuant("fp8", group=32)
        q, k, v, vis = make_case(cfg, b=1, hkv=2, g=4, s=300, d=64, extra=3, seed=7)
        vis = vis.at[0, 1, 40:290].set(False)
        args = (q, k, v, vis)
        got = run_gpu(cfg, args, block_k=32, target_programs=8, fp8_native=False)
        assert_matches(got, run_ref(cfg, args), vis)

    def test_head_that_sees_nothing_gives_zeros(self):
        cfg = kv_quant.PRESETS["int2_kivi"]
        q, k, v, vis = make_case(cfg, b=1, hkv=2, g=4, s=128, d=64, seed=8)
        vis = vis.at[0, 1].set(False)
        out, lse, logits = (np.asarray(a) for a in run_gpu(cfg, (q, k, v, vis)))
        assert np.all(out[0, 4:8] == 0.0) and np.all(lse[0, 4:8] == MASK_VALUE) and np.isfinite(out).all()
        assert_matches((out, lse, logits), run_ref(cfg, (q, k, v, vis)), vis)

    def test_unsupported_layouts_raise(self):
        with pytest.raises(NotImplementedError, match="power"):
            pallas_gpu.check_supported(_unpack.layout(KVQuant("int8"), 96))
        with pytest.raises(NotImplementedError, match=">= 16"):
            pallas_gpu.check_supported(_unpack.layout(KVQuant("int2"), 32))
        with pytest.raises(NotImplementedError, match="slot group"):
            pallas_gpu.check_supported(_unpack.layout(KVQuant("int4", key_axis="channel", group=24, residual=48), 64))
        for name, cfg in kv_quant.PRESETS.items():  # every preset runs at head_dim 64 and 128
            for d in (64, 128):
                pallas_gpu.check_supported(_unpack.layout(cfg, d))


class TestDecoders:
    def test_float16_bits_exhaustive(self):
        h = np.arange(1 << 16, dtype=np.uint16)
        want = h.view(np.float16).astype(np.float32)
        got = np.asarray(_unpack.f16_bits_to_f32(jnp.asarray(h.view(np.int16)).astype(jnp.int32)))
        same = (got == want) & (np.signbit(got) == np.signbit(want))
        assert np.all(same | (np.isnan(got) & np.isnan(want)))

    def test_e4m3_bits_exhaustive(self):
        u = np.arange(256, dtype=np.uint8)
        want = np.asarray(jnp.asarray(u).view(jnp.float8_e4m3fn).astype(jnp.float32))
        got = np.asarray(_unpack.e4m3_bits_to_f32(jnp.asarray(u, jnp.int32)))
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(got[finite], want[finite])
        assert np.all(np.signbit(got[finite]) == np.signbit(want[finite]))  # -0.0 too
        assert np.all(np.abs(got[~finite]) == 480.0)  # the two NaN codes (never written)

    @pytest.mark.parametrize("cfg", [KVQuant("int4", group=16, asymmetric=True), KVQuant("int2"),
                                     KVQuant("int8", group=8), KVQuant("fp8", group=32)],
                             ids=["int4", "int2", "int8", "fp8"])
    def test_pieces_dequantize_exactly(self, cfg):
        """The per-piece code · scale + bias is bit-identical to kv_quant.dequantize."""
        d = 64
        x = np.random.default_rng(9).normal(size=(40, d)).astype(np.float32) * 3
        x[::4] *= 1e-3  # subnormal float16 scales
        lay = _unpack.layout(cfg, d)

        @jax.jit
        def both(x):
            qz = kv_quant.quantize(x, cfg)
            pieces = _unpack.code_pieces(_unpack.storage_bits(qz.codes), lay)
            sc, bias = _unpack.scale_and_bias(_unpack.storage_scale(qz.scale), qz.zero, lay)
            rows = [c * _unpack.token_piece(sc, p, lay) + (0.0 if bias is None else _unpack.token_piece(bias, p, lay))
                    for p, c in enumerate(pieces)]
            joined = jnp.concatenate([jnp.broadcast_to(r, (40, lay.piece)) for r in rows], -1)
            return joined, kv_quant.dequantize(qz, cfg)

        got, want = both(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_bytes_per_slot(self):
        assert _unpack.bytes_per_slot(kv_quant.PRESETS["int8"], 128) == 2 * (128 + 2)
        assert _unpack.bytes_per_slot(kv_quant.PRESETS["int4"], 128) == 2 * (64 + 2)  # one f16 scale per slot
        assert _unpack.bytes_per_slot(kv_quant.PRESETS["int4_g32"], 128) == 2 * (64 + 4 * 3)
        assert _unpack.bytes_per_slot(kv_quant.PRESETS["int2"], 128) == 2 * (32 + 4 * 3)
        assert _unpack.bytes_per_slot(kv_quant.PRESETS["int4_kivi"], 128) == 64 + 128 * 3 / 32 + 64 + 3


class TestDispatch:
    CFG = kv_quant.PRESETS["int4_g32"]  # groups of 32 channels with zero points: every scale check applies

    def test_public_op_runs_the_kernel(self, monkeypatch):
        """implementation="interpret" really calls the TPU kernel (not a silent fallback), and "xla" the
        reference; both give the reference's numbers."""
        calls = []
        real = pallas_tpu.quantized_decode_attention
        monkeypatch.setattr(pallas_tpu, "quantized_decode_attention",
                            lambda *a, **kw: calls.append(1) or real(*a, **kw))
        args = make_case(self.CFG, g=4, d=64, s=100, seed=11)
        want = run_ref(self.CFG, args)
        for impl in ("interpret", "xla"):
            got = api.quantized_decode_attention(*args, scale=SCALE, config=self.CFG, implementation=impl)
            assert_matches(got, want, args[3])
        assert calls == [1]

    def test_unsupported_falls_back_by_default_and_raises_when_named(self, monkeypatch):
        cfg = KVQuant("int8")
        args = make_case(cfg, g=2, d=96, s=100, seed=12)  # head_dim 96: no power-of-two Triton tile
        with pytest.raises(NotImplementedError, match="power of two"):
            api.quantized_decode_attention(*args, scale=SCALE, config=cfg, implementation="pallas_gpu")
        monkeypatch.setenv("KVJAX_KERNEL_IMPLEMENTATION", "pallas_gpu")
        with pytest.warns(UserWarning, match="XLA reference"):
            got = api.quantized_decode_attention(*args, scale=SCALE, config=cfg)
        assert_matches(got, run_ref(cfg, args), args[3])

    def test_bad_arguments(self):
        q, k, v, vis = make_case(self.CFG, g=4, d=64, s=100, seed=13)
        call = functools.partial(api.quantized_decode_attention, scale=SCALE, config=self.CFG, implementation="xla")
        with pytest.raises(ValueError, match="bytes per row"):
            call(q, Quantized(k.codes[..., :16], k.scale, k.zero), v, vis)
        with pytest.raises(ValueError, match="scale must have shape"):
            call(q, k, Quantized(v.codes, v.scale[..., :1], v.zero), vis)
        with pytest.raises(ValueError, match="zero must be given"):
            call(q, k, Quantized(v.codes, v.scale, None), vis)
        with pytest.raises(ValueError, match="S'"):
            call(q, k, v, jnp.ones((1, 2, 300), bool))
        with pytest.raises(ValueError, match="softcap"):
            call(q, k, v, vis, softcap=-1.0)

    def test_default_order(self, monkeypatch):
        """As decode_attention: the Pallas kernel first on TPU and GPU, XLA on CPU."""
        for backend in ("tpu", "gpu", "cpu"):
            assert (_dispatch.default_order("quantized_decode_attention", backend)
                    == _dispatch.default_order("decode_attention", backend))
        assert _dispatch.default_order("quantized_decode_attention", "tpu") == ("pallas_tpu", "xla")
        assert _dispatch.default_order("quantized_decode_attention", "gpu") == ("pallas_gpu", "xla")
        monkeypatch.delenv("KVJAX_KERNEL_IMPLEMENTATION", raising=False)
        assert api.TABLE.resolve(None) == "xla"  # this CPU host


class OnDevice:
    """The compiled kernel on its hardware, through the public op (skipped elsewhere)."""

    IMPL = "xla"

    @pytest.mark.parametrize("name, cfg, g, d, softcap", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, name, cfg, g, d, softcap):
        if self.IMPL == "pallas_gpu" and not _gpu_ok(cfg, d):
            pytest.skip("no power-of-two Triton tile (XLA fallback)")
        args = make_case(cfg, b=2, g=g, d=d, s=2000, extra=5, seed=len(name))
        got = api.quantized_decode_attention(*args, scale=SCALE, config=cfg, softcap=softcap, implementation=self.IMPL)
        assert_matches(got, run_ref(cfg, args, softcap), args[3], tol=dict(rtol=1e-4, atol=1e-4))


class TestTpuKernelOnDevice(OnDevice):
    IMPL = "pallas_tpu"
    pytestmark = tpu_only


class TestGpuKernelOnDevice(OnDevice):
    IMPL = "pallas_gpu"
    pytestmark = gpu_only
