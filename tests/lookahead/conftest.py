"""A tiny random GQA Llama (8 query heads over 2 KV heads) and LookaheadKV adapters for it."""

import jax
import numpy as np
import pytest
from tiny_models import build_hf

import kvjax
import kvjax.lookahead as lk


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lkv_llama3")
    build_hf("llama3", folder)
    return kvjax.load_model(folder)


def with_random_b(adapter, seed=3, scale=0.3):
    """The adapter with every LoRA B drawn at random (so the LoRA really changes the lookahead rows)."""
    key = jax.random.PRNGKey(seed)
    lora = {}
    for p, f in adapter.params["lora"].items():
        key, k = jax.random.split(key)
        lora[p] = {"a": f["a"], "b": scale * jax.random.normal(k, f["b"].shape)}
    return adapter.replace(params={"embeddings": adapter.params["embeddings"], "lora": lora})


@pytest.fixture(scope="session")
def adapter(tiny):
    conf = lk.LookaheadConfig(n_tokens=4, rank=2)
    return with_random_b(lk.init_adapter(tiny, conf, jax.random.PRNGKey(1)))


def prompts(vocab, lengths, width, seed=0):
    """Right-padded random prompts: rows (lists), tokens and positions [B, width] (-1 on padding)."""
    rng = np.random.RandomState(seed)
    rows = [list(rng.randint(3, vocab, t)) for t in lengths]
    toks = np.zeros((len(lengths), width), np.int32)
    pos = -np.ones((len(lengths), width), np.int32)
    for b, r in enumerate(rows):
        toks[b, : len(r)] = r
        pos[b, : len(r)] = np.arange(len(r))
    return rows, toks, pos
