"""Fixtures for the server tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def piper_backend():  # noqa: ANN201 - realtime.tts_piper.PiperBackend
    from realtime.tts_piper import PiperBackend

    backend = PiperBackend()
    backend.warmup()
    return backend
