"""Runner (resume, stop strings, fidelity path), prompt split, and report (table numbers, files)."""

import json

import numpy as np
import pytest

from kvjax.data.prompts import build_prompt, chat_overhead, encode_prompt
from kvjax.eval.report import markdown_table, niah_matrices, summarize, wide_table, write_reports
from kvjax.eval.runner import ResultStore, Setting, make_settings, run


def _samples(task, n, answers=None):
    return [{"id": f"{task}/{i}", "task": task, "context": f"ctx {i}", "question": " q?", "answer_prefix": " A:",
             "answers": [answers[i] if answers else f"v{i}"], "max_new_tokens": 4, "length": 10}
            for i in range(n)]


class FakeGenerate:
    """Answers correctly with the full cache; at ratio r, sample i is right iff i / n >= r."""

    def __init__(self):
        self.calls = []

    def __call__(self, samples, *, policy, compression_ratio, budget, query_aware):
        self.calls.append((policy, compression_ratio, budget, [s["id"] for s in samples]))
        r = compression_ratio or 0.0
        return [s["answers"][0] if int(s["id"].split("/")[1]) / 4 >= r else "wrong" for s in samples]


class FakeGenerateMany(FakeGenerate):
    """The same answers through the runner's batched ``many`` protocol (one call for all settings)."""

    def __init__(self):
        super().__init__()
        self.many_calls = []

    def many(self, samples, *, settings, query_aware):
        self.many_calls.append(([st.label for st in settings], [s["id"] for s in samples]))
        return [FakeGenerate.__call__(self, samples, query_aware=query_aware, **st.kwargs()) for st in settings]


def test_batched_settings_protocol_gives_the_same_rows_and_resumes(tmp_path):
    samples = {"niah_single_1": _samples("niah_single_1", 4)}
    settings = make_settings(["snap"], [0.25, 0.5])
    metrics = {"niah_single_1": "string_match_all"}
    plain = run(samples, settings, tmp_path / "plain", metrics=metrics, generate_fn=FakeGenerate(), batch_size=3,
                progress=False)
    gen = FakeGenerateMany()
    rows = run(samples, settings, tmp_path / "many", metrics=metrics, generate_fn=gen, batch_size=3, progress=False)
    assert len(gen.many_calls) == 2  # one per batch, all three settings at once
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(plain)
    # Lose one setting's row for one sample: the rerun asks for exactly that (setting, sample).
    path = tmp_path / "many" / "results.jsonl"
    path.write_text("".join(ln + "\n" for ln in path.read_text().splitlines()
                            if not ('"niah_single_1/2"' in ln and '"r=0.25"' in ln)))
    gen2 = FakeGenerateMany()
    again = run(samples, settings, tmp_path / "many", metrics=metrics, generate_fn=gen2, batch_size=3,
                progress=False)
    assert gen2.many_calls == [(["r=0.25"], ["niah_single_1/2"])]
    assert strip(again) == strip(plain)


def test_settings_validation_and_labels():
    st = make_settings(["snap", "h2o"], [0.5], [64])
    assert [s.label for s in st] == ["full", "r=0.5", "r=0.5", "C=64", "C=64"]
    assert [s.policy_name for s in st] == ["full", "snap", "h2o", "snap", "h2o"]
    with pytest.raises(ValueError, match="exactly one"):
        Setting("snap")
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Setting("snap", compression_ratio=1.0)
    with pytest.raises(ValueError, match="takes no"):
        Setting(None, budget=3)


def test_run_scores_and_resume_skips_finished_work(tmp_path):
    samples = {"niah_single_1": _samples("niah_single_1", 4)}
    settings = make_settings(["snap"], [0.5])
    gen = FakeGenerate()
    rows = run(samples, settings, tmp_path, metrics={"niah_single_1": "string_match_all"}, generate_fn=gen,
               batch_size=3, progress=False)
    assert len(rows) == 8 and len(gen.calls) == 4  # 2 settings x 2 batches (3 + 1)
    scores = {(r["setting"], r["sample_id"]): r["score"] for r in rows}
    assert [scores[("r=0.5", f"niah_single_1/{i}")] for i in range(4)] == [0.0, 0.0, 1.0, 1.0]
    # Rerun: nothing pending, the same rows come back.
    gen2 = FakeGenerate()
    again = run(samples, settings, tmp_path, metrics={"niah_single_1": "string_match_all"}, generate_fn=gen2,
                progress=False)
    assert gen2.calls == [] and again == rows
    # Drop a finished line and cut the last one in half (an interrupted run): exactly those two are redone.
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    kept = [ln for ln in lines if not ('"niah_single_1/1"' in ln and '"r=0.5"' in ln)]
    cut = json.loads(kept[-1])
    path.write_text("\n".join(kept[:-1]) + "\n" + kept[-1][:20] + "\n")
    gen3 = FakeGenerate()
    with pytest.warns(UserWarning, match="unreadable line"):
        run(samples, settings, tmp_path, metrics={"niah_single_1": "string_match_all"}, generate_fn=gen3,
            progress=False)
    redone = {(c[1], i) for c in gen3.calls for i in c[3]}
    assert redone == {(0.5, "niah_single_1/1"), (cut["compression_ratio"], cut["sample_id"])}
    assert len(ResultStore(path).rows) == 8


