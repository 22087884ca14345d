"""Runs README.md's Python blocks in one process, in order, as a notebook would (test helper for
tests/test_readme_examples.py, which writes the spec and starts this script in a fresh process).

    python tests/readme_runner.py SPEC.json

SPEC.json: a list of blocks, each {"title", "line", "code", "alternatives", "check"}. Every top-level
statement of a block runs in one shared namespace, compiled with its README.md line numbers (so a
traceback points into the README). After each block:
- `alternatives` (commented-out alternative lines of the block, e.g. `# model = kvjax.load_model(...)`):
  their right-hand side is evaluated, the result appended to H["alternatives"] (the namespace is left
  as the block left it);
- `check` runs in a copy of the namespace with H (this block's values: every name a top-level statement
  assigned, in order, as H[name]; the values of bare expressions as H["_"]), HISTORY (the same over all
  blocks so far) and STDOUT (what the block printed).
The first failure prints a "README BLOCK FAILED" report (the block, its first line, the statement and
the traceback) and exits with status 1; success prints "README BLOCKS OK" and each block's wall and CPU time.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import sys
import time
import traceback
from collections import defaultdict


class Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy (STDOUT of the block's check)."""

    def __init__(self, real):
        self.real, self.buf = real, io.StringIO()

    def write(self, s):
        self.buf.write(s)
        return self.real.write(s)

    def flush(self):
        self.real.flush()


def assigned_names(stmt: ast.stmt) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    names = []
    for t in targets:
        if t is not None:
            names += [n.id for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return names


def fail(block: dict, what: str, source: str) -> None:
    first = block["code"].strip().splitlines()[0] if block["code"].strip() else "(empty)"
    print(f"\nREADME BLOCK FAILED: {block['title']} (README.md line {block['line']}), first line: {first}\n"
          f"{what}: {source}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    sys.exit(1)


def main(spec_path: str) -> None:
    blocks = json.loads(open(spec_path).read())
    ns: dict = {"__name__": "__main__"}
    history: dict = defaultdict(list)
    times = []
    for block in blocks:
        start, cpu = time.perf_counter(), time.process_time()
        here: dict = defaultdict(list)
        tee = Tee(sys.stdout)
        try:
            tree = ast.parse(block["code"], filename="README.md")
            ast.increment_lineno(tree, block["line"] - 1)
        except SyntaxError:
            fail(block, "syntax error", "")
        with contextlib.redirect_stdout(tee):
            for stmt in tree.body:
                source = block["code"].splitlines()[stmt.lineno - block["line"]]
                try:
                    if isinstance(stmt, ast.Expr):
                        value = eval(compile(ast.Expression(stmt.value), "README.md", "eval"), ns)
                        here["_"].append(value)
                    else:
                        exec(compile(ast.Module([stmt], []), "README.md", "exec"), ns)
                        for name in assigned_names(stmt):
                            here[name].append(ns[name])
                except BaseException:
                    fail(block, f"statement at README.md line {stmt.lineno}", source)
            for alt in block["alternatives"]:
                try:
                    value = ast.Expression(ast.parse(alt).body[0].value)
                    here["alternatives"].append(eval(compile(value, "README.md", "eval"), ns))
                except BaseException:
                    fail(block, "commented alternative", alt)
        for name, values in here.items():
            history[name] += values
        try:
            exec(compile(block["check"], f"<check of {block['title']}>", "exec"),
                 {**ns, "H": dict(here), "HISTORY": dict(history), "STDOUT": tee.buf.getvalue()})
        except BaseException:
            fail(block, "its check (tests/test_readme_examples.py, CHECKS) failed", "")
        times.append((block["title"], time.perf_counter() - start, time.process_time() - cpu))
    print("README BLOCKS OK (wall / cpu): " + ", ".join(f"{t} {w:.1f}s / {c:.1f}s" for t, w, c in times), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
