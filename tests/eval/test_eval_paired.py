"""Paired comparison with the full cache (kvjax.eval.paired), its section of the report, and the table
tool of eval/smollm2_ruler_2k: synthetic rows, no model."""

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from kvjax.eval import paired
from kvjax.eval.report import write_reports
from kvjax.eval.runner import make_settings

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _row(policy, setting, task, i, score, tokens=10, **extra):
    return {"task": task, "policy": policy, "setting": setting, "sample_id": f"{task}/{i}", "query_aware": False,
            "prediction": "x", "answers": ["x"], "score": score, "metrics": {},
            "stats": {} if tokens is None else {"generated_tokens": tokens}, "seconds": 1.0, **extra}


def _rows(policy, setting, scores, tokens=None):
    """scores: task -> per-sample scores (sample i of each task); tokens likewise (default 10)."""
    return [_row(policy, setting, t, i, s, 10 if tokens is None else tokens[t][i])
            for t, ss in scores.items() for i, s in enumerate(ss)]


def test_paired_mean_and_se_match_numpy_and_pair_only_common_samples():
    rng = np.random.default_rng(0)
    sizes = {"a": 5, "b": 3, "c": 8}
    full = {t: rng.integers(0, 2, n).astype(float) for t, n in sizes.items()}
    pol = {t: rng.choice([0.0, 0.25, 0.5, 1.0], n) for t, n in sizes.items()}
    rows = _rows("snapkv", "r=0.5", {t: list(v) for t, v in pol.items()})
    rows.append(_row("snapkv", "r=0.5", "a", 99, 1.0))  # no full-cache row: not paired
    p = paired.pair(rows, _rows("full", "full", {t: list(v) for t, v in full.items()}))

    def strat(by_task):  # mean over tasks of task means; s.e. = sqrt(sum var_t / n_t) / T
        mean = np.mean([np.mean(v) for v in by_task.values()])
        se = np.sqrt(sum(np.var(v, ddof=1) / len(v) for v in by_task.values())) / len(by_task)
        return 100 * mean, 100 * se

    assert p.n == sum(sizes.values()) and p.tasks == 3
    np.testing.assert_allclose([p.score, p.score_se], strat(pol), rtol=1e-12)
    np.testing.assert_allclose([p.full, p.full_se], strat(full), rtol=1e-12)
    np.testing.assert_allclose([p.diff, p.diff_se], strat({t: pol[t] - full[t] for t in sizes}), rtol=1e-12)
    # the paired s.e. is not the unpaired one: the two score vectors are correlated through the tasks
    assert p.diff_se != pytest.approx(np.hypot(p.score_se, p.full_se))
    # one sample in a task: no s.e.
    assert paired.task_mean_se({"a": [1.0, 0.0], "b": [1.0]}) == (0.75, None)


def test_regressions_and_improvements_on_obvious_rows():
    full = {"t": [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]}
    pol = {"t": [0.0, 1.0, 1.0, 0.0, 0.25, 0.5]}
    p = paired.pair(_rows("tova", "r=0.5", pol), _rows("full", "full", full))
    assert (p.regressions, p.improvements) == (2, 1)  # samples 0 and 4 lost, 2 gained; 0.5 counts as right
    strict = paired.pair(_rows("tova", "r=0.5", pol), _rows("full", "full", full), right_at=1.0)
    assert (strict.regressions, strict.improvements) == (3, 1)  # sample 5 (1 -> 0.5) is lost too


def test_length_drift_over_samples_with_token_counts():
    full = _rows("full", "full", {"t": [1.0, 1.0, 1.0]}, tokens={"t": [10, 10, 10]})
    pol = _rows("h2o", "r=0.5", {"t": [1.0, 1.0, 1.0]}, tokens={"t": [10, 20, 30]})
    p = paired.pair(pol, full)
    assert (p.tokens, p.full_tokens, p.drift, p.drift_ratio) == (20.0, 10.0, 10.0, 2.0)
    pol[2]["stats"] = {}  # no count for sample 2: left out of both means
    p = paired.pair(pol, full)
    assert (p.tokens, p.full_tokens, p.drift, p.drift_ratio) == (15.0, 10.0, 5.0, 1.5)
    assert p.n == 3 and paired.drift_text(p) == "+5.0 (x1.50)"


