"""Imports go downward (DESIGN.md "Parts, and what each may touch"), and none hides in a function body."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvjax", "train_lookahead")


def package_files(package: str) -> list[pathlib.Path]:
    """The .py files of a package (or of a module: its one file)."""
    path = ROOT / package.replace(".", "/")
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def file_imports(f: pathlib.Path) -> set[str]:
    """Every kvjax / train_lookahead name an import statement of file `f` names, function bodies too:
    `import a.b` gives a.b; `from a.b import c` gives a.b and a.b.c (c may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.split(".")[0] in PACKAGES}


def imported_modules(package: str) -> set[str]:
    """Every kvjax / train_lookahead name imported anywhere in ``package``'s files (function bodies too)."""
    return set().union(*(file_imports(f) for f in package_files(package)))


def below(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("package, forbidden", [
    ("kvjax", ("train_lookahead",)),  # the library never imports the pipeline built on it
    ("kvjax.data", ("kvjax.eval", "kvjax.training", "kvjax.engine", "kvjax.tokenizer")),
    ("kvjax.tokenizer", ("kvjax.eval", "kvjax.training", "kvjax.engine")),
    ("kvjax.training", ("kvjax.eval", "kvjax.engine", "train_lookahead")),
    ("kvjax.training.bundled", ("kvjax.eval", "kvjax.engine")),
    ("kvjax.models", ("kvjax.policies", "kvjax.lookahead", "kvjax.engine", "kvjax.eval", "kvjax.training",
                      "kvjax.passes")),
    # the recorders sit below the model; the passes run after the prefill (they run the model) above it
    ("kvjax.observations", ("kvjax.models", "kvjax.passes", "kvjax.policies", "kvjax.engine", "kvjax.lookahead")),
    ("kvjax.passes", ("kvjax.policies", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    # meshes and logical-axis rules sit below the models (which shard their params by them)
    ("kvjax.sharding", ("kvjax.models", "kvjax.policies", "kvjax.lookahead", "kvjax.engine", "kvjax.eval",
                        "kvjax.training")),
    ("kvjax.cache", ("kvjax.policies", "kvjax.models", "kvjax.engine", "kvjax.eval")),
    ("kvjax.policies", ("kvjax.models", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.kernels", ("kvjax.policies", "kvjax.models", "kvjax.engine", "kvjax.eval")),
    ("kvjax.lookahead", ("kvjax.policies", "kvjax.engine", "kvjax.eval", "kvjax.training")),
    ("kvjax.engine", ("kvjax.eval", "kvjax.training", "kvjax.passes")),
    ("train_lookahead", ("kvjax.eval",)),  # the pipeline uses kvjax.data and kvjax.models, not the eval app
])
def test_imports_stay_below(package, forbidden):
    bad = [m for m in imported_modules(package) if below(m, forbidden)]
    assert not bad, f"{package} imports {bad}"


def top_level(name: str) -> str:
    """The part a module belongs to: kvjax.<first component> (kvjax.models, kvjax.sharding, ...) or train_lookahead."""
    parts = name.split(".")
    return parts[0] if parts[0] != "kvjax" or len(parts) == 1 else ".".join(parts[:2])


def test_no_two_parts_import_each_other():
    """A two-way import between two parts (kvjax.models and kvjax.sharding were one) means neither is below the other."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for f in package_files(package):
            rel = f.relative_to(ROOT).with_suffix("")
            part = top_level(".".join(p for p in rel.parts if p != "__init__"))
            if part != "kvjax":  # the package's own __init__: the public names, above every part
                graph.setdefault(part, set()).update(top_level(n) for n in file_imports(f) if n != "kvjax")
    both_ways = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))
    assert not both_ways, f"parts that import each other: {both_ways}"


# Private kernel modules (kvjax.kernels._*) are the kernels' own business; the rest of the library uses the
# names kvjax.kernels (and kvjax.kernels.reductions) export.
PRIVATE_KERNELS_OK: set[str] = set()


def test_private_kernel_modules_stay_inside_kvjax_kernels():
    bad = {}
    for package in PACKAGES:
        for f in package_files(package):
            rel = str(f.relative_to(ROOT))
            if rel.startswith("kvjax/kernels/") or rel in PRIVATE_KERNELS_OK:
                continue
            private = sorted(n for n in file_imports(f) if n.startswith("kvjax.kernels._"))
            if private:
                bad[rel] = private
    assert not bad, f"imports of private kvjax.kernels modules outside kvjax.kernels: {bad}"


def is_data_shim(f: pathlib.Path) -> bool:
    """Whether `f` only re-exports kvjax.data: past its docstring, nothing but imports (and `__all__`),
    one of them from kvjax.data."""
    body = ast.parse(f.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = [n for n in body if n not in imports and not (
        isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])]
    from_data = [n for n in imports if (isinstance(n, ast.ImportFrom) and below(n.module or "", ("kvjax.data",)))
                 or (isinstance(n, ast.Import) and any(below(a.name, ("kvjax.data",)) for a in n.names))]
    return bool(from_data) and not rest


def test_no_shim_re_exports_kvjax_data():
    """The task data moved to kvjax.data; modules that only re-export it under an old name must not come back."""
    files = [f for p in PACKAGES for f in package_files(p) if not f.is_relative_to(ROOT / "kvjax" / "data")]
    shims = [str(f.relative_to(ROOT)) for f in files if is_data_shim(f)]
    stars = [str(f.relative_to(ROOT)) for f in files for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, ast.ImportFrom) and below(n.module or "", ("kvjax.data",))
             and any(a.name == "*" for a in n.names)]
    assert not shims, f"re-export shims of kvjax.data: {shims}"
    assert not stars, f"star re-exports of kvjax.data: {stars}"


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
