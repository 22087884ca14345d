"""kvjax.data: the synthetic task generators sit below eval, training and the tokenizer builder."""

import ast
import pathlib

import pytest

import kvjax.data as data
from kvjax.eval import tasks


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
])
def test_imports_stay_below(package, forbidden):
    bad = [m for m in imported_modules(package) if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{package} imports {bad}"


@pytest.fixture(scope="module")
def tok():
    from kvjax.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


def test_eval_registry_builds_on_the_data_generators(tok):
    assert list(tasks.TASKS)[:len(data.GENERATORS)] == list(data.GENERATORS)
    assert all(tasks.SUITES[s] == data.SUITES[s] for s in data.SUITES)
    for name, gen in data.GENERATORS.items():
        assert tasks.TASKS[name].builder is gen.builder
    a = data.generate("niah_multikey_1", tok, 512, 2, seed=3, overhead=4)
    b = tasks.generate_task("niah_multikey_1", tok, 512, 2, seed=3, overhead=4)
    assert a == b and all(s["length"] <= 512 for s in a)


def test_bad_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid suites: default, ruler, synthetic"):
        data.suite_tasks("longbench")
    with pytest.raises(ValueError, match="valid tasks: niah_single_1"):
        data.generate("gsm8k", None, 512, 1)
    with pytest.raises(data.TaskSkipped, match="needs a tokenizer"):
        data.generate("vt", None, 512, 1)
