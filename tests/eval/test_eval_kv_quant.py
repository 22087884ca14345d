"""`python -m kvjax.eval --kv-quant`: the storage axis (parsing, settings x storages, rows, resume of
an old folder, the kv_quant column, the score-vs-KV-bytes plot's data, reasons never dropped)."""

import csv
import json
import types

import numpy as np
import pytest

from kvjax.eval.cli import build_parser, main, resolve
from kvjax.eval.report import kv_bytes_points, plot_kv_bytes, summarize, write_reports, cache_by_setting
from kvjax.eval.runner import ResultStore, make_settings, run, storage_name
from kvjax.kv_quant import PRESETS

POLICIES = ["h2o", "snapkv"]
ENTRY16 = {"none": 1024, "int8": 520, "int4": 300}  # fake key+value bytes per kept entry at 16 bits


def _resolve(argv):
    parser = build_parser()
    return resolve(parser.parse_args(argv), parser, POLICIES)


def test_kv_quant_option_parses_spaces_and_commas_and_refuses_unknown_names(tmp_path, capsys):
    assert _resolve([])["kv_quant"] == ["none"]
    assert _resolve(["--kv-quant", "none,int8", "int4", "int8"])["kv_quant"] == ["none", "int8", "int4"]
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("kv_quant: int4,int2_kivi\n")  # a config file may give one comma-separated string
    assert _resolve(["--config", str(cfg_path)])["kv_quant"] == ["int4", "int2_kivi"]
    cfg_path.write_text("kv_quant: [none, fp8]\n")
    assert _resolve(["--config", str(cfg_path)])["kv_quant"] == ["none", "fp8"]
    assert _resolve(["--config", str(cfg_path), "--kv-quant", "int8"])["kv_quant"] == ["int8"]  # command line wins
    with pytest.raises(SystemExit) as exit_info:
        _resolve(["--kv-quant", "int4", "int3", "int16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-quant" in err and "unknown storage(s) 'int3', 'int16'" in err
    assert "accepted: none, " + ", ".join(PRESETS) in err
    cfg_path.write_text("kv_quant: []\n")
    with pytest.raises(SystemExit):
        _resolve(["--config", str(cfg_path)])
    assert "needs at least one storage" in capsys.readouterr().err


def test_every_setting_runs_at_every_storage():
    settings = make_settings(["snap", "h2o"], [0.5, 0.75], [64], kv_quant=["none", "int8", "int4"])
    assert len(settings) == 3 * (1 + 2 * (2 + 1))
    cells = [(st.policy_name, st.compression_ratio, st.budget, storage_name(st)) for st in settings]
    assert len(set(cells)) == len(cells)  # no setting twice
    assert cells[:3] == [("full", None, None, q) for q in ("none", "int8", "int4")]  # the baselines first
    for q in ("none", "int8", "int4"):
        for p in ("snap", "h2o"):
            assert {(r, b) for pp, r, b, qq in cells if (pp, qq) == (p, q)} == {(0.5, None), (0.75, None), (None, 64)}
    labels = {st.label for st in settings}
    assert {"full", "full int8", "r=0.5 int4", "C=64 int8", "r=0.75"} <= labels
    assert [st.label for st in make_settings(["snap", "h2o"], [0.5], [64])] == ["full", "r=0.5", "r=0.5", "C=64",
                                                                               "C=64"]  # as before without storages
    with pytest.raises(ValueError, match="kv_quant"):
        make_settings(["snap"], [0.5], kv_quant=["int3"])


class FakeQuantModel:
    """A generate_fn that knows storages: right with the full cache at none / int8, wrong at int4 (or when
    compressed); stats like the engine's, with key/value bytes at 16 bits per storage."""

    def __init__(self, with_bytes16=True):
        self.calls = []
        self.with_bytes16 = with_bytes16

    def __call__(self, samples, *, policy, compression_ratio, budget, query_aware, kv_quant=None):
        q = "none" if kv_quant is None else kv_quant.name
        self.calls.append((policy, compression_ratio, q))
        kept = 100.0 * (1 - (compression_ratio or 0.0))
        out = []
        for s in samples:
            right = policy is None and q != "int4"
            stats = {"kept": kept, "kept_mean": kept, "kept_peak": kept + 1, "kv_bytes_mean": int(kept * 1024),
                     "kv_bytes_peak": int((kept + 1) * 1024), "budget": None if policy is None else int(kept),
                     "budget_reached": None if policy is None else True}
            if self.with_bytes16:
                stats.update(kv_bytes16_mean=int(kept * ENTRY16[q]), kv_bytes16_peak=int((kept + 1) * ENTRY16[q]))
            out.append({"text": " ".join(s["answers"]) if right else "?", **stats})
        return out


def _argv(tmp_path, *storages):
    return ["--tasks", "vt", "--num-samples", "2", "--policies", "snapkv", "--compression-ratios", "0.5",
            "--out", str(tmp_path), "--no-progress", "--kv-quant", *storages]


def test_rows_table_csv_and_metrics_carry_the_storage(tok, tmp_path, capsys):
    fake = FakeQuantModel()
    assert main(_argv(tmp_path, "none", "int8", "int4"), generate_fn=fake, tokenizer=tok, policies=POLICIES) == 0
    assert set(fake.calls) == ({(None, None, q) for q in ("none", "int8", "int4")}
                               | {("snapkv", 0.5, q) for q in ("none", "int8", "int4")})
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 6
    assert {(r["setting"], r["kv_quant"]) for r in rows} == {
        ("full", "none"), ("full int8", "int8"), ("full int4", "int4"), ("r=0.5", "none"), ("r=0.5 int8", "int8"),
        ("r=0.5 int4", "int4")}
    assert all(r["stats"]["kv_bytes16_mean"] == int(r["stats"]["kept"] * ENTRY16[r["kv_quant"]]) for r in rows)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:4] == ["policy", "setting", "kv_quant", "vt"]
    assert printed.splitlines()[0].split()[-1] == "kv_bytes"
    md = (tmp_path / "results.md").read_text()
    # the storage in its own column (not repeated in the setting), and the bytes at 16 bits in MiB
    assert "| full | full | int4 | 0.00 | 0.00 | 100.00 | 101.00 | 0.098 | 0.029 |" in md  # 100 x 300 B
    assert "| snapkv | r=0.5 | int8 | 0.00 | 0.00 | 50.00 | 51.00 | 0.049 | 0.025 |" in md  # 50 x 520 B
    assert "![score vs KV bytes](score_vs_kv_bytes.png)" in md
    with (tmp_path / "results.csv").open() as f:
        by_setting = {r["setting"]: r for r in csv.DictReader(f)}
    assert by_setting["full int8"]["kv_quant"] == "int8" and by_setting["full"]["kv_quant"] == "none"
    assert float(by_setting["full int8"]["score"]) == 100.0 and float(by_setting["full int4"]["score"]) == 0.0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["table"]["header"] == ["policy", "setting", "kv_quant", "vt", "avg"]
    assert ["full", "full int8", "int8", 100.0, 100.0] in metrics["table"]["rows"]
    assert {(s["setting"], s["kv_quant"]) for s in metrics["summary"]} >= {("r=0.5 int4", "int4"), ("full", "none")}
    cache = {c["setting"]: c for c in metrics["cache"]}
    assert cache["r=0.5 int4"]["kv_quant"] == "int4" and cache["r=0.5 int4"]["kv_bytes16_mean"] == 50 * 300
    lines = {(ln["policy"], ln["kv_quant"]): [(p["x"], p["score"]) for p in ln["points"]]
             for ln in metrics["kv_bytes_plot"]["lines"]}
    assert lines[("full", "int8")] == [(100 * 520 / 2**20, 100.0)]
    assert lines[("snapkv", "int4")] == [(50 * 300 / 2**20, 0.0)]
    assert (tmp_path / "score_vs_kv_bytes.png").read_bytes()[:4] == b"\x89PNG"


def test_an_old_folder_resumes_its_rows_read_as_storage_none(tok, tmp_path):
    """Rows written before the storage axis (no kv_quant field, no 16-bit bytes) are the "none" storage:
    resumed, not recomputed; the new storage runs; the bytes plot leaves the old settings out, saying so."""
    old = FakeQuantModel(with_bytes16=False)

    def old_generate_fn(samples, *, policy, compression_ratio, budget, query_aware):  # the signature before
        return old(samples, policy=policy, compression_ratio=compression_ratio, budget=budget,
                   query_aware=query_aware)

    argv = _argv(tmp_path, "none")[:-2]  # as an older kvjax ran it: no --kv-quant
    assert main(argv, generate_fn=old_generate_fn, tokenizer=tok, policies=POLICIES) == 0
    path = tmp_path / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "kv_quant"}) + "\n" for r in rows))
    config = json.loads((tmp_path / "run_config.json").read_text())
    config.pop("kv_quant")
    (tmp_path / "run_config.json").write_text(json.dumps(config))
    assert all(r["kv_quant"] == "none" for r in ResultStore(path).rows.values())

    new = FakeQuantModel()
    assert main(argv + ["--kv-quant", "none", "int8"], generate_fn=new, tokenizer=tok, policies=POLICIES) == 0
    assert set(new.calls) == {(None, None, "int8"), ("snapkv", 0.5, "int8")}  # the old rows are kept
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert ["full", "full", "none", 100.0, 100.0] in metrics["table"]["rows"]
    plot = metrics["kv_bytes_plot"]
    assert {(ln["policy"], ln["kv_quant"]) for ln in plot["lines"]} == {("full", "int8"), ("snapkv", "int8")}
    assert plot["left_out"] == [{"policy": "full", "setting": "full"}, {"policy": "snapkv", "setting": "r=0.5"}]
    md = (tmp_path / "results.md").read_text()
    assert "Left out of score_vs_kv_bytes.png" in md and "full full, snapkv r=0.5" in md


