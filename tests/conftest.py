from __future__ import annotations

import pytest
import torch

from tests.hf_models import cached_hf_model
from tests.kernels.interpreter import prefetch, stop_prefetched


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session):
    """The Triton-interpreter runs of the selected modules start now, beside the rest of the session."""
    for entry in dict.fromkeys(getattr(item.module, "INTERPRETED", None) for item in session.items
                               if isinstance(item, pytest.Function)):
        if entry is not None:
            prefetch(entry)


def pytest_sessionfinish(session, exitstatus):
    stop_prefetched()


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="session")
def hf_model_path(hf_root):
    """``hf_model_path(variant, seed)`` -> a folder written by transformers (made once per session)."""

    def make(variant: str = "v3", seed: int = 0) -> str:
        return cached_hf_model(hf_root, variant, seed)

    return make


@pytest.fixture(scope="session")
def layout_model(hf_model_path) -> str:
    """The V3 checkpoint the layout, overlap and rebalance tests run (``tests/distributed/layouts``)."""
    return hf_model_path("v3", 0)


@pytest.fixture(scope="session")
def layout_reference(layout_model) -> list[list[int]]:
    """The single-process engine's greedy tokens of ``layouts.requests()``: what every layout must give."""
    from tests.distributed.layouts import greedy_tokens

    return greedy_tokens(layout_model)