def test_dedupe_keeps_the_last_row():
    rows = [_row("snapkv", "r=0.5", "t", 0, 0.0), _row("snapkv", "r=0.5", "t", 1, 1.0),
            _row("snapkv", "r=0.75", "t", 0, 0.0), _row("snapkv", "r=0.5", "t", 0, 1.0),
            _row("snapkv", "r=0.5", "t", 1, 1.0)]
    kept, dropped, differ = paired.dedupe(rows)
    assert (len(kept), dropped, differ) == (3, 2, 1)
    assert {(r["setting"], r["sample_id"]): r["score"] for r in kept}[("r=0.5", "t/0")] == 1.0


def _run_rows():
    scores = {"t1": [1.0, 0.0], "t2": [1.0, 1.0]}
    rows = _rows("full", "full", scores) + _rows("snapkv", "r=0.5", scores)
    rows += [r for r in _rows("tova", "r=0.5", scores) if r["sample_id"] != "t1/1"]
    rows += [r for r in _rows("h2o", "r=0.5", scores) if r["task"] != "t2"]
    rows += [{**r, "score": None, "prediction": None, "error": "budget below the window"}
             for r in _rows("lazy_eviction", "r=0.5", scores)]
    return rows


def test_compare_refuses_settings_missing_samples_unless_partial():
    rows = _run_rows()
    with pytest.raises(paired.IncompleteError) as err:
        paired.compare(rows)
    msg = str(err.value)
    assert "tova r=0.5: t1 1 of 2 missing (t1/1)" in msg and "h2o r=0.5: t2 absent (2 samples)" in msg
    assert "snapkv" not in msg and "lazy_eviction" not in msg  # complete, and refused: not missing
    st = {s.key: s for s in paired.compare(rows, partial=True)}
    assert st[("tova", "r=0.5")].state == "incomplete" and st[("tova", "r=0.5")].paired is None
    assert st[("lazy_eviction", "r=0.5")].state == "refused"
    assert st[("lazy_eviction", "r=0.5")].reasons == {"budget below the window": ["t1", "t2"]}
    assert st[("snapkv", "r=0.5")].paired.diff == 0.0 and st[("snapkv", "r=0.5")].paired.n == 4
    # a quantized setting pairs with the full cache at its storage
    quant = [{**r, "setting": r["setting"] + " int4", "kv_quant": "int4", "score": 0.0}
             for r in rows if r["policy"] in ("full", "snapkv")]
    st = {s.key: s for s in paired.compare([r for r in rows if r["policy"] in ("full", "snapkv")] + quant)}
    assert st[("snapkv", "r=0.5 int4")].paired.baseline == "full int4"
    assert st[("snapkv", "r=0.5 int4")].paired.diff == 0.0 and st[("snapkv", "r=0.5")].paired.baseline == "full"
    # fewer samples than asked for: every setting lacks them, the full cache too; a configured setting
    # without rows lacks everything
    with pytest.raises(paired.IncompleteError, match=r"full full: t1 1 of 3 missing \(t1/2\)"):
        paired.compare([r for r in rows if r["policy"] in ("full", "snapkv")], num_samples=3)
    with pytest.raises(paired.IncompleteError, match=r"knorm r=0\.5: t1 absent \(2 samples\); t2 absent"):
        paired.compare([r for r in rows if r["policy"] in ("full", "snapkv")], settings=[("knorm", "r=0.5")])


