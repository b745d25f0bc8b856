"""Shared fixtures. `cuda`-marked tests skip where torch sees no CUDA device."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Llama config.json: all vLLM needs with load_format='dummy'."""
    from tests.harness import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"))
