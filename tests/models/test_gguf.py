"""GGUF loading against transformers' own GGUF loading of the same file (PyTorch, float32).

Tiny files are written with `gguf.GGUFWriter` (tests/tiny_gguf.py); the real one is the SmolLM2-135M
Q4_1 fixture in ../shared/fixtures.
"""

import dataclasses
import json
import os
import pathlib
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvjax
from kvjax.cache import KVCache
from kvjax.models import extend
from kvjax.models.gguf import SUPPORTED_TENSOR_TYPES, unpermute_qk

from tiny_gguf import SPECIALS, TEXTS, write_gguf

RNG = np.random.RandomState(0)
_extend = jax.jit(extend, static_argnames=("cfg", "fresh"))


def _reference(path: pathlib.Path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _prefill_then_decode(model, prompt: list[int], continuation: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """kvjax logits of the prompt (one prefill), then of each continuation token (one decode step each)."""
    cfg = model.config
    T_, n = len(prompt), len(continuation)
    cache = KVCache.init(cfg.num_layers, 1, cfg.num_kv_heads, T_ + n, cfg.head_dim, cfg.jnp_dtype)
    logits, cache, _ = _extend(model.params, cfg, cache, jnp.asarray([prompt]), jnp.arange(T_)[None], fresh=True)
    steps = []
    for i, t in enumerate(continuation):
        step, cache, _ = _extend(model.params, cfg, cache, jnp.asarray([[t]]), jnp.asarray([[T_ + i]]), fresh=False)
        steps.append(np.asarray(step[0, 0]))
    return np.asarray(logits[0]), np.stack(steps)


def _check_logits(path: pathlib.Path, rtol: float = 1e-4, greedy: bool = False):
    ref, _ = _reference(path)
    model = kvjax.load_model(path)
    vocab = model.config.vocab_size
    prompt = RNG.randint(3, vocab, 19).tolist()
    continuation = RNG.randint(3, vocab, 6).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([prompt + continuation])).logits[0].numpy()
    prefill, decode = _prefill_then_decode(model, prompt, continuation)
    scale = np.abs(want).max()
    np.testing.assert_array_less(np.abs(prefill - want[: len(prompt)]).max(), rtol * scale)
    np.testing.assert_array_less(np.abs(decode - want[len(prompt):]).max(), rtol * scale)
    if not greedy:
        return
    # greedy decoding through the engine: the tokens transformers' generate picks
    out = kvjax.generate(model, [prompt], max_new_tokens=8, stop_tokens=[])
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens[0, : len(hf)].tolist() == hf


@pytest.mark.parametrize("family,qtype,overrides,greedy", [
    ("llama3", T.F32, None, True),            # llama: Q/K rows permuted in the file; GQA 8/2; tied
    ("llama2", T.Q8_0, None, False),          # llama: multi-head, untied (output.weight), Q8_0
    ("qwen2", T.Q8_0, None, False),           # qwen2: q/k/v biases, no permutation
    ("llama3", T.Q4_1, None, False),
    ("qwen3", T.F16, {"head_dim": 128}, False),  # qwen3: q/k norms (transformers reads head_dim 128 for qwen3)
])
def test_tiny_gguf_matches_transformers(tmp_path, family, qtype, overrides, greedy):
    """Prefill logits, then incremental decode logits (and greedy tokens through kvjax.generate)."""
    path, _ = write_gguf(family, tmp_path, qtype=qtype, overrides=overrides)
    _check_logits(path, greedy=greedy)


def _random_blocks(qtype: T, rows: int, cols: int, f16_at: tuple[int, ...]) -> np.ndarray:
    """Random quantized bytes for `rows x cols` values, with the f16 scales at byte offsets f16_at set small."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = RNG.randint(0, 256, (rows, cols // block, size)).astype(np.uint8)
    for at in f16_at:
        scale = RNG.uniform(2e-4, 6e-4, (rows, cols // block)).astype(np.float16)
        data[:, :, at: at + 2] = scale[..., None].view(np.uint8)
    return data.reshape(rows, -1)


# byte offsets of the f16 scales (d, dmin) inside one block (ggml-common.h)
_K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def test_k_quants_and_5bit_match_transformers(tmp_path):
    """One model whose weights use every other supported type (K-quants need rows of 256 values)."""
    kinds = {"blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q6_K, "blk.0.attn_v.weight": T.Q5_K,
             "blk.0.ffn_up.weight": T.Q2_K, "blk.0.ffn_gate.weight": T.Q3_K, "blk.0.ffn_down.weight": T.Q5_0,
             "blk.1.attn_q.weight": T.Q5_1, "blk.1.attn_k.weight": T.Q4_0, "blk.1.attn_v.weight": T.BF16}
    qtypes = {}
    for name, kind in kinds.items():
        if kind in _K_SCALES:
            qtypes[name] = lambda x, kind=kind: (_random_blocks(kind, x.shape[0], x.shape[1], _K_SCALES[kind]), kind)
        else:
            qtypes[name] = kind
    path, _ = write_gguf("llama3", tmp_path, qtype=T.Q8_0, qtypes=qtypes,
                         overrides={"hidden_size": 256, "intermediate_size": 256})
    covered = {k.name for k in kinds.values()} | {"F32", "Q8_0"}
    assert covered | {"F16", "Q4_1"} == set(SUPPORTED_TENSOR_TYPES)  # F16 and Q4_1 are covered above
    _check_logits(path)


def test_llama3_rope_freqs_become_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3.1 RoPE scaling as a rope_freqs tensor: logits at far positions equal the
    HF model's (with rope_scaling llama3), and differ from unscaled RoPE."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    path, hf = write_gguf("llama3.1", tmp_path, overrides={"rope_scaling": rope, "max_position_embeddings": 8192})
    model = kvjax.load_model(path)
    cfg = model.config
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position) == ("llama3", 8.0, 8192)
    ids = RNG.randint(3, cfg.vocab_size, 12).tolist()
    positions = np.arange(6000, 6000 + len(ids))
    with torch.no_grad():
        want = hf(torch.tensor([ids]), position_ids=torch.from_numpy(positions[None])).logits[0].numpy()

    def ours(c):
        return np.asarray(_extend(model.params, c, None, jnp.asarray([ids]), jnp.asarray([positions]), fresh=True)[0][0])

    err = np.abs(ours(cfg) - want).max()
    assert err < 1e-5 * np.abs(want).max()
    # random tiny weights attend almost uniformly, so RoPE moves logits little; but far more than the error
    unscaled = dataclasses.replace(cfg, rope_type="default")
    assert np.abs(ours(unscaled) - want).max() > 20 * err


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp: rows (j, j + D/2) of each head -> adjacent rows (2j, 2j + 1)
    heads, D = 3, 8
    w = np.arange(heads * D * 2).reshape(heads * D, 2)
    permuted = w.reshape(heads, 2, D // 2, 2).swapaxes(1, 2).reshape(w.shape)
    assert permuted[1, 0] == w[D // 2, 0]  # row 1 of head 0 holds the second half's first row
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)


@pytest.mark.parametrize("family,add_bos", [("llama3", True), ("qwen2", False)])
def test_tiny_tokenizer_matches_transformers(tmp_path, family, add_bos):
    path, _ = write_gguf(family, tmp_path, add_bos=add_bos)
    ours = kvjax.load_model(path).tokenizer
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert (ours("hello")["input_ids"][0] == 1) == add_bos
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours("<|im_start|>")["input_ids"][-1] == SPECIALS.index("<|im_start|>")  # control tokens stay whole
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_sentencepiece_vocabulary_goes_through_transformers(tmp_path):
    """tokenizer.ggml.model "llama" (SentencePiece): built by transformers' own GGUF conversion."""
    path, _ = write_gguf("llama2", tmp_path, spm=True)
    ours = kvjax.load_model(path).tokenizer
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"] and ids[0] == 1, text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    spm_space = ours.convert_tokens_to_ids("\u2581")
    assert ours("\u2713")["input_ids"] == [1, spm_space] + [3 + b for b in "\u2713".encode()]  # byte fallback
    assert ours.decode(ours("The capital")["input_ids"], skip_special_tokens=True) == "The capital"


# ---- bad input ---------------------------------------------------------------------------------


def test_truncated_file_names_the_file(tmp_path):
    path, _ = write_gguf("llama3", tmp_path)
    data = path.read_bytes()
    for keep in (len(data) - 100, len(data) // 2, 200, 10):
        cut = tmp_path / f"cut_{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ValueError, match=f"(corrupt|truncated) .*{cut.name}"):
            kvjax.load_model(cut)


def test_not_a_gguf_and_missing_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        kvjax.load_model(bad)
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        kvjax.load_model(tmp_path / "absent.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    path, _ = write_gguf("llama3", tmp_path, arch="falcon")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'falcon'.*llama.*qwen2"):
        kvjax.load_model(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    iq4 = lambda x: (RNG.randint(0, 256, (x.shape[0], x.shape[1] // 32 * 18)).astype(np.uint8), T.IQ4_NL)
    path, _ = write_gguf("llama3", tmp_path, qtypes={"blk.1.ffn_up.weight": iq4})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*IQ4_NL.*supported types: \[.*Q4_K"):
        kvjax.load_model(path)


def test_unknown_tensor_type_id_is_named(tmp_path):
    path, _ = write_gguf("llama3", tmp_path)
    data = bytearray(path.read_bytes())
    # tensor info: name, n_dims u32, dims u64 x n_dims, type u32, offset u64
    at = data.index(b"blk.1.ffn_up.weight") + len(b"blk.1.ffn_up.weight")
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.gguf has a tensor of unknown type .*99.*supports \[.*Q6_K"):
        kvjax.load_model(path)


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    path, _ = write_gguf("llama3", tmp_path, pre="no-such-pre")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre='no-such-pre'.*smollm"):
        kvjax.load_model(path)
    assert kvjax.load_model(path, tokenizer=False).tokenizer is None  # the weights alone still load


# ---- the real fixture: SmolLM2-135M-Instruct, Q4_1 -------------------------------------------

FIXTURE = (pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "smollm2-135m-instruct"
           / "SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]


def require_fixture() -> None:
    """Skips where the fixture folder is absent, with a clear message; never in CI (there it fails)."""
    if not FIXTURE.exists():
        msg = f"the SmolLM2 GGUF fixture is absent ({FIXTURE.resolve()})"
        if os.environ.get("CI"):
            pytest.fail(msg + ": CI must have it")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def smollm():
    require_fixture()
    return kvjax.load_model(FIXTURE)


def test_fixture_config_and_chat_template(smollm):
    cfg = smollm.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (30, 9, 3, 64, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 1e5
    theirs = AutoTokenizer.from_pretrained(FIXTURE.parent, gguf_file=FIXTURE.name)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = smollm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert smollm.tokenizer(text)["input_ids"] == theirs(text)["input_ids"]
    # smollm's pre-tokenizer (llama.cpp) splits digits one by one
    digits = smollm.tokenizer("year 2048")["input_ids"]
    assert [smollm.tokenizer.decode([t]) for t in digits][-4:] == ["2", "0", "4", "8"]


@pytest.mark.slow
def test_fixture_greedy_answers_match_transformers(smollm):
    ref, theirs = _reference(FIXTURE)
    out = kvjax.generate(smollm, PROMPTS, chat_template=True, max_new_tokens=20)
    assert "Paris" in out.texts[0]
    for b, prompt in enumerate(PROMPTS):
        ids = theirs.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            hf = ref.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
        n = int(out.lengths[b])
        assert out.tokens[b, :n].tolist() == hf[:n], (prompt, out.texts[b], theirs.decode(hf))
        assert n == len(hf) or (n < len(hf) and hf[n - 1] == smollm.tokenizer.eos_token_id)


@pytest.mark.slow
def test_eval_cli_on_the_fixture(tmp_path):
    """`python -m kvjax.eval --model <file.gguf>`: RULER niah_single_1 at 2K with the full cache (about 96;
    about 2 minutes of CPU time, 4-6 minutes of wall time on 2 shared CPU cores)."""
    require_fixture()
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    cmd = [sys.executable, "-m", "kvjax.eval", "--model", str(FIXTURE), "--tasks", "niah_single_1", "--policies",
           "none", "--context-length", "2048", "--num-samples", "4", "--out", str(tmp_path / "out"), "--no-progress"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    summary = json.loads((tmp_path / "out" / "metrics.json").read_text())["summary"]
    [full] = [r for r in summary if r["task"] == "niah_single_1" and r["policy"] == "full"]
    assert full["n"] == 4 and full["score"] >= 75, summary