def _row(st, i, score, kept, bytes16):
    stats = {"kept": kept, "kept_mean": kept, "kept_peak": kept, "kv_bytes_mean": int(kept * 1024),
             "kv_bytes_peak": int(kept * 1024), "budget": None, "budget_reached": None}
    if bytes16 is not None:
        stats["kv_bytes16_mean"] = bytes16
    return {"task": "vt", "policy": st.policy_name, "setting": st.label, "kv_quant": storage_name(st),
            "sample_id": f"vt/{i}", "prediction": "x", "score": score, "metrics": {}, "stats": stats}


def test_kv_bytes_plot_draws_one_line_per_policy_and_storage(tmp_path):
    settings = make_settings(["snap", "h2o"], [0.25, 0.5, 0.75], kv_quant=["none", "int4"])
    mib = 2**20
    rows = []
    for st in settings:
        r = st.compression_ratio or 0.0
        q = storage_name(st)
        x = (1 - r) * (4 if q == "none" else 1) * mib  # int4 at a quarter of the bytes
        score = (1 - r) * (1.0 if st.policy_name != "h2o" else 0.5) * (1.0 if q == "none" else 0.5)
        rows += [_row(st, i, score, 100 * (1 - r), x) for i in range(2)]
    summary = summarize(rows, ["vt"], settings)
    cache = cache_by_setting(rows, settings)
    points, left_out = kv_bytes_points(summary, ["vt"], settings, cache)
    assert left_out == []
    assert set(points) == {(p, q) for p in ("full", "snap", "h2o") for q in ("none", "int4")}
    assert [p["label"] for p in points[("snap", "int4")]] == ["r=0.75", "r=0.5", "r=0.25"]  # sorted by bytes
    fig = plot_kv_bytes(tmp_path / "p.png", points)
    ax = fig.axes[0]
    drawn = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()
             if not ln.get_label().startswith("_")}
    assert set(drawn) == {"snap none", "snap int4", "h2o none", "h2o int4", "full none", "full int4"}
    assert drawn["h2o int4"] == ([0.25, 0.5, 0.75], [6.25, 12.5, 18.75])  # MiB per sample, avg score
    assert drawn["snap none"] == ([1.0, 2.0, 3.0], [25.0, 50.0, 75.0])
    assert drawn["full int4"] == ([1.0], [50.0]) and drawn["full none"] == ([4.0], [100.0])
    full_int4 = next(ln for ln in ax.get_lines() if ln.get_label() == "full int4")
    assert full_int4.get_linestyle() == "None"  # a marker, not a line
    assert ax.get_xscale() == "log"
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert plot_kv_bytes(tmp_path / "q.png", {}) is None and not (tmp_path / "q.png").exists()


