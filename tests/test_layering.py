"""Imports go downward (DESIGN.md "Parts, and what each may touch"), and none hides in a function body."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> set[str]:
    """Every kvjax module named by an import statement anywhere in ``package``'s files (function bodies too)."""
    path = ROOT / package.replace(".", "/")
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return {n for n in names if n.startswith("kvjax")}


@pytest.mark.parametrize("package, forbidden", [
    ("kvjax.data", ("kvjax.eval", "kvjax.training", "kvjax.engine", "kvjax.tokenizer")),
    ("kvjax.tokenizer", ("kvjax.eval", "kvjax.training", "kvjax.engine")),
    ("kvjax.training.bundled", ("kvjax.eval", "kvjax.engine")),
    ("kvjax.models", ("kvjax.policies", "kvjax.lookahead", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.cache", ("kvjax.policies", "kvjax.models", "kvjax.engine", "kvjax.eval")),
    ("kvjax.policies", ("kvjax.models", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.kernels", ("kvjax.policies", "kvjax.models", "kvjax.engine", "kvjax.eval")),
    ("kvjax.lookahead", ("kvjax.policies", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.engine", ("kvjax.eval", "kvjax.training")),
])
def test_imports_stay_below(package, forbidden):
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
