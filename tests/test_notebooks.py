"""The Colab notebooks (colab/*.ipynb) run top to bottom in small mode on CPU, with the bundled
model (KVJAX_NOTEBOOK_SMALL=1), in a fresh Jupyter kernel that imports this checkout's kvjax.

A cell that raises fails the test. Each notebook also lowers its main program for TPU when it is
not on one (and asserts Pallas kernel calls in it), so that a TPU-only failure is caught here.
The notebooks are committed with cleared outputs.
"""

from __future__ import annotations

import base64
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
TIMEOUT_S = 600  # per cell


def execute(path: pathlib.Path, workdir: pathlib.Path) -> nbformat.NotebookNode:
    """Runs the notebook in a python3 kernel started in `workdir`, with this checkout first on PYTHONPATH."""
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, KVJAX_NOTEBOOK_SMALL="1", MPLBACKEND="module://matplotlib_inline.backend_inline",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p]))
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute(env=env, cwd=str(workdir))
    return nb


def outputs(nb: nbformat.NotebookNode, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if kind in o.get("data", {})]


def text_of(nb: nbformat.NotebookNode) -> str:
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            parts.append(o.get("text", "") + o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_notebooks_are_committed_cleared():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_compare_policies.ipynb",
                                          "03_train_lookahead.ipynb", "04_long_context_memory.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs committed"
        first = nb.cells[0].source
        assert f"colab/{path.name}" in first and "colab-badge.svg" in first, f"{path.name}: no Colab badge"
        params = next(c.source for c in nb.cells if c.cell_type == "code")  # the one parameter cell comes first
        assert "KVJAX_REPO =" in params and "KVJAX_NOTEBOOK_SMALL" in params, f"{path.name}: parameter cell"


def test_readme_links_every_notebook_with_a_badge():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Colab\n"):]
    section = section[: section.index("\n## ", 1)]
    for path in NOTEBOOKS:
        assert f"(colab/{path.name})" in section, f"README's Colab section does not link {path.name}"
        assert f"https://colab.research.google.com/github/YOUR_ORG/kvjax/blob/main/colab/{path.name}" in section


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_small_mode(path, tmp_path):
    nb = execute(path, tmp_path)
    text = text_of(nb)
    assert "lowered for TPU" in text, "the notebook did not lower its program for TPU"
    pngs = outputs(nb, "image/png")
    assert pngs, "the notebook drew no plot"
    for i, o in enumerate(pngs):  # kept for a person to look at (pytest's tmp_path)
        (tmp_path / f"{path.stem}_{i}.png").write_bytes(base64.b64decode(o["data"]["image/png"]))