def test_no_bytes_no_plot_and_the_report_says_why(tmp_path):
    settings = make_settings(["snap"], [0.5], kv_quant=["none", "int8"])
    rows = [_row(st, 0, 1.0, 50.0, None) for st in settings]
    result = write_reports(tmp_path, rows, ["vt"], settings, echo=False)
    assert not result["kv_plot"] and not (tmp_path / "score_vs_kv_bytes.png").exists()
    assert "score_vs_kv_bytes.png not drawn" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "metrics.json").read_text())["kv_bytes_plot"] is None
    assert "kv_bytes" not in result["header"]  # no 16-bit bytes: no column either


def test_every_reason_a_setting_did_not_run_is_listed(tmp_path, capsys):
    """A quantized setting refused by its policy on the generation tasks and by the fidelity task (no
    quantized teacher forcing) shows both reasons, each with its tasks."""
    settings = make_settings(["streaming_llm"], [0.5], kv_quant=["none", "int4"])
    samples = {"vt": [{"id": f"vt/{i}", "answers": ["a"], "max_new_tokens": 4} for i in range(2)],
               "fidelity": [{"id": f"fidelity/{i}", "answers": [], "metadata": {}} for i in range(2)]}
    logits_calls = []

    def logits_fn(batch, *, policy, compression_ratio, budget):
        logits_calls.append(policy)
        return [np.log(np.array([[0.5, 0.5]])) for _ in batch]

    def generate_fn(samples, *, policy, compression_ratio, budget, query_aware):
        return ["a" for _ in samples]

    def many(samples, *, settings, query_aware):
        return [ValueError(f"rope_mode refused {st.label}") if st.kv_quant is not None and st.policy is not None
                else generate_fn(samples, policy=st.policy, compression_ratio=st.compression_ratio, budget=st.budget,
                                 query_aware=query_aware) for st in settings]

    generate_fn.many = many
    with pytest.warns(UserWarning, match="not run"):
        rows = run(samples, settings, tmp_path, metrics={"vt": "string_match_all", "fidelity": "fidelity"},
                   generate_fn=generate_fn, logits_fn=logits_fn, progress=False)
    assert logits_calls == [None, "streaming_llm"]  # never asked for a quantized setting
    fid = [r for r in rows if r["task"] == "fidelity" and r["kv_quant"] == "int4"]
    assert len(fid) == 4 and all(r["score"] is None and "continuation_logits" in r["error"] for r in fid)
    write_reports(tmp_path, rows, ["vt", "fidelity"], settings, echo=True)
    md = (tmp_path / "results.md").read_text()
    assert "- **streaming_llm r=0.5 int4 (vt)**: rope_mode refused r=0.5 int4" in md
    assert "full full int4 (fidelity); streaming_llm r=0.5 int4 (fidelity)**: the fidelity task" in md
    printed = capsys.readouterr().out
    assert "streaming_llm r=0.5 int4 (vt): not run: rope_mode refused" in printed


