"""`python -m kvjax.eval --lookahead PATH`: lookahead_kv runs with that adapter; without one, 'all' leaves it out."""

import jax
import pytest

import kvjax.lookahead as lk
from kvjax.eval.cli import build_parser, main, resolve
from kvjax.policies import LookaheadKV

POLICIES = ["lookahead_kv", "snapkv"]


@pytest.fixture(scope="module")
def tok():
    from kvjax.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


def _resolve(argv):
    parser = build_parser()
    return resolve(parser.parse_args(argv), parser, POLICIES)


@pytest.fixture
def no_bundled(monkeypatch, tmp_path):
    monkeypatch.setattr(lk.adapter, "BUNDLED", tmp_path / "absent")


def test_all_leaves_lookahead_out_without_an_adapter(no_bundled, tiny, tmp_path, capsys):
    assert _resolve([])["policies"] == ["snapkv"]
    folder = lk.save(lk.init_adapter(tiny, lk.LookaheadConfig(n_tokens=2, rank=2), jax.random.PRNGKey(0)),
                     tmp_path / "ad")
    assert _resolve(["--lookahead", str(folder)])["policies"] == POLICIES
    with pytest.raises(SystemExit):  # asked for by name, with no adapter anywhere: a clear error
        main(["--policies", "lookahead_kv", "--tasks", "vt", "--out", str(tmp_path / "o")],
             generate_fn=lambda *a, **k: [], policies=POLICIES)
    assert "no bundled LookaheadKV adapter" in capsys.readouterr().err


def test_lookahead_flag_passes_the_adapter(tiny, tok, tmp_path):
    adapter = lk.init_adapter(tiny, lk.LookaheadConfig(n_tokens=2, rank=2), jax.random.PRNGKey(0))
    folder = lk.save(adapter, tmp_path / "ad")
    seen = []

    def fake(samples, *, policy, compression_ratio, budget, query_aware):
        seen.append(policy)
        return ["?" for _ in samples]

    argv = ["--tasks", "vt", "--num-samples", "1", "--compression-ratios", "0.5", "--policies", "lookahead_kv",
            "--lookahead", str(folder), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv, generate_fn=fake, tokenizer=tok, policies=POLICIES) == 0
    used = [p for p in seen if p is not None]
    assert used and all(isinstance(p, LookaheadKV) and p.name == "lookahead_kv" for p in used)
    assert used[0].lookahead_adapter().config == adapter.config
    assert "lookahead_kv" in (tmp_path / "out" / "results.md").read_text()
