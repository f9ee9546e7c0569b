"""The weights a request samples from, as the engine's `Policy` objects.

`LivePolicy` is what `model.name` serves: the trainer's adapter, read live, so a sample that
spans a training step takes its later tokens from the new weights, and each token is stamped
with the version it was sampled under. `AdapterPolicy` is a saved step (`name@step`), frozen.
`NoAdapterPolicy` is the base model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..training.trainer import ADAPTER_NAME
from .weights_gate import WeightsGate

__all__ = ["AdapterPolicy", "LivePolicy", "NoAdapterPolicy"]


class NoAdapterPolicy:
    """The base model: LoRA layers (if any) switched off for the batch. Its version is 0."""

    key = ("base",)
    adapter_name = None
    cache_version = 0
    version = 0

    def __init__(self, get_peft_model: Any) -> None:
        self._get_peft_model = get_peft_model

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        peft_model = self._get_peft_model()
        if peft_model is None:
            yield
            return
        with peft_model.disable_adapter():
            yield


class LivePolicy:
    """The trainer's adapter as it is now (the base model before the first training step).

    `adapter_name` and `version` are read by the engine at each step (under the gate), so they
    follow the trainer: the adapter appears with the first step, and `version` is the gate's.

    Args:
        has_adapter: whether the trainer (and so its adapter) exists yet.
        gate: the service's weights gate, which holds the live version.
    """

    key = ("live",)

    def __init__(self, has_adapter: Callable[[], bool], gate: WeightsGate) -> None:
        self._has_adapter = has_adapter
        self._gate = gate

    @property
    def adapter_name(self) -> str | None:
        return ADAPTER_NAME if self._has_adapter() else None

    @property
    def version(self) -> int:
        return self._gate.version

    @property
    def cache_version(self) -> int:
        # read when a sequence is admitted: KV blocks hashed under it are reused only by requests
        # admitted at the same version (a running sequence keeps its earlier blocks across an update)
        return self._gate.version

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        yield  # the trainer's adapter is the active one (or there is none yet)


class AdapterPolicy:
    """A named adapter of the PEFT model: a step's checkpoint loaded beside the live adapter (frozen),
    or an adapter that an inference-only server serves by name (`restore=None`: there is no trainer's
    adapter to switch back to)."""

    def __init__(self, peft_model: Any, adapter_name: str, version: int, *,
                 restore: str | None = ADAPTER_NAME) -> None:
        self.peft_model = peft_model
        self.adapter_name = adapter_name
        self.version = version
        self.cache_version = version
        self.key = ("adapter", adapter_name)
        self._restore = restore

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        if self.adapter_name == ADAPTER_NAME:
            yield
            return
        self.peft_model.set_adapter(self.adapter_name, inference_mode=True)
        try:
            yield
        finally:
            if self._restore is not None:
                self.peft_model.set_adapter(self._restore)  # the trainer's adapter, trainable again
