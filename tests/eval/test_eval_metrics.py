"""Every metric against examples worked out by hand (the arithmetic is in the comments)."""

import math

import numpy as np
import pytest
from scipy.special import rel_entr, softmax

from kvjax.eval.metrics import score_prediction
from kvjax.eval.metrics.fidelity import kl_divergence, kl_per_position, top1_agreement
from kvjax.eval.metrics.longbench import (classification, code_sim, count, fuzz_ratio, longbench_score,
                                          normalize_answer, qa_f1, retrieval)
from kvjax.eval.metrics.math import extract_answer, math_equal, math_score, strip_string
from kvjax.eval.metrics.rouge import rouge1_f, rouge_l_f
from kvjax.eval.metrics.ruler import clean_prediction, string_match_all, string_match_part


# --- RULER -------------------------------------------------------------------------------------
def test_string_match_all_and_part():
    pred = "  The numbers are 123 and ABC-def\x07 "
    # "123" and "abc-def" (case-insensitive) occur, "789" does not: 2 of 3.
    assert string_match_all(pred, ["123", "abc-DEF", "789"]) == pytest.approx(2 / 3)
    assert string_match_part(pred, ["789", "abc-def"]) == 1.0
    assert string_match_part(pred, ["789"]) == 0.0
    assert clean_prediction(" a\x00b ") == "a\nb"
    with pytest.raises(ValueError, match="references"):
        string_match_all("x", [])


# --- LongBench ---------------------------------------------------------------------------------
def test_qa_f1_with_normalisation():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    # pred -> "eiffel tower" (2 tokens); ref -> "eiffel tower in paris" (4); overlap 2: P = 1, R = 1/2, F1 = 2/3.
    assert qa_f1("The Eiffel Tower!", "eiffel tower in Paris") == pytest.approx(2 / 3)
    # Multiset: pred "a a b" -> "b" after dropping the article "a"; ref "b b" -> overlap 1: P = 1, R = 1/2.
    assert qa_f1("a a b", "b b") == pytest.approx(2 / 3)
    assert qa_f1("nothing", "else") == 0.0