def test_run_more_samples_only_runs_the_new_ones(tmp_path):
    gen = FakeGenerate()
    m = {"vt": "string_match_all"}
    run({"vt": _samples("vt", 2)}, [Setting(None)], tmp_path, metrics=m, generate_fn=gen, progress=False)
    run({"vt": _samples("vt", 4)}, [Setting(None)], tmp_path, metrics=m, generate_fn=gen, progress=False)
    assert [c[3] for c in gen.calls] == [["vt/0", "vt/1"], ["vt/2", "vt/3"]]


def test_stop_strings_dict_outputs_and_errors(tmp_path):
    s = _samples("niah_grid", 1, ["eat a sandwich"])
    s[0]["stop"] = ["\n"]
    out = run({"niah_grid": s}, [Setting(None)], tmp_path, metrics={"niah_grid": "rouge1"},
              generate_fn=lambda samples, **kw: [{"text": "eat a sandwich\nand more", "kept": np.float32(3.5)}],
              progress=False)
    assert out[0]["prediction"] == "eat a sandwich" and out[0]["score"] == 1.0
    assert out[0]["stats"] == {"kept": 3.5}
    with pytest.raises(ValueError, match="returned 0 answers for 1"):
        run({"vt": _samples("vt", 1)}, [Setting(None)], tmp_path / "b", metrics={"vt": "string_match_all"},
            generate_fn=lambda samples, **kw: [], progress=False)
    with pytest.raises(ValueError, match="no generate_fn"):
        run({"vt": _samples("vt", 1)}, [Setting(None)], tmp_path / "c", metrics={"vt": "string_match_all"},
            progress=False)


def test_fidelity_path_computes_full_logits_once_per_batch(tmp_path):
    samples = [{"id": f"fidelity/{i}", "answers": [], "metadata": {}} for i in range(3)]
    calls = []

    def logits_fn(batch, *, policy, compression_ratio, budget):
        calls.append(policy)
        base = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
        if policy is None:
            return [base for _ in batch]
        return [np.log(np.array([[0.25, 0.75], [0.9, 0.1]])) for _ in batch]

    rows = run({"fidelity": samples}, make_settings(["snap"], [0.5]), tmp_path, metrics={"fidelity": "fidelity"},
               logits_fn=logits_fn, batch_size=3, progress=False)
    assert calls == [None, "snap"]
    comp = [r for r in rows if r["policy"] == "snap"]
    assert comp[0]["score"] == 0.5 and comp[0]["metrics"]["kl"] == pytest.approx(0.25 * np.log(4 / 3))
    assert [r["score"] for r in rows if r["policy"] == "full"] == [1.0, 1.0, 1.0]
    # a setting whose policy refuses the budget is recorded with the reason; the others still run
    def refusing(batch, *, policy, compression_ratio, budget):
        if compression_ratio == 0.875:
            raise ValueError("budget=4 is smaller than the window=8")
        return logits_fn(batch, policy=policy, compression_ratio=compression_ratio, budget=budget)

    with pytest.warns(UserWarning, match="not run"):
        more = run({"fidelity": samples}, make_settings(["snap"], [0.5, 0.875]), tmp_path,
                   metrics={"fidelity": "fidelity"}, logits_fn=refusing, batch_size=3, progress=False)
    assert [r["error"] for r in more if r["setting"] == "r=0.875"] == ["budget=4 is smaller than the window=8"] * 3
    assert all(r["score"] is None for r in more if r["setting"] == "r=0.875")
    write_reports(tmp_path, more, ["fidelity"], make_settings(["snap"], [0.5, 0.875]), echo=False)
    md = (tmp_path / "results.md").read_text()
    kl = f"{0.25 * np.log(4 / 3):.3g}"
    assert "## Fidelity: next-token KL" in md and f"| snap | {kl} | - |" in md


def test_prompt_split_query_agnostic_and_aware(tok):
    s = {"context": "CTX.", "question": " Q?", "answer_prefix": " A:", "chat_template": True}
    agn = build_prompt(s, tok, query_aware=False)
    assert agn.compressed == "<s><|user|>\nCTX."
    assert agn.question == " Q?<|end|>\n<|assistant|>\n A:"
    aware = build_prompt(s, tok, query_aware=True)
    assert aware.compressed == "<s><|user|>\nCTX. Q?" and aware.question == "<|end|>\n<|assistant|>\n A:"
    assert agn.text == aware.text
    plain = build_prompt({**s, "chat_template": False}, tok)
    assert (plain.compressed, plain.question) == ("<s>CTX.", " Q? A:")
    ctx_ids, q_ids = encode_prompt(agn, tok)
    assert ctx_ids[0] == tok.bos_token_id and tok.bos_token_id not in q_ids
    # The overhead is exactly the tokens of the empty turn: <s> <|user|> \n <|end|> \n <|assistant|> \n.
    assert chat_overhead(tok) == len(tok.encode("<s><|user|>\n<|end|>\n<|assistant|>\n", add_special_tokens=False))
    system = build_prompt({**s, "system": "Be brief."}, tok)
    assert system.compressed == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nCTX."


