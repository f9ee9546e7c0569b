"""The models a server serves, and how request names map to them (`name` or `name@step`)."""

from __future__ import annotations

import threading

from ..errors import UnknownModelError
from ..storage import list_checkpoints
from .service import ModelService

__all__ = ["ServiceRegistry"]


class ServiceRegistry:
    """Thread-safe map of model name → ModelService."""

    def __init__(self) -> None:
        self._services: dict[str, ModelService] = {}
        self._lock = threading.Lock()

    def add(self, name: str, service: ModelService) -> None:
        with self._lock:
            self._services[name] = service

    def remove(self, name: str) -> ModelService | None:
        with self._lock:
            return self._services.pop(name, None)

    def get(self, name: str) -> ModelService | None:
        with self._lock:
            return self._services.get(name)

    def clear(self) -> list[ModelService]:
        """Remove every service; returns them."""
        with self._lock:
            services = list(self._services.values())
            self._services.clear()
            return services

    def services(self) -> list[ModelService]:
        with self._lock:
            return list(self._services.values())

    def served_names(self) -> list[str]:
        """Every name a request may use: each model's `name` and `name@step` of its saved steps."""
        names = []
        with self._lock:
            items = list(self._services.items())
        for name, service in items:
            names.append(name)
            steps = {c.step for c in list_checkpoints(service.paths.checkpoints_dir)} | {0, service.step}
            names += [f"{name}@{s}" for s in sorted(steps)]
        return names

    def resolve(self, served_name: str) -> tuple[ModelService, int | None]:
        """(service, step) for a request's `model`; step None means the latest.

        Raises:
            UnknownModelError: naming the valid names.
        """
        name, at, step_text = served_name.partition("@")
        service = self.get(name)
        step = None
        if at:  # ASCII digits only: int() also takes "٠", isdigit() also "²"
            step = int(step_text) if step_text.isascii() and step_text.isdigit() else -1
        if service is None or (step is not None and step < 0):
            raise UnknownModelError(f"model {served_name!r} does not exist; valid names: {self.served_names()}")
        return service, step
