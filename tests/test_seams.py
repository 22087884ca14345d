"""The forward pass's seams hold: the engine names no policy or observation, the model knows no producer,
the forward's functions stay short, and observations are generic (one spec loop, one registry)."""

import ast
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import observations, policies
from kvjax.observations import ObservationSpec, Observations, WindowQueries
from kvjax.passes.reconstruction import Reconstruction

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _names_in(path: pathlib.Path) -> set[str]:
    """Identifiers, attribute names and string constants of a file (comments and docstrings aside)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and not (isinstance(n.value, ast.Name) and n.value.id in ("jax", "jnp", "np")):
            out.add(n.attr)  # (jax.random is a module, not the `random` preset)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out.add(n.value)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
    return out


def test_engine_names_no_policy_and_no_observation():
    import kvjax.passes.lookahead  # noqa: F401  (registers the producers' keywords and fields)
    import kvjax.passes.reconstruction  # noqa: F401

    named = set(policies.available()) | set(observations.REGISTRY)
    named |= {f for cls in observations.REGISTRY.values() for f in cls.fields}
    for f in sorted((ROOT / "kvjax" / "engine").glob("*.py")):
        hits = sorted(_names_in(f) & named)
        assert not hits, f"{f.relative_to(ROOT)} names {hits}"


def test_models_and_recorders_do_not_import_the_passes_run_after_the_prefill():
    """The producers (kvjax.passes) import the model (they run `extend`); the model and the recorders
    (kvjax.observations) never import them."""
    for part in ("models", "observations", "kernels", "engine"):
        for f in sorted((ROOT / "kvjax" / part).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, ast.ImportFrom) and n.module:
                    assert not n.module.startswith("kvjax.passes"), f


def test_forward_functions_are_short():
    for f in sorted((ROOT / "kvjax" / "models").glob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.FunctionDef):
                assert n.end_lineno - n.lineno + 1 <= 80, f"{f.name}:{n.name} has {n.end_lineno - n.lineno + 1} lines"


def test_spec_merges_restricts_and_reads_back_generically():
    a = ObservationSpec(window=8, column_mass=True)
    b = ObservationSpec(window=32, query_stats=0)
    both = a.merge(b)
    assert (both.window, both.column_mass, both.query_stats, both.step_probs) == (32, True, 0, False)
    assert both == ObservationSpec(WindowQueries(32), column_mass=True, query_stats=0) and hash(both) == hash(
        ObservationSpec(query_stats=0, column_mass=True, window=32))
    assert not ObservationSpec(window=0, column_mass=False, query_stats=-1) and ObservationSpec(query_stats=0)
    assert ObservationSpec(step_probs=True, window=4).phase("decode") == ObservationSpec(step_probs=True)
    rec = ObservationSpec(Reconstruction(chunk_size=8))
    assert rec.producers == (Reconstruction(chunk_size=8),) and not rec.phase("prefill")
    with pytest.raises(ValueError, match="query_stats"):
        b.merge(ObservationSpec(query_stats=3))
    with pytest.raises(TypeError, match="unknown observation 'windw'"):
        ObservationSpec(windw=4)
    q = jnp.arange(2 * 1 * 3 * 32 * 2, dtype=jnp.float32).reshape(2, 1, 3, 32, 2)
    obs = Observations(window_queries=q, window_positions=jnp.tile(jnp.arange(32), (1, 1)),
                       column_mass=jnp.ones((2, 1, 1, 5)), query_mean=jnp.zeros((2, 1, 3, 2)), attn_scale=0.5,
                       lengths=jnp.array([40]))
    narrow = obs.restrict(a)
    np.testing.assert_array_equal(narrow.window_queries, q[:, :, :, 24:])
    np.testing.assert_array_equal(narrow.window_positions, np.arange(24, 32)[None])
    assert narrow.column_mass is not None and narrow.query_mean is None and narrow.attn_scale == 0.5
    assert narrow.lengths is not None
    with pytest.raises(ValueError, match="window of 32"):
        obs.restrict(ObservationSpec(window=40))
    with pytest.raises(AttributeError, match="no field 'colum_mass'"):
        obs.colum_mass
