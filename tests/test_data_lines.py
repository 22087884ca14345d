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


@pytest.mark.parametrize("task, length", [("line_recall", 512), ("line_recall", 1024), ("record_recall", 768)])
def test_line_recall_quotes_the_numbered_line(tok, task, length):
    samples = data.generate(task, tok, length, 6, seed=7)
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


CODE_PATTERNS = {"number": r"\d{7}", "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                 "phone": r"\d{3}-\d{3}-\d{4}", "amount": r"\d{1,3},\d{3}\.\d{2}", "date": r"\d{4}-\d{2}-\d{2}",
                 "reference": r"[A-Z2-9]{2}-[A-Z2-9]{6}"}


def test_records_end_in_a_code_of_every_kind():
    """Each record is prose words, then ", <kind> <code>." with the code of its kind's format; the kinds vary,
    and the list is prefix-stable (a longer prompt holds the same first records)."""
    from kvjax.data.lines import CODE_KINDS, records

    recs = records(300, seed=5)
    kinds = set()
    for r in recs:
        m = re.fullmatch(r"[A-Za-z' ,]+, (\w+) (\S+)\.", r)
        assert m and m.group(1) in CODE_KINDS, r
        assert re.fullmatch(CODE_PATTERNS[m.group(1)], m.group(2)), r
        kinds.add(m.group(1))
    assert kinds == set(CODE_KINDS)
    assert records(40, seed=5) == recs[:40] and records(40, seed=6) != recs[:40]


def test_ood_families_share_nothing_with_ruler_and_are_scored(tok):
    assert {data.GENERATORS[t].family for t in data.SUITES["ood_train_codes"] + data.SUITES["ood_train_multi"]} == {
        "lines", "copy"}
    assert not set(data.SUITES["ood_train_multi"]) & set(data.SUITES["ruler"])
    assert set(data.SUITES["ood_train"]) < set(data.SUITES["ood_train_codes"])
    assert not set(data.SUITES["ood_train_codes"]) & set(data.SUITES["ruler"])
    for t in data.SUITES["ood_train_codes"]:
        s = data.generate(t, tok, 512, 1, seed=0)[0]
        assert "magic" not in s["context"] and "VAR" not in s["context"]
        score = lambda text: metrics.score_prediction(tasks.TASKS[t].metric, t, text, s)["score"]  # noqa: E731
        assert score(" " + s["answers"][0]) == 1.0
        assert score(" something else entirely.") == 0.0


def test_records_recall_asks_for_several_records_far_apart(tok):
    """records_recall: 2-4 distinct lines, one from each equal part of the record, in the question's order; the
    answers are those records, and the reference (the teacher's answer) quotes them in order, numbered after the
    first, so that it scores 1."""
    from kvjax.data.base import reference_answer

    samples = data.generate("records_recall", tok, 1024, 12, seed=4)
    assert {len(s["answers"]) for s in samples} == {2, 3, 4}
    for s in samples:
        ks = [int(k) for k in re.findall(r"\d+", s["question"].split("lines")[1])]
        n = s["metadata"]["haystack_units"]
        numbered = dict(re.findall(r"^line (\d+): (.*)$", s["context"], flags=re.M))
        assert ks == s["metadata"]["lines"] and len(set(ks)) == len(ks) and s["answer_prefix"] == f"line {ks[0]}:"
        parts = sorted(int((k - 1) * len(ks) / n) for k in ks)
        assert parts == list(range(len(ks)))  # one asked line per part: far apart
        assert s["answers"] == [numbered[str(k)] for k in ks]
        ref = reference_answer(s)
        assert ref == " " + "\n".join(f"line {k}: {numbered[str(k)]}" if j else numbered[str(k)]
                                      for j, k in enumerate(ks))
        assert metrics.score_prediction("string_match_all", "records_recall", ref, s)["score"] == 1.0
        assert metrics.score_prediction("string_match_all", "records_recall", " " + s["answers"][0], s)["score"] < 1.0
    # one-record tasks: the reference is the answer after a space
    (one,) = data.generate("record_recall", tok, 512, 1, seed=0)
    assert reference_answer(one) == " " + one["answers"][0]
