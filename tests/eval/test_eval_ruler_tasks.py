"""RULER generators: requested length hit (tight to one haystack unit), answers present and correct
(re-derived from the generated text by independent parsers), determinism, verbatim templates."""

import collections
import re

import pytest

from kvjax.data.base import TaskSkipped, fit_units
from kvjax.data.prompts import build_prompt, chat_overhead
from kvjax.eval.tasks import TASKS, generate_task, resolve_tasks, task_names

OFFLINE = [*[t for t in task_names("ruler") if t.startswith("niah")], "vt", "cwe", "fwe", "passkey"]
NEEDLE = re.compile(r"One of the special magic (numbers|uuids|words) for (\S+) is: (\S+)\.")


def _gen(tok, task, length, n=3, seed=42):
    return generate_task(task, tok, length, n, seed=seed, overhead=chat_overhead(tok))


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("task", OFFLINE)
def test_length_contract_bundled_tokenizer(tok, task, length):
    for s in _gen(tok, task, length):
        text = build_prompt(s, tok).text
        # Independent recount: the whole rendered prompt, as the model will see it, plus the answer budget.
        real = len(tok.encode(text, add_special_tokens=False)) + s["max_new_tokens"]
        assert real == s["length"] <= length
        # Tight: one more haystack unit would overflow the requested length.
        assert s["metadata"]["next_unit_length"] > length
        assert s["length"] >= 0.9 * length
        assert all(a in s["context"] for a in s["answers"])


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2", "vt", "fwe", "passkey"])
def test_length_contract_other_tokenizer(char_tok, task):
    """A character-level tokenizer (no chat template, no overhead): the same contract in its units."""
    for s in generate_task(task, char_tok, 4000, 2):
        total = len(s["context"] + s["question"] + s["answer_prefix"]) + s["max_new_tokens"]
        assert total == s["length"] <= 4000 < s["metadata"]["next_unit_length"]
        assert all(a in s["context"] for a in s["answers"])


def _queried_keys(question):
    query = re.search(r"for (.+) mentioned", question).group(1)
    return re.split(r", and |, ", query)


@pytest.mark.parametrize("task", [t for t in OFFLINE if t.startswith("niah")])
def test_niah_answers_are_the_values_of_the_queried_keys(tok, task):
    for s in _gen(tok, task, 1024):
        needles = collections.defaultdict(list)
        for _, key, value in NEEDLE.findall(s["context"]):
            needles[key].append(value)
        expected = [v for k in _queried_keys(s["question"]) for v in needles[k]]
        assert sorted(expected) == sorted(s["answers"])
        spec = {"niah_multikey_1": (4, 1, 1), "niah_multivalue": (1, 4, 1), "niah_multiquery": (4, 1, 4)}
        k, v, q = spec.get(task, (1, 1, 1))
        assert len(s["answers"]) == v * q and len(_queried_keys(s["question"])) == q
        if task in ("niah_multikey_2", "niah_multikey_3"):
            assert len(needles) > 5  # a haystack of distractor needles, each with its own key
        else:
            assert len(needles) == k


def test_niah_templates_verbatim(tok):
    s = _gen(tok, "niah_single_1", 1024, 1)[0]
    key = _queried_keys(s["question"])[0]
    assert s["context"].startswith("A special magic number is hidden within the following text. Make sure to "
                                   "memorize it. I will quiz you about the number afterwards.\n")
    assert s["context"].endswith("\n")
    assert s["question"] == f"What is the special magic number for {key} mentioned in the provided text?"
    assert s["answer_prefix"] == f" The special magic number for {key} mentioned in the provided text is"
    lines = s["context"].split("\n")[1:-1]
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert sum(line == noise for line in lines) == len(lines) - 1
    m = _gen(tok, "niah_multivalue", 1024, 1)[0]
    assert m["context"].startswith("Some special magic numbers are hidden")
    assert m["question"].startswith("What are all the special magic numbers for ")
    assert m["answer_prefix"].endswith(" mentioned in the provided text are")
    u = _gen(tok, "niah_single_3", 1024, 1)[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u["answers"][0])
    n = _gen(tok, "niah_single_2", 1024, 1)[0]
    assert re.fullmatch(r"[1-9]\d{6}", n["answers"][0])


def test_vt_chain_resolves_to_the_answers(tok):
    for s in _gen(tok, "vt", 1024):
        value = re.search(r"assigned the value (\d+) in the text above", s["question"]).group(1)
        real = s["context"].split("Memorize and track")[-1]  # after the one-shot example
        direct = dict(re.findall(r"VAR ([A-Z]+) = (\d+)", real))
        links = re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)", real)
        found = {name for name, v in direct.items() if v == value}
        while True:
            more = {a for a, b in links if b in found} - found
            if not more:
                break
            found |= more
        assert found == set(s["answers"]) and len(found) == 5
        assert all(len(n) == 5 for n in s["answers"])
        assert s["answer_prefix"] == (" Answer: According to the chain(s) of variable assignment in the text above, "
                                      f"5 variables are assigned the value {value}, they are: ")
        assert s["context"].count("Memorize and track") == 2  # the one-shot example, then the task


