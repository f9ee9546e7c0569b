"""The weights a request samples from, as the engine's `Policy` objects."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..training.trainer import ADAPTER_NAME

__all__ = ["AdapterPolicy", "NoAdapterPolicy"]


class NoAdapterPolicy:
    """The base model: LoRA layers (if any) switched off for the batch."""

    key = ("base",)
    adapter_name = None
    cache_version = 0

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


class AdapterPolicy:
    """A named adapter of the PEFT model: the live one (the trainer's) or an older step's."""

    def __init__(self, peft_model: Any, adapter_name: str, cache_version: int) -> None:
        self.peft_model = peft_model
        self.adapter_name = adapter_name
        self.cache_version = cache_version  # the step: the live adapter's weights change every step
        self.key = ("adapter", adapter_name)

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        if self.adapter_name == ADAPTER_NAME:
            yield
            return
        self.peft_model.set_adapter(self.adapter_name, inference_mode=True)
        try:
            yield
        finally:
            self.peft_model.set_adapter(ADAPTER_NAME)  # the trainer's adapter, trainable again