def test_report_has_the_paired_section(tmp_path):
    settings = make_settings(["snapkv"], [0.5])
    rows = _rows("full", "full", {"vt": [1.0, 1.0, 0.0]}) + _rows("snapkv", "r=0.5", {"vt": [0.0, 1.0, 1.0]})
    write_reports(tmp_path, rows, ["vt"], settings, echo=False)
    md = (tmp_path / "results.md").read_text()
    assert "## Paired against the full cache" in md
    assert "| snapkv | r=0.5 | 3 | 66.7 ± 33.3 | +0.0 ± 57.7 | 1 | 1 | +0.0 (x1.00) |" in md
    rec = json.loads((tmp_path / "metrics.json").read_text())["paired"]
    assert [(r["policy"], r["regressions"], r["improvements"]) for r in rec] == [("snapkv", 1, 1)]


def _table_module():
    spec = importlib.util.spec_from_file_location("ruler_table", ROOT / "eval/smollm2_ruler_2k/table.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(mod)
    return mod


def _folder(path, rows, policies, aware=False):
    path.mkdir(parents=True)
    (path / "results.jsonl").write_text("".join(json.dumps({**r, "query_aware": aware}) + "\n" for r in rows)
                                        + '{"task": "t1", "truncated')  # a run still writing
    (path / "run_config.json").write_text(json.dumps({"model": "m/Tiny.gguf", "context_length": 2048,
                                                      "tasks": ["t1", "t2", "qa_1"], "policies": policies,
                                                      "compression_ratios": [0.5], "num_samples": 2}))
    return str(path)


def test_table_refuses_incomplete_settings_and_partial_marks_them(tmp_path):
    table = _table_module()
    scores = {"t1": [1.0, 0.0], "t2": [1.0, 1.0]}
    first = _folder(tmp_path / "a", _rows("full", "full", scores) + _rows("snapkv", "r=0.5", scores)
                    + _rows("knorm", "r=0.5", {"t1": [0.0, 0.0]}), ["snapkv", "knorm"])
    # a later folder reruns snapkv's t2 (its rows win) and runs streaming_llm
    second = _folder(tmp_path / "b", _rows("snapkv", "r=0.5", {"t2": [0.0, 0.0]})
                     + _rows("streaming_llm", "r=0.5", {"t1": [0.0, 1.0], "t2": [1.0, 1.0]}), ["streaming_llm"])
    aware = _folder(tmp_path / "c", _rows("full", "full", scores) + _rows("snapkv", "r=0.5", scores), ["snapkv"],
                    aware=True)
    out = tmp_path / "out" / "TABLE.md"
    args = ["--agnostic", first, second, "--aware", aware, "--ratios", "0.5", "--out", str(out)]
    with pytest.raises(paired.IncompleteError, match=r"--agnostic[\s\S]*knorm r=0\.5: t2 absent \(2 samples\)"):
        table.main(args)
    assert not out.exists()
    text = table.main([*args, "--partial"])
    assert out.read_text() == text and (tmp_path / "out" / "TABLE.png").read_bytes()[:4] == b"\x89PNG"
    score_table = text.split("## Against")[0]
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in score_table.splitlines() if ln.startswith("| ")}
    assert lines["knorm"].startswith("| knorm | incomplete (2/4) |")
    # snapkv agnostic: t1 [1, 0], t2 now [0, 0] -> 25.0; aware: 75.0; paired: 2 regressions in t2
    assert lines["snapkv"].startswith("| snapkv | 25.0 ± 25.0 | 75.0 ± 25.0 |")
    diff = next(ln for ln in text.split("## Against")[1].splitlines() if ln.startswith("| snapkv"))
    assert "2↓ 0↑" in diff and "-50.0 ± 0.0" in diff
    order = [ln.split(" | ")[0][2:] for ln in score_table.splitlines() if ln.startswith("| ")][1:]
    assert order == ["full", "streaming_llm", "snapkv", "knorm"]  # by mean score, the full cache first
    assert "2 duplicates dropped, 2 with another score" in text and "2 unreadable lines" in text
    assert "configured, no rows: qa_1" in text and "incomplete, t2 absent (2 samples): knorm (agnostic r=0.5)" in text
    with pytest.raises(ValueError, match="query-aware"):
        table.main(["--agnostic", aware, "--out", str(out)])


