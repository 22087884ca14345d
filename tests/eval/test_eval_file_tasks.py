"""Tasks read from local files (RULER qa, LongBench, math, fidelity ids) and the needle grid / passkey."""

import json
import re

import numpy as np
import pytest

from kvjax.data.base import TaskSkipped
from kvjax.data.niah_grid import KEY_PHRASE
from kvjax.data.prompts import chat_overhead
from kvjax.data.templates import NIAH_GRID_NEEDLE
from kvjax.eval.tasks import generate_task
from kvjax.eval.tasks.longbench import PROMPTS, TASKS as LB_TASKS, split_template
from kvjax.eval.tasks.math import gsm8k_gold


def _squad(tmp_path):
    paragraphs = [f"Paragraph {i} says the {w} river flows north into the {w} lake." for i, w in
                  enumerate(["red", "blue", "green", "tiny", "huge", "old", "new", "dark"])]
    data = {"data": [
        {"paragraphs": [{"context": paragraphs[0], "qas": [
            {"question": "Where does the red river flow?", "is_impossible": False,
             "answers": [{"text": "north"}, {"text": "into the red lake"}]},
            {"question": "Unanswerable?", "is_impossible": True, "answers": []}]},
            {"context": paragraphs[1], "qas": []}]},
        {"paragraphs": [{"context": p, "qas": [{"question": f"Q{i}?", "is_impossible": False,
                                                 "answers": [{"text": f"a{i}"}]}]}
                        for i, p in enumerate(paragraphs[2:])]},
    ]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(data))
    return path, paragraphs


def test_qa_1_from_squad_file(tok, tmp_path):
    path, paragraphs = _squad(tmp_path)
    samples = generate_task("qa_1", tok, 512, 2, data={"squad": str(path)}, overhead=chat_overhead(tok))
    s = samples[0]
    assert s["answers"] == ["north", "into the red lake"]
    assert paragraphs[0] in s["context"]
    # Same-article distractor first, and every document numbered.
    assert paragraphs[1] in s["context"]
    docs = re.findall(r"Document (\d+):\n", s["context"])
    assert docs == [str(i + 1) for i in range(len(docs))]
    assert s["question"].endswith("Question: Where does the red river flow?")
    assert s["answer_prefix"] == " Answer:" and s["length"] <= 512
    assert samples[1]["question"].endswith("Question: Q0?")  # the impossible question is skipped
    # A small context holds fewer documents, still with the gold one.
    small = generate_task("qa_1", tok, 200, 1, data={"squad": str(path)}, overhead=chat_overhead(tok))[0]
    assert paragraphs[0] in small["context"] and small["length"] <= 200 < small["metadata"]["next_unit_length"]


def test_qa_2_from_hotpotqa_file(tok, tmp_path):
    rows = [{"question": f"Who wrote book {i}?", "answer": f"Author {i}",
             "context": [[f"Title {i}", [f"Book {i} was written by Author {i}.", " It sold well."]],
                         [f"Other {i}", ["Unrelated text."]]]} for i in range(3)]
    path = tmp_path / "hotpot.json"
    path.write_text(json.dumps(rows))
    s = generate_task("qa_2", tok, 512, 1, data={"hotpotqa": str(path)}, overhead=chat_overhead(tok))[0]
    assert s["answers"] == ["Author 0"]
    assert "Title 0\nBook 0 was written by Author 0. It sold well." in s["context"]


def test_niah_grid_cells_lengths_and_depths(tok):
    samples = generate_task("niah_grid", tok, 1024, 0, overhead=chat_overhead(tok), lengths=[300, 1024],
                            depths=[0, 50, 100])
    assert [(s["metadata"]["grid_length"], s["metadata"]["grid_depth"]) for s in samples] == [
        (300, 0), (300, 50), (300, 100), (1024, 0), (1024, 50), (1024, 100)]
    for s in samples:
        assert s["length"] <= s["metadata"]["grid_length"] < s["metadata"]["next_unit_length"]
        assert KEY_PHRASE in s["context"] and s["stop"] == ["\n"] and s["max_new_tokens"] == 30
        book = s["context"].split("<book> ", 1)[1].rsplit(" </book>", 1)[0]
        before, after = book.split(NIAH_GRID_NEEDLE)
        n_before, n_after = (len(tok.encode(x, add_special_tokens=False)) for x in (before, after))
        share = n_before / (n_before + n_after)
        depth = s["metadata"]["grid_depth"] / 100
        assert depth - 0.1 <= share <= depth + 0.02  # at the sentence boundary at or just before the depth
    assert samples[0]["question"] == (" Based on the content of the book, Question: The best thing to do in San "
                                      "Francisco is: \n")
    assert samples[0]["context"].startswith("<|im_start|> This is a very long story book: <book> ")


def test_passkey(tok):
    for s in generate_task("passkey", tok, 1024, 2, overhead=chat_overhead(tok)):
        key = s["answers"][0]
        assert re.fullmatch(r"\d{5}", key)
        assert f"The pass key is {key}. Remember it. {key} is the pass key." in s["context"]