def test_cwe_answers_are_the_ten_most_common(tok):
    for s in _gen(tok, "cwe", 1024):
        real = s["context"].split("Memorize the ones that appear most often.\n")[-1]
        items = re.findall(r"\d+\. (\S+)", real)
        counts = collections.Counter(items)
        top = sorted(counts, key=lambda w: -counts[w])[:10]
        assert set(top) == set(s["answers"])
        assert {counts[w] for w in s["answers"]} == {6} and set(counts.values()) == {6, 1}  # < 4K: 6 / 1 repeats
        assert len(set(s["answers"])) == 10


def test_fwe_answers_are_ranks_two_to_four(tok):
    for s in _gen(tok, "fwe", 2048):
        coded = s["context"][len("Read the following coded text and track the frequency of each coded word. "
                                  "Find the three most frequently appeared coded words. "):].rstrip("\n")
        counts = collections.Counter(coded.split(" "))
        ranked = sorted((w for w in counts if w != "..."), key=lambda w: -counts[w])
        assert ranked[:3] == s["answers"]
        assert counts["..."] > counts[ranked[0]] > counts[ranked[1]] > counts[ranked[2]] > counts[ranked[3]]


def test_deterministic_and_seeded(tok):
    a = _gen(tok, "niah_multikey_2", 1024, 2, seed=7)
    b = _gen(tok, "niah_multikey_2", 1024, 2, seed=7)
    c = _gen(tok, "niah_multikey_2", 1024, 2, seed=8)
    assert a == b
    assert a[0]["answers"] != c[0]["answers"]
    assert a[0]["answers"] != a[1]["answers"]
    # Asking for more samples keeps the first ones (so a rerun with a larger --num-samples resumes).
    assert _gen(tok, "vt", 1024, 3)[:2] == _gen(tok, "vt", 1024, 2)


def test_essay_file_is_used_when_given(tok, tmp_path):
    essay = tmp_path / "essay.txt"
    essay.write_text("Zebras migrate across wide plains every year. " * 200)
    s = generate_task("niah_single_2", tok, 1024, 1, data={"essay": str(essay)}, overhead=chat_overhead(tok))[0]
    assert "Zebras migrate" in s["context"] and s["length"] <= 1024


def test_qa_skips_with_reason_without_file(tok):
    with pytest.raises(TaskSkipped, match="--data squad=PATH"):
        generate_task("qa_1", tok, 1024, 1)
    with pytest.raises(TaskSkipped, match="--data hotpotqa=PATH"):
        generate_task("qa_2", tok, 1024, 1)


def test_too_short_context_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="too small for this cwe prompt"):
        generate_task("cwe", tok, 300, 1)


def test_fit_units_keeps_one_unit_tight_even_when_not_monotonic():
    sizes = [10, 30, 20, 50, 40, 60, 90, 70, 120]  # tokens for n = 0..8, not monotonic
    n = fit_units(lambda n: sizes[n] if n < len(sizes) else 1000, 65)
    assert sizes[n] <= 65 < sizes[n + 1]
    assert fit_units(lambda n: 10 * n, 1000, maximum=7) == 7
    with pytest.raises(ValueError, match="shortest prompt needs 10 tokens"):
        fit_units(lambda n: 10 + n, 5)


def test_registry_and_suites():
    assert len(task_names("ruler")) == 13
    assert set(task_names("default")) == {*[t for t in OFFLINE if t.startswith("niah")], "vt"}
    assert resolve_tasks(["default", "vt", "cwe"])[-1] == "cwe"
    with pytest.raises(ValueError, match="Valid tasks: .*niah_single_1"):
        resolve_tasks(["nope"])
    assert all(TASKS[t].metric == "string_match_all" for t in OFFLINE)
    assert TASKS["qa_1"].metric == TASKS["qa_2"].metric == "string_match_part"


@pytest.mark.parametrize("task", [*OFFLINE, "niah_grid"])
def test_canonical_completion_scores_full_marks(tok, task):
    from kvjax.eval.metrics import score_prediction
    from kvjax.data.targets import completion

    for s in generate_task(task, tok, 1024, 2, overhead=chat_overhead(tok), **(
            {"lengths": [512], "depths": [50]} if task == "niah_grid" else {})):
        assert score_prediction(TASKS[task].metric, task, completion(s), s)["score"] == 1.0
        wrong = score_prediction(TASKS[task].metric, task, " I do not know.", s)["score"]
        assert wrong < 1.0