def test_table_kvquant_section_pairs_each_storage_with_its_unquantized_preset(tmp_path):
    """--kvquant: a quantized setting's score, its paired difference from the same preset unquantized and
    from the full cache (numpy, stratified by task), and its KV memory over the full cache's at 16 bits (an
    unquantized row recorded without kv_bytes16_mean: its model-dtype bytes scaled by the itemsize); a
    quantized setting missing samples is refused, named, unless --partial."""
    table = _table_module()

    def strat(by_task):  # mean over tasks, stratified s.e., as the table prints them
        means = [np.mean(v) for v in by_task]
        se = np.sqrt(sum(np.var(v, ddof=1) / len(v) for v in by_task)) / len(by_task)
        return table.paired.plus_minus(float(np.mean(means)), float(se), sign=True)

    def rows(policy, setting, scores, kv_bytes, kv16=None, quant=None):
        out = _rows(policy, setting, scores)
        for r in out:
            r["stats"] = {"generated_tokens": 10, "kv_bytes_mean": kv_bytes,
                          **({} if kv16 is None else {"kv_bytes16_mean": kv16})}
            if quant:
                r["kv_quant"] = quant
        return out

    full = {"t1": [1.0, 0.0], "t2": [1.0, 1.0]}
    snap = {"t1": [1.0, 0.0], "t2": [1.0, 0.0]}
    snap4 = {"t1": [0.0, 0.0], "t2": [1.0, 0.0]}
    # float32 model, rows without kv_bytes16: the full cache's 4000 bytes are 2000 at 16 bits
    plain = _folder(tmp_path / "a", rows("full", "full", full, 4000) + rows("snapkv", "r=0.5", snap, 2000), ["snapkv"])
    quant = rows("full", "full int4", full, 4000, 600, "int4") + rows("snapkv", "r=0.5 int4", snap4, 2000, 300, "int4")
    q = _folder(tmp_path / "q", quant, ["snapkv"])
    section = table.kvquant_section([q], table.build_part("agnostic", [plain], [0.5]), itemsize=4)
    split = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section if ln.startswith("| ")]
    cells = {(c[0], c[2]): c[3:] for c in split}
    x100 = {k: [100 * np.array(v) for v in d.values()] for k, d in (("full", full), ("snap", snap), ("snap4", snap4))}
    assert cells[("snapkv", "none")][:2] == ["0.500", strat(x100["snap"]).lstrip("+")]
    assert cells[("snapkv", "none")][3] == strat([a - b for a, b in zip(x100["snap"], x100["full"])])
    q4 = cells[("snapkv", "int4")]
    assert q4[0] == "0.150"  # 300 bytes of codes and scales over 2000 at 16 bits
    assert q4[1] == strat(x100["snap4"]).lstrip("+")
    assert q4[2] == strat([a - b for a, b in zip(x100["snap4"], x100["snap"])])
    assert q4[3] == strat([a - b for a, b in zip(x100["snap4"], x100["full"])])
    assert cells[("full", "int4")][0] == "0.300"
    out = tmp_path / "T.md"
    short = _folder(tmp_path / "q2", [r for r in quant if (r["policy"], r["sample_id"]) != ("snapkv", "t2/1")],
                    ["snapkv"])
    plain16 = _folder(tmp_path / "a16", rows("full", "full", full, 4000, 2000) + rows("snapkv", "r=0.5", snap, 2000, 1000),
                      ["snapkv"])  # recorded with kv_bytes16_mean: no model needed
    args = ["--agnostic", plain16, "--kvquant", short, "--ratios", "0.5", "--out", str(out)]
    with pytest.raises(paired.IncompleteError, match=r"--kvquant[\s\S]*snapkv r=0\.5 int4"):
        table.main(args)
    assert "incomplete (3/4)" in table.main([*args, "--partial"]).split("## Quantized KV storage")[1]


