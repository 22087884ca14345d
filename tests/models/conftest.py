"""Session-scoped tiny HF models for the model tests."""

import pytest

from tiny_models import FAMILIES, build_hf


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """family -> (torch model, folder); built once per session."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family.replace(".", "_"))
        out[family] = (build_hf(family, folder), folder)
    return out
