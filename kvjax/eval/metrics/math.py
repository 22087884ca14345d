"""Math answer extraction, normalisation and equivalence (docs/benchmarks.md §4.3-4.5).

Follows the DeepSeekMath / Qwen2.5-Math parser: the last ``\\boxed{...}`` (nested braces),
else the text after "he answer is" / "final answer is", else a fenced program's output, else
the last number; then `strip_string`; then `math_equal`: string equality, numeric closeness
(relative 1e-4, percentages as x, x/100, x*100), element-wise for tuples, then symbolic
equality with sympy on a small LaTeX subset (fractions, roots, powers, pi, products).
"""

from __future__ import annotations

import math
import re

_MAX_SYMBOLIC_CHARS = 120


def _last_boxed(text: str) -> str:
    tail = text.split("boxed")[-1]
    if not tail:
        return ""
    if tail[0] != "{":
        return tail.split("$")[0].strip()
    depth, out = 1, []
    for j, c in enumerate(tail[1:], start=1):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                if tail[j + 1: j + 2] == "%":
                    out.append("%")
                break
        out.append(c)
    return "".join(out)


def extract_answer(text: str) -> str:
    """The model's final answer, normalised by `strip_string` (empty if none can be found)."""
    if "boxed" in text:
        pred = _last_boxed(text)
    elif "he answer is" in text:
        pred = text.split("he answer is")[-1].strip()
    elif "final answer is" in text:
        pred = text.split("final answer is")[-1].strip()
    elif "```output" in text:
        pred = text.split("```output")[-1].split("```")[0].strip()
    else:
        numbers = re.findall(r"-?\d*\.?\d+", text.replace(",", ""))
        pred = numbers[-1] if numbers else ""
    pred = pred.strip().split("\n")[0]
    if pred.startswith(":"):
        pred = pred[1:]
    pred = pred.strip()
    while pred.endswith((".", "/")):
        pred = pred[:-1]
    return strip_string(pred)


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{b}`` -> ``\\frac{1}{b}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, rest = part[0], part[1:]
        if rest.startswith("{"):
            out += "{" + a + "}" + rest
        else:
            out += "{" + a + "}{" + rest[0] + "}" + rest[1:]
    return out


def _fix_a_slash_b(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def strip_string(s: str) -> str:
    """§4.4's normalisation, in order: newlines, \\left/\\right, dfrac, \\text, degrees, $, %, decimals,
    fractions, spaces."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\left", "").replace("\\right", "")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    unitless = re.sub(r"\\text\{.*?\}$", "", s).strip()
    if unitless and unitless != s:
        s = unitless
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    s = re.sub(r"(\d+)\.0+(?=\D|$)", r"\1", s)
    s = _fix_sqrt(_fix_fracs(s))
    s = s.replace(" ", "")
    return _fix_a_slash_b(s)


def _to_float(s: str) -> float | None:
    s = s.replace(",", "").rstrip("%")
    frac = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if frac:
        return int(frac.group(1)) / int(frac.group(2)) if int(frac.group(2)) else None
    try:
        return float(s)
    except ValueError:
        return None


def _split_tuple(s: str) -> list[str] | None:
    if len(s) < 2 or s[0] + s[-1] not in ("()", "[]"):
        return None
    parts, depth, cur = [], 0, ""
    for c in s[1:-1]:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    return parts + [cur]


def _latex_to_sympy(s: str):
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    def braced(text: str, start: int) -> tuple[str, int]:
        if start >= len(text) or text[start] != "{":
            raise ValueError("expected {")
        depth = 0
        for j in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[start + 1: j], j + 1
        raise ValueError("unbalanced braces")

    def convert(text: str) -> str:
        out, j = "", 0
        while j < len(text):
            if text.startswith("\\frac", j):
                a, j = braced(text, j + 5)
                b, j = braced(text, j)
                out += f"(({convert(a)})/({convert(b)}))"
            elif text.startswith("\\sqrt", j):
                a, j = braced(text, j + 5)
                out += f"sqrt({convert(a)})"
            elif text[j] == "{":
                a, j = braced(text, j)
                out += f"({convert(a)})"
            else:
                out += text[j]
                j += 1
        return out

    expr = convert(s).replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("\\infty", "oo")
    if "\\" in expr:
        raise ValueError(f"unsupported LaTeX in {s!r}")
    transforms = standard_transformations + (implicit_multiplication_application, convert_xor)
    return sympy.sympify(parse_expr(expr, transformations=transforms, evaluate=True))


def _symbolic_equal(a: str, b: str) -> bool:
    if len(a) > _MAX_SYMBOLIC_CHARS or len(b) > _MAX_SYMBOLIC_CHARS:
        return False
    try:
        import sympy

        ea, eb = _latex_to_sympy(a), _latex_to_sympy(b)
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # unparseable or unsupported: not provably equal
        return False


def math_equal(prediction: str, reference: str, rel_tol: float = 1e-4) -> bool:
    """Whether two answers are equal: strings after `strip_string`, numbers, tuples, or symbolically."""
    pred, ref = strip_string(str(prediction)), strip_string(str(reference))
    if pred == ref:
        return True
    if not pred or not ref:
        return False
    p, r = _to_float(pred), _to_float(ref)
    if p is not None and r is not None:
        return any(math.isclose(p, cand, rel_tol=rel_tol, abs_tol=1e-12) for cand in (r, r / 100, r * 100))
    tp, tr = _split_tuple(pred), _split_tuple(ref)
    if tp is not None and tr is not None:
        return len(tp) == len(tr) and all(math_equal(x, y, rel_tol) for x, y in zip(tp, tr))
    return _symbolic_equal(pred, ref)


def math_score(prediction: str, references: list[str]) -> float:
    """1.0 when the extracted answer equals any reference, else 0.0."""
    answer = extract_answer(prediction)
    return float(any(math_equal(answer, ref) for ref in references))
