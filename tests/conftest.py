"""Shared test configuration: GPU tests skip cleanly off the device, CPU threads stay bounded."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter. The switch must be set before anything
# imports triton (transformers and diffusers may, from other test modules), so it lives here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores in CI; tests are sized for that. Keep torch from oversubscribing: under pytest-xdist
# (`make test` runs two workers) each worker gets one thread.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(int(os.environ.get("REALTIME_TEST_THREADS", "1" if _WORKER else "2")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the device with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