def _longbench_dir(tmp_path):
    rows = {
        "hotpotqa": {"input": "Who?", "context": "Passage 1: " + "alpha beta gamma. " * 400 + "THE-END",
                     "answers": ["Ann"], "all_classes": None, "_id": "h1", "length": 1200},
        "trec": {"input": "What is X?\nType:", "context": "Q: a?\nType: Entity", "answers": ["Entity"],
                 "all_classes": ["Entity", "Location"], "_id": "t1"},
        "gov_report": {"input": "", "context": "The report.", "answers": ["Summary."], "_id": "g1"},
    }
    for name, row in rows.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    return rows


def test_longbench_templates_split_is_verbatim():
    assert len(LB_TASKS) == 16 and set(LB_TASKS) == set(PROMPTS)
    for name in PROMPTS:
        ctx, q, prefix = split_template(name)
        assert ctx + q + prefix == PROMPTS[name][0]
        assert "{context}" in ctx and "{input}" not in ctx
    assert "asconcisely" in PROMPTS["narrativeqa"][0]
    assert split_template("hotpotqa")[1:] == ("Question: {input}\n", "Answer:")


def test_longbench_from_local_files(tok, tmp_path):
    rows = _longbench_dir(tmp_path)
    data = {"longbench": str(tmp_path)}
    ov = chat_overhead(tok)
    s = generate_task("longbench/hotpotqa", tok, 512, 5, data=data, overhead=ov)[0]
    assert s["id"] == "longbench/hotpotqa/h1" and s["answers"] == ["Ann"] and s["max_new_tokens"] == 32
    assert s["length"] <= 512 and s["metadata"]["truncated"]
    # Middle truncation keeps the start and the end of the context.
    assert "Passage 1: alpha" in s["context"] and "THE-END" in s["context"]
    assert s["question"] == "Question: Who?\n" and s["answer_prefix"] == "Answer:"
    t = generate_task("longbench/trec", tok, 512, 5, data=data, overhead=ov)[0]
    assert t["chat_template"] is False and t["metadata"]["all_classes"] == ["Entity", "Location"]
    full = t["context"] + t["question"] + t["answer_prefix"]
    assert full == PROMPTS["trec"][0].replace("{context}", rows["trec"]["context"]).replace(
        "{input}", rows["trec"]["input"])
    g = generate_task("longbench/gov_report", tok, 1024, 5, data=data, overhead=ov)[0]
    assert g["question"] == "" and g["answer_prefix"] == "Summary:" and not g["metadata"]["truncated"]
    with pytest.raises(TaskSkipped, match="no file"):
        generate_task("longbench/qasper", tok, 512, 1, data=data)


def test_longbench_and_math_skip_without_data(tok, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(TaskSkipped, match="--data longbench=DIR"):
        generate_task("longbench/qasper", tok, 512, 1)
    with pytest.raises(TaskSkipped, match="--data gsm8k=PATH"):
        generate_task("gsm8k", tok, 512, 1)


def test_math_from_local_files(tok, tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "It is 4.\n#### 1,004"}) + "\n")
    (tmp_path / "math500.jsonl").write_text(json.dumps({"problem": "Half?", "answer": "\\frac{1}{2}",
                                                        "unique_id": "test/x.json"}) + "\n")
    data = {"gsm8k": str(tmp_path / "gsm8k.jsonl"), "math500": str(tmp_path / "math500.jsonl")}
    g = generate_task("gsm8k", tok, 600, 3, data=data, overhead=chat_overhead(tok))
    assert len(g) == 1 and g[0]["answers"] == ["1004"]
    assert g[0]["context"] == "Please reason step by step, and put your final answer within \\boxed{}.\n2+2?"
    assert g[0]["answer_prefix"] == "<think>\n" and g[0]["system"] == "You are a helpful assistant."
    assert g[0]["max_new_tokens"] + 20 < 600  # the cap is lowered to what the context leaves
    m = generate_task("math500", tok, 20000, 3, data=data, overhead=chat_overhead(tok))[0]
    assert m["answers"] == ["\\frac{1}{2}"] and m["max_new_tokens"] == 8192 and m["id"] == "math500/test/x.json"
    assert gsm8k_gold("so\n#### -3,000") == "-3000"
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold("no marker")


def test_fidelity_samples(tok, tmp_path):
    s = generate_task("fidelity", tok, 256, 2, continuation_tokens=16)
    assert [len(x["metadata"]["context_ids"]) for x in s] == [240, 240]
    assert [len(x["metadata"]["continuation_ids"]) for x in s] == [16, 16]
    assert s[0]["metadata"]["context_ids"] != s[1]["metadata"]["context_ids"]
    ids = np.arange(100, 400)
    np.save(tmp_path / "ids.npy", ids)
    f = generate_task("fidelity", None, 64, 2, data={"fidelity_ids": str(tmp_path / "ids.npy")},
                      continuation_tokens=8)
    assert f[0]["metadata"]["context_ids"] == list(range(100, 156))
    assert f[1]["metadata"]["context_ids"][0] == 132  # sample i starts i * context_length / 2 tokens in
    with pytest.raises(TaskSkipped, match="fidelity_ids"):
        generate_task("fidelity", None, 64, 1)
    with pytest.raises(TaskSkipped, match="needs a tokenizer"):
        generate_task("niah_single_1", None, 1024, 1)
