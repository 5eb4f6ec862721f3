"""The plug-in interface for endpoints beyond /v1/tts (ASR, text, image, agent).

A service loads its engine, registers its lanes with the one scheduler, and contributes routes.
The server owns the lifecycle: ``load`` (blocking, in a thread, before the port accepts) →
``attach(scheduler)`` → ``warmup`` → serve → shutdown. Each service lives in its own module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute

if TYPE_CHECKING:
    from realtime.scheduler import Scheduler
    from realtime.server import AppState


class Service(ABC):
    name: str = "service"

    @abstractmethod
    def load(self) -> None:
        """Load weights (blocking; runs in a worker thread during startup)."""

    @abstractmethod
    def attach(self, scheduler: "Scheduler") -> None:
        """Register lanes with the scheduler."""

    @abstractmethod
    def routes(self, state: Callable[[], "AppState"]) -> list[BaseRoute]:
        """HTTP/WebSocket routes; ``state()`` returns the running AppState."""

    def describe(self) -> list[dict[str, Any]]:
        """Entries for GET /v1/models."""
        return []

    def warmup(self) -> None:
        """Optional: run the engine once so the first request is fast."""
