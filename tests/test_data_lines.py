"""kvjax.data.lines: the out-of-distribution training families (line retrieval, sentence copying), checked
against the prompt text itself."""

import re

import pytest

import kvjax.data as data
from kvjax.eval import metrics, tasks


@pytest.fixture(scope="module")
def tok():
    from kvjax.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


@pytest.mark.parametrize("length", [512, 1024])
def test_line_recall_quotes_the_numbered_line(tok, length):
    samples = data.generate("line_recall", tok, length, 6, seed=7)
    lines_seen = set()
    for s in samples:
        assert s["length"] <= length < s["metadata"]["next_unit_length"]  # the most lines that fit
        k = int(re.search(r"line (\d+)\?", s["question"]).group(1))
        numbered = dict(re.findall(r"^line (\d+): (.*)$", s["context"], flags=re.M))
        assert len(numbered) == s["metadata"]["haystack_units"] and 1 <= k <= len(numbered)
        assert s["answers"] == [numbered[str(k)]] and s["answer_prefix"] == f"line {k}:"
        lines_seen.add(k)
    assert len(lines_seen) > 1  # the asked line moves


@pytest.mark.parametrize("task", ["repeat_first", "repeat_last"])
def test_repeat_asks_for_the_first_or_last_sentence(tok, task):
    for s in data.generate(task, tok, 768, 4, seed=2):
        (answer,) = s["answers"]
        assert s["context"].startswith(answer) if task == "repeat_first" else s["context"].endswith(answer)
        assert task.split("_")[1] in s["question"] and s["length"] <= 768


def test_ood_families_share_nothing_with_ruler_and_are_scored(tok):
    assert {data.GENERATORS[t].family for t in data.SUITES["ood_train"]} == {"lines", "copy"}
    assert not set(data.SUITES["ood_train"]) & set(data.SUITES["ruler"])
    for t in data.SUITES["ood_train"]:
        s = data.generate(t, tok, 512, 1, seed=0)[0]
        assert "magic" not in s["context"] and "VAR" not in s["context"]
        score = lambda text: metrics.score_prediction(tasks.TASKS[t].metric, t, text, s)["score"]  # noqa: E731
        assert score(" " + s["answers"][0]) == 1.0
        assert score(" something else entirely.") == 0.0
