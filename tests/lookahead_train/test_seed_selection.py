"""eval/lookahead_ablations/seed_selection.py's decode-free probes: the answer's log-likelihood after a context
equals transformers' on the whole sequence, and the fidelity probe is the eval's KL against the full cache."""

import importlib.util
import pathlib

import numpy as np
import pytest
import torch
import transformers

import kvjax
from kvjax.eval.metrics import kl_divergence

PATH = pathlib.Path(__file__).resolve().parents[2] / "eval" / "lookahead_ablations" / "seed_selection.py"
_rng = np.random.default_rng(0)
CONTEXTS = [[1, *_rng.integers(3, 500, n).tolist()] for n in (90, 75)]
RESTS = [[13, 14, 15], [301, 302]]
ANSWERS = [[60, 61, 62, 63], [7]]


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("seed_selection", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


def test_answer_logprob_equals_transformers_on_the_whole_sequence(probe, stories, stories_path):
    hf = transformers.LlamaForCausalLM.from_pretrained(stories_path).eval()
    got = probe.answer_logprob(stories, CONTEXTS, RESTS, ANSWERS)
    for g, c, r, a in zip(got, CONTEXTS, RESTS, ANSWERS):
        seq = c + r + a
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()
        start = len(c) + len(r)  # the first answer token, predicted at the position before it
        ref = np.mean([logp[start + i - 1, t] for i, t in enumerate(a)])
        np.testing.assert_allclose(g, ref, atol=2e-3)
    # a compressed context loses likelihood on some answer (never gains on all, for a model that reads its context)
    kept = probe.answer_logprob(stories, CONTEXTS, RESTS, ANSWERS, policy="knorm_kvpress", compression_ratio=0.5)
    assert kept.shape == got.shape and not np.allclose(kept, got, atol=1e-4)


def test_fidelity_probe_is_the_eval_kl_against_the_full_cache(probe, stories):
    full = kvjax.engine.continuation_logits(stories, CONTEXTS, RESTS)
    assert np.allclose(probe.fidelity(stories, CONTEXTS, RESTS, full, policy=None, compression_ratio=None), 0,
                       atol=1e-6)
    got = probe.fidelity(stories, CONTEXTS, RESTS, full, policy="knorm_kvpress", compression_ratio=0.5)
    comp = kvjax.engine.continuation_logits(stories, CONTEXTS, RESTS, policy="knorm_kvpress", compression_ratio=0.5)
    np.testing.assert_allclose(got, [kl_divergence(f, c) for f, c in zip(full, comp)], rtol=1e-9)
    assert (got > 0).all()
