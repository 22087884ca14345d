"""Imports go downward (DESIGN.md "Parts, and what each may touch"), and none hides in a function body."""

import ast
import pathlib

import pytest

from test_data import ROOT, imported_modules


@pytest.mark.parametrize("package, forbidden", [
    ("kvjax.models", ("kvjax.policies", "kvjax.lookahead", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.cache", ("kvjax.policies", "kvjax.models", "kvjax.engine", "kvjax.eval")),
    ("kvjax.policies", ("kvjax.models", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.kernels", ("kvjax.policies", "kvjax.models", "kvjax.engine", "kvjax.eval")),
    ("kvjax.lookahead", ("kvjax.policies", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.engine", ("kvjax.eval", "kvjax.training")),
])
def test_parts_import_only_below_them(package, forbidden):
    bad = [m for m in imported_modules(package) if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{package} imports {bad}"


# The eval CLI imports its heavy parts (jax, the engine, the task registry) only when a run needs
# them, so `python -m kvjax.eval --help` and argument errors answer at once. Those imports point
# down from the top of the stack; no other module defers a kvjax import.
DEFERRED_OK = {"kvjax/eval/cli.py"}


def test_no_kvjax_import_hidden_in_a_function_body():
    hidden = []
    for f in sorted((ROOT / "kvjax").rglob("*.py")) + sorted((ROOT / "train_lookahead").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        for fn in ast.walk(ast.parse(f.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                mod = (node.module or "") if isinstance(node, ast.ImportFrom) else (
                    node.names[0].name if isinstance(node, ast.Import) else None)
                if mod is None:
                    continue
                if mod.startswith(("kvjax", "train_lookahead")) or getattr(node, "level", 0):
                    if rel not in DEFERRED_OK:
                        hidden.append(f"{rel}:{node.lineno} ({fn.name}: {mod})")
    assert not hidden, hidden