def test_engine_cache_stats_record_the_16_bit_bytes():
    from kvjax.eval.engine import cache_stats

    out = types.SimpleNamespace(kept_peak=np.array([3.0]), kept_mean=np.array([2.5]), kv_bytes_peak=np.array([300]),
                                kv_bytes_mean=np.array([250.0]), kv_bytes16_peak=np.array([90]),
                                kv_bytes16_mean=np.array([80.4]), budget=None, budget_reached=None)
    stats = cache_stats(out, 0)
    assert stats["kv_bytes16_mean"] == 80 and stats["kv_bytes16_peak"] == 90 and stats["kv_bytes_mean"] == 250


def test_a_cache_relative_policy_is_refused_a_quantized_cache_by_name():
    """StreamingLLM's paper preset re-rotates keys at their cache rank every step, which a quantized cache
    cannot do: the engine refuses it at planning (before any prefill), so the eval records the reason."""
    import jax

    from kvjax.engine import Setting, generate_settings
    from kvjax.models.config import ModelConfig
    from kvjax.models.export import init_params
    from kvjax.models.model import Model

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=256)
    model = Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0)))
    out = generate_settings(model, [list(range(1, 60))], [Setting("streaming_llm", 0.5, kv_quant="int4")],
                            max_new_tokens=2, on_error="return")
    assert isinstance(out[0], ValueError)
    assert "kv_quant='int4'" in str(out[0]) and "cache_relative" in str(out[0]) and "streaming_llm" in str(out[0])