def test_rouge_l_of_the_rouge_package():
    # One sentence each. Word sets: ref {the, cat, lay, on, mat} m = 5, hyp {the, cat, sat, on, mat} n = 5.
    # LCS("the cat lay on the mat", "the cat sat on the mat") = "the cat on the mat" -> set of 4 words.
    # R = P = 4/5, F = 2 * 0.64 / 1.6 = 0.8.
    assert rouge_l_f("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(0.8, abs=1e-7)
    # Lin's union-LCS example: r = w1..w5; c1 = w1 w2 w6 w7 w8, c2 = w1 w3 w8 w9 w5 (sentences cut at ".").
    # Union LCS {w1, w2, w3, w5} = 4; m = 5; n = |{w1 w2 w6 w7 w8 w3 w9 w5}| = 8; R = .8, P = .5, F = .8/1.3.
    assert rouge_l_f("w1 w2 w6 w7 w8. w1 w3 w8 w9 w5", "w1 w2 w3 w4 w5") == pytest.approx(0.8 / 1.3, abs=1e-7)
    assert rouge_l_f("", "ref") == 0.0 and rouge_l_f("...", "ref") == 0.0  # the package raises -> 0


def test_rouge1_of_rouge_score():
    # [eat, a, sandwich] vs [eat, a, sandwich, and, sit]: overlap 3, P = 1, R = 3/5, F = 2 * .6 / 1.6 = .75.
    assert rouge1_f("Eat a sandwich!", "eat a sandwich and sit") == pytest.approx(0.75)
    assert rouge1_f("", "x") == 0.0


def test_classification_including_the_official_quirk():
    classes = ["Entity", "Location", "Description"]
    # Matches [Entity, Location]; gold Location is among them: 1/2.
    assert classification("Location or Entity", "Location", classes) == 0.5
    assert classification("Entity", "Location", classes) == 0.0
    # Official loop removes while iterating: "a" (substring of gold "abc") is removed, which makes the
    # loop skip "ab"; the list ends as [ab, abc] and the score is 1/2 (a correct filter would give 1).
    assert classification("abc", "abc", ["a", "ab", "abc"]) == 0.5


def test_retrieval_count_and_code_sim():
    # Numbers [3, 12]; one equals 3: 1/2.
    assert retrieval("Paragraph 3, or maybe paragraph 12", "Paragraph 3") == 0.5
    assert retrieval("no idea", "Paragraph 3") == 0.0
    assert count("There are 5 unique paragraphs out of 7", "5") == 0.5
    # First line without '#', '`' or '//' is "x = foo(1)"; vs "x = foo(2)": 9 matching of 10 + 10 chars
    # -> ratio 18/20 = 0.9 -> fuzz 90.
    assert code_sim("\n# comment\nx = foo(1)\nmore", "x = foo(2)") == pytest.approx(0.9)
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("", "a") == 0
    assert fuzz_ratio("abcd", "abce") == 75  # 3 matches: 6/8


def test_longbench_aggregation():
    # trec: only the first line counts, so "Location" on line 2 is ignored.
    assert longbench_score("trec", "classification", "Entity\nLocation", ["Location"], ["Entity", "Location"]) == 0.0
    # Max over references: F1 1.0 against the second one.
    assert longbench_score("hotpotqa", "qa_f1", "Paris", ["London", "paris"]) == 1.0
    with pytest.raises(ValueError, match="metric must be one of"):
        longbench_score("x", "bleu", "a", ["a"])


# --- math ---------------------------------------------------------------------------------------
def test_extract_answer():
    assert extract_answer("so \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"  # last box, nested
    assert extract_answer("\\boxed{50}% of them") == "50%"
    assert extract_answer("Thus the answer is 42.\nDone") == "42"
    assert extract_answer("final answer is: 7/") == "7"
    assert extract_answer("```python\nprint(3)\n```\n```output\n3\n```") == "3"
    assert extract_answer("I have 3 apples and 1,234 pears") == "1234"
    assert extract_answer("no digits here") == ""


def test_strip_string():
    assert strip_string("\\dfrac12") == "\\frac{1}{2}"
    assert strip_string("\\left( 3, 4 \\right)") == "(3,4)"
    assert strip_string("10\\text{ cm}") == "10"
    assert strip_string("\\text{(B)}") == "(B)"
    assert strip_string("90^\\circ") == "90"
    assert strip_string("\\$5.00") == "5"
    assert strip_string(".5") == "0.5"
    assert strip_string("3/4") == "\\frac{3}{4}"
    assert strip_string("\\sqrt2") == "\\sqrt{2}"
    assert strip_string("50\\%") == "50%"


def test_math_equal():
    assert math_equal("0.5", "\\frac{1}{2}")
    assert math_equal("50%", "0.5")  # percentages: 50 vs 0.5 * 100
    assert math_equal("2\\sqrt{2}", "\\sqrt{8}")
    assert math_equal("(1, 2)", "(1,2.0)")
    assert math_equal("1000.00001", "1000")  # relative 1e-8 < 1e-4
    assert not math_equal("3", "4")
    assert not math_equal("", "4")
    assert not math_equal("(1,2)", "(1,2,3)")
    assert math_score("The answer is \\boxed{\\dfrac{2}{4}}", ["\\frac{1}{2}"]) == 1.0
    assert math_score("The answer is \\boxed{3}", ["\\frac{1}{2}"]) == 0.0


# --- fidelity -----------------------------------------------------------------------------------
def test_kl_hand_worked():
    full = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    comp = np.log(np.array([[0.25, 0.75], [0.9, 0.1]]))
    # Row 0: 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3); row 1: 0.
    assert kl_per_position(full, comp) == pytest.approx([0.5 * math.log(4 / 3), 0.0])
    assert kl_divergence(full, comp) == pytest.approx(0.25 * math.log(4 / 3))
    # Arg-max: row 0 is a tie in `full` (-> 0) vs 1 in `comp`; row 1 agrees: 1/2.
    assert top1_agreement(full, comp) == 0.5
    assert kl_divergence(full, full) == 0.0 and top1_agreement(full, full) == 1.0


def test_kl_matches_scipy_reference_and_handles_masked_entries():
    rng = np.random.default_rng(0)
    full, comp = rng.normal(size=(7, 11)) * 3, rng.normal(size=(7, 11)) * 3
    expected = rel_entr(softmax(full, axis=-1), softmax(comp, axis=-1)).sum(-1)
    assert kl_per_position(full, comp) == pytest.approx(expected, rel=1e-9)
    masked = full.copy()
    masked[:, 0] = -np.inf  # p_full = 0 there: contributes nothing
    assert np.isfinite(kl_divergence(masked, comp))
    assert kl_divergence(comp, masked) == np.inf  # p_full > 0 where p_comp = 0
    with pytest.raises(ValueError, match="one shape"):
        kl_divergence(full, comp[:, :5])
    with pytest.raises(ValueError, match="finite"):
        kl_divergence(np.full((1, 3), -np.inf), comp[:1, :3])


def test_score_prediction_dispatch():
    sample = {"answers": ["42"], "metadata": {}}
    assert score_prediction("string_match_all", "vt", " 42 ", sample) == {"score": 1.0}
    assert score_prediction("math", "gsm8k", "\\boxed{42}", sample) == {"score": 1.0, "extracted": "42"}
    grid = {"answers": ["The best thing is eat a sandwich."], "metadata": {"key_phrase": "eat a sandwich"}}
    out = score_prediction("rouge1", "niah_grid", "eat a sandwich", grid)
    assert out["substring"] == 1.0 and 0 < out["score"] < 1
    trec = {"answers": ["Entity"], "metadata": {"all_classes": ["Entity", "Location"]}}
    assert score_prediction("classification", "longbench/trec", "Entity", trec)["score"] == 1.0
    with pytest.raises(ValueError, match="metric must be one of"):
        score_prediction("bleu", "x", "y", sample)
