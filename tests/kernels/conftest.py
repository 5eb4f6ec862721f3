"""Shared by the kernel tests: each test file sets TRITON_INTERPRET=1 where there is no CUDA, before
any kernel is built, so the CPU tests run the Triton kernels through the interpreter."""

from __future__ import annotations

import pytest

from realtime.kernels import _triton


@pytest.fixture
def cpu_kernels():
    """The CPU tests must exercise the Triton path, never the silent reference fallback."""
    assert _triton.triton_available(), "triton is a dev dependency: pip install -e '.[dev]'"
    if not _triton.interpret_mode():
        pytest.skip("CUDA present and TRITON_INTERPRET unset: the @gpu tests cover the kernels here")