def _rounds_module():
    _table_module()  # rounds.py imports table.py from its folder
    spec = importlib.util.spec_from_file_location("ruler_rounds", ROOT / "eval/smollm2_ruler_2k/rounds.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rounds_rank_the_complete_presets_and_seed_only_theirs(tmp_path):
    rounds = _rounds_module()
    sc = lambda a, b: {"t1": a, "t2": b}  # noqa: E731
    reached = lambda rows, flag: [{**r, "stats": {**r["stats"], "budget_reached": flag}} for r in rows]  # noqa: E731
    rows = (_rows("full", "full", sc([1.0, 1.0], [1.0, 0.0]))
            # means over the two ratios: snapkv (75 + 50) / 2, tova (50 + 50) / 2 = 50, h2o 100 but never reached
            + _rows("snapkv", "r=0.5", sc([1.0, 1.0], [1.0, 0.0])) + _rows("snapkv", "r=0.75", sc([1.0, 0.0], [1.0, 0.0]))
            + _rows("tova", "r=0.5", sc([1.0, 0.0], [1.0, 0.0])) + _rows("tova", "r=0.75", sc([0.0, 1.0], [0.0, 1.0]))
            + reached(_rows("h2o", "r=0.5", sc([1.0, 1.0], [1.0, 1.0])), False)
            + reached(_rows("h2o", "r=0.75", sc([1.0, 1.0], [1.0, 1.0])), True)
            # knorm lacks r=0.75's t2: not ranked
            + _rows("knorm", "r=0.5", sc([1.0, 1.0], [1.0, 1.0])) + _rows("knorm", "r=0.75", {"t1": [1.0, 1.0]}))
    src = tmp_path / "src"
    src.mkdir()
    (src / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (src / "run_config.json").write_text(json.dumps({"tasks": ["t1", "t2"], "policies": ["snapkv", "tova", "h2o", "knorm"],
                                                     "compression_ratios": [0.5, 0.75], "num_samples": 2}))
    ranked, left_out = rounds.rank([str(src)])
    assert ranked == [("snapkv", 62.5), ("tova", 50.0)]
    assert set(left_out) == {"h2o", "knorm"} and "never came down" in left_out["h2o"]
    out = tmp_path / "round"
    assert rounds.seed(src, out, ["snapkv"]) == 12  # full 4 + snapkv 8
    assert rounds.seed(src, out, ["snapkv", "tova"]) == 8  # a re-seed adds only what is missing
    seeded = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({r["policy"] for r in seeded}) == ["full", "snapkv", "tova"] and len(seeded) == 20
    cmd = rounds.eval_command(src, out, ["snapkv", "tova"], ["--num-samples", "6"])
    assert cmd[cmd.index("--config") + 1] == str(src / "run_config.json")
    assert cmd[cmd.index("--policies") + 1:cmd.index("--out")] == ["snapkv", "tova"] and cmd[-2:] == ["--num-samples", "6"]
    with pytest.raises(SystemExit):  # more presets asked for than are complete
        rounds.main(["best", "--from", str(src), "--n", "3"])


def _goals_module():
    spec = importlib.util.spec_from_file_location("lookahead_goals", ROOT / "eval/lookahead_ablations/goals.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_lookahead_goals_pick_the_best_preset_and_judge_against_numpy(tmp_path, capsys):
    """Issue 27's goals: the best LookaheadKV preset (mean paired diff over both ratios) against KVzip, and the
    query-aware rows against the full cache at r=0.75; diffs and standard errors from NumPy, samples beyond --n
    and unpaired ones left out, verdicts from the goal and two standard errors."""
    goals = _goals_module()
    rng = np.random.default_rng(3)
    tasks = [f"t{j}" for j in range(11)]
    n = 8  # 88 samples: the floor
    kv = {(t, r): rng.integers(0, 2, n + 2).astype(float) for t in tasks for r in (0.5, 0.75)}
    ref, ood = [], []
    for (t, r), s in kv.items():
        ref += [_row("kvzip", f"r={r}", t, i, x, compression_ratio=r) for i, x in enumerate(s)]
    full_aware = {t: rng.integers(0, 2, n).astype(float) for t in tasks}
    ref += [_row("full", "full", t, i, x, compression_ratio=None, query_aware=True)
            for t in tasks for i, x in enumerate(full_aware[t])]
    want = {}
    for name, shift in (("lookahead_kv", 0.0), ("ada_lookahead_kv", 0.2)):  # ada's scores are higher
        for (t, r), s in kv.items():
            mine = np.clip(s[:n] + shift * rng.integers(0, 2, n), 0, 1)
            ood += [_row(name, f"r={r}", t, i, x, compression_ratio=r) for i, x in enumerate(mine)]
            want[(name, t, r)] = mine - s[:n]
    aware = {t: np.clip(full_aware[t] - 0.5 * rng.integers(0, 2, n), 0, 1) for t in tasks}
    ood += [_row("ada_lookahead_kv", "r=0.75", t, i, x, compression_ratio=0.75, query_aware=True)
            for t in tasks for i, x in enumerate(aware[t])]
    _write(tmp_path / "ood", ood)
    _write(tmp_path / "ref", ref)
    assert goals.main(["--ood", str(tmp_path / "ood"), "--reference", str(tmp_path / "ref"), "--n", str(n)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    assert [c[2] for c in cells] == ["ada_lookahead_kv"] * 3 and [c[6] for c in cells] == ["88"] * 3

    def expect(diffs, goal):
        d = np.array([100 * diffs[t] for t in tasks])  # [task, sample]
        mean = d.mean(axis=1).mean()
        se = np.sqrt((d.var(axis=1, ddof=1) / n).sum()) / len(tasks)
        verdict = "met" if mean >= goal else ("not met (within 2 s.e.)" if mean + 2 * se >= goal else "not met")
        return f"{mean:+.1f} ± {se:.1f}", verdict

    for c, r in zip(cells[:2], (0.5, 0.75)):
        assert (c[5], c[7]) == expect({t: want[("ada_lookahead_kv", t, r)] for t in tasks}, 0.0)
    assert (cells[2][5], cells[2][7]) == expect({t: aware[t] - full_aware[t] for t in tasks}, -3.0)
    # a preset far ahead on fewer samples than the floor does not outrank one with a verdict
    few = [_row("layer_lookahead_kv", f"r={r}", t, i, 1.0, compression_ratio=r)
           for t in tasks for r in (0.5, 0.75) for i in range(4)]
    _write(tmp_path / "few", few)
    goals.main(["--ood", str(tmp_path / "ood"), str(tmp_path / "few"), "--reference", str(tmp_path / "ref"),
                "--n", str(n)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| agnostic")]
    assert len(lines) == 2 and all("| ada_lookahead_kv |" in ln for ln in lines)
    # fewer samples than the floor: reported, no verdict
    goals.main(["--ood", str(tmp_path / "ood"), "--reference", str(tmp_path / "ref"), "--n", "4"])
    assert "no verdict (44 < 88 samples)" in capsys.readouterr().out
    # --skip: the first samples of each task left out, the rest judged alone (against NumPy on samples 3..n-1)
    goals.main(["--ood", str(tmp_path / "ood"), "--reference", str(tmp_path / "ref"), "--n", str(n), "--skip", "3"])
    out = capsys.readouterr().out
    assert "samples 3-7 of each task" in out and "(55 < 88 samples)" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("| agnostic") and "r=0.5" in ln)
    d = np.array([100 * want[("ada_lookahead_kv", t, 0.5)][3:] for t in tasks])
    se = np.sqrt((d.var(axis=1, ddof=1) / (n - 3)).sum()) / len(tasks)
    assert f"{d.mean(axis=1).mean():+.1f} ± {se:.1f}" in row
    with pytest.raises(SystemExit):
        goals.main(["--ood", str(tmp_path / "ood"), "--reference", str(tmp_path / "ref"), "--n", "4", "--skip", "4"])