def test_report_numbers_and_files(tmp_path):
    settings = make_settings(["snap"], [0.5])
    rows = []
    for st, scores in ((settings[0], [1, 1]), (settings[1], [1, 0])):
        for i, sc in enumerate(scores):
            rows.append({"task": "vt", "policy": st.policy_name, "setting": st.label,
                         "compression_ratio": st.compression_ratio, "budget": None, "sample_id": f"vt/{i}",
                         "prediction": "" if sc == 0 else "x", "score": float(sc), "metrics": {}})
        rows.append({"task": "cwe", "policy": st.policy_name, "setting": st.label,
                     "compression_ratio": st.compression_ratio, "budget": None, "sample_id": "cwe/0",
                     "prediction": "x", "score": 0.3, "metrics": {"kl": 0.25}})
    summary = summarize(rows, ["vt", "cwe"], settings)
    vt_snap = next(s for s in summary if s["task"] == "vt" and s["policy"] == "snap")
    assert (vt_snap["score"], vt_snap["n"], vt_snap["nulls"]) == (50.0, 2, 1)
    header, body = wide_table(summary, ["vt", "cwe"], settings)
    assert header == ["policy", "setting", "vt", "cwe", "avg"]
    assert body == [["full", "full", 100.0, 30.0, 65.0], ["snap", "r=0.5", 50.0, 30.0, 40.0]]
    assert markdown_table(header, body).splitlines()[2] == "| full | full | 100.00 | 30.00 | 65.00 |"
    result = write_reports(tmp_path, rows, ["vt", "cwe"], settings, skipped={"qa_1": "no file"}, echo=False)
    assert result["plot"]
    assert (tmp_path / "score_vs_compression.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "results.md").read_text()
    assert "| snap | r=0.5 | 50.00 | 30.00 | 40.00 |" in md and "**qa_1**: no file" in md
    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("policy,setting,compression_ratio,budget,kv_quant,task,score,n,nulls")
    assert "snap,r=0.5,0.5,,none,cwe,30.0,1,0,0.25" in csv_lines
    assert json.loads((tmp_path / "metrics.json").read_text())["skipped"] == {"qa_1": "no file"}


def test_niah_heatmap_matrix(tmp_path):
    rows = [{"task": "niah_grid", "policy": "full", "setting": "full", "score": sc,
             "grid": {"length": ln, "depth": d}, "sample_id": f"{ln}-{d}"}
            for ln, d, sc in [(100, 0.0, 1.0), (100, 50.0, 0.5), (200, 0.0, 0.0), (200, 50.0, 1.0)]]
    m = niah_matrices(rows)["full full"]
    assert m["lengths"] == [100, 200] and m["depths"] == [0.0, 50.0]
    assert m["matrix"] == [[100.0, 0.0], [50.0, 100.0]] and m["mean"] == 62.5
    write_reports(tmp_path, rows, ["niah_grid"], [Setting(None)], echo=False)
    assert (tmp_path / "niah_heatmaps" / "full_full.png").is_file()
    assert json.loads((tmp_path / "niah_grid.json").read_text())["full full"]["mean"] == 62.5


def test_a_setting_that_cannot_run_is_recorded_not_scored(tmp_path):
    """A batched generate_fn may answer a setting with an exception (a budget below the policy's
    protected window): its rows keep score None and the reason, the report shows '-' and says why."""

    class Refusing(FakeGenerateMany):
        def many(self, samples, *, settings, query_aware):
            outs = super().many(samples, settings=settings, query_aware=query_aware)
            return [ValueError("budget=3 is smaller than the window=8") if st.compression_ratio == 0.5 else o
                    for st, o in zip(settings, outs)]

    samples = {"niah_single_1": _samples("niah_single_1", 4)}
    settings = make_settings(["snap"], [0.25, 0.5])
    with pytest.warns(UserWarning, match="not run"):
        rows = run(samples, settings, tmp_path, metrics={"niah_single_1": "string_match_all"},
                   generate_fn=Refusing(), progress=False)
    bad = [r for r in rows if r["setting"] == "r=0.5"]
    assert len(bad) == 4 and all(r["score"] is None and "window=8" in r["error"] for r in bad)
    again = Refusing()
    run(samples, settings, tmp_path, metrics={"niah_single_1": "string_match_all"}, generate_fn=again,
        progress=False)
    assert again.many_calls == []  # recorded rows count as finished
    out = write_reports(tmp_path, rows, ["niah_single_1"], settings, echo=False)
    table = {(r[0], r[1]): r[2:] for r in out["rows"]}
    assert table[("snap", "r=0.5")] == [None, None] and table[("snap", "r=0.25")][0] == 75.0
    assert "window=8" in (tmp_path / "results.md").read_text()
