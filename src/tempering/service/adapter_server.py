"""Inference-only serving: one base model and any number of LoRA adapters by name, no trainer.

`tempering serve --adapter NAME=DIR ...` runs an `AdapterServer`: the base weights and
tempering's engine as a trainable model has them (`ModelService`, whose engine, chat rendering,
tool calls, structured outputs and streaming it reuses), but no trainer, optimizer or training
routes, and the engine may take most of the GPU's free memory for its KV cache
(`INFERENCE_GPU_MEMORY_FRACTION`). The adapters live in one PEFT model wrapped around the base,
each under an internal name of its own load (`adapter-<k>`), so one engine batch mixes requests
for the base and for any adapters (engine/lora.py), and a name loaded again never reuses the KV
blocks of its earlier weights. The server is also the registry that the OpenAI routes resolve
request names with (`served_names`, `resolve`).

Adapters are added and removed while serving (`add_adapter`, `remove_adapter`; the routes of
adapter_routes.py): each change of the module tree happens between two engine steps (under the
gate). An adapter is checked against the base before PEFT touches the model: every LoRA tensor
must fit its module's shape, so an adapter of another model is refused and leaves the model as
it was. Removing an adapter fails its requests still queued or running, with the reason.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine import Engine, EngineConfig
from ..engine.cpu_threads import run_in_own_thread
from ..engine.request import Policy
from ..errors import CheckpointError, ConfigError, UnknownModelError
from ..storage import ModelPaths
from .base_model import resolve_base_model
from .export import SavedAdapter, adapter_base, export_base_name, find_adapter
from .policies import AdapterPolicy, NoAdapterPolicy
from .service import ModelService

__all__ = ["INFERENCE_GPU_MEMORY_FRACTION", "AdapterServer", "ServedModel", "base_of_adapters"]

log = logging.getLogger("tempering")

INFERENCE_GPU_MEMORY_FRACTION = 0.85
"""The KV cache's share of the GPU memory free after loading the weights when nothing trains
(a trainable model's engine takes 0.5, leaving the rest to the trainer)."""

_NAME = re.compile(r"^[^\s@\-][^\s@]{0,1023}$")  # what a request's "model" can name (no "@": name@step)


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A served adapter: its name in requests, its PEFT name, where it came from, its policy."""

    name: str
    peft_name: str
    saved: SavedAdapter
    policy: AdapterPolicy


class ServedModel:
    """One served name as the OpenAI routes see a model: the server's tokenizer, renderer, grammars
    and context (every other attribute is the server's), sampling with this name's weights."""

    def __init__(self, server: AdapterServer, policy: Policy) -> None:
        self.server = server
        self.policy = policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    def submit(self, prompt_ids: list[int], params: Any, *, n: int = 1, step: int | None = None, on_token: Any = None):
        """Queue a generation with this name's weights; a concurrent Future of n Completions."""
        return self.server.engine.submit(prompt_ids, params, n=n, policy=self.policy, on_token=on_token)


class AdapterServer(ModelService):
    """A base model and named LoRA adapters served by tempering's engine, with no trainer.

    Args:
        base_model: what to serve (resolve_base_model's forms, an adapter directory excepted).
        base_name: the base's name in requests and /v1/models (default: `base_model` as an export
            names it: a built-in model by its hub id, a directory by its absolute path).
        device, dtype, max_seq_len: as a ModelService's.
        engine_config: the engine's settings (default: EngineConfig with
            `gpu_memory_fraction=INFERENCE_GPU_MEMORY_FRACTION`).

    Raises:
        UnknownModelError: if `base_model` cannot be found, or is a LoRA adapter (serve it with
            `add_adapter` on its base instead).
        ConfigError: as ModelService's (a model that does not fit the device, a dtype it does not serve).
    """

    def __init__(self, base_model: str, *, base_name: str | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, engine_config: EngineConfig | None = None,
                 max_seq_len: int | None = None) -> None:
        if resolve_base_model(base_model).adapter_dir is not None:
            raise UnknownModelError(f"{base_model} is a LoRA adapter, not a base model: serve it as an adapter "
                                    "(--adapter NAME=DIR) on its base")
        self._peft: Any = None
        self._adapters: dict[str, LoadedAdapter] = {}
        self._num_loads = 0
        self._changes = threading.Lock()  # one add or remove at a time (reads take no lock)
        self.base_name = check_served_name(base_name or export_base_name(base_model))
        # a ModelService with no checkpoints: it never makes a trainer (nothing here trains) nor writes a file
        nowhere = ModelPaths(Path(tempfile.gettempdir()) / f"tempering-inference-{uuid.uuid4().hex}", "serve", "base")
        super().__init__(nowhere, base_model, device=device, dtype=dtype, max_seq_len=max_seq_len,
                         engine_config=engine_config or EngineConfig(gpu_memory_fraction=INFERENCE_GPU_MEMORY_FRACTION))
        self._base = ServedModel(self, NoAdapterPolicy(lambda: self._peft))

    @property
    def peft_model(self) -> Any:  # the engine's source of adapters (ModelService's is the trainer's)
        return self._peft

    # ---- the registry of the OpenAI routes -------------------------------------------------------

    def served_names(self) -> list[str]:
        """The base's name, then every adapter's, in the order they were added."""
        return [self.base_name, *list(self._adapters)]

    def resolve(self, served_name: str) -> tuple[ServedModel, None]:
        """(the model a request names, None: no saved steps here).

        Raises:
            UnknownModelError: naming the served names.
        """
        if served_name == self.base_name:
            return self._base, None
        loaded = self._adapters.get(served_name)
        if loaded is None:
            raise UnknownModelError(f"model {served_name!r} does not exist; valid names: {self.served_names()}")
        return ServedModel(self, loaded.policy), None

    def adapters(self) -> list[dict[str, Any]]:
        """Each served adapter: its name, directory and step."""
        return [{"name": a.name, "path": str(a.saved.adapter_dir), "step": a.saved.step}
                for a in list(self._adapters.values())]

    # ---- adapters --------------------------------------------------------------------------------

    def add_adapter(self, name: str, path: str | Path) -> LoadedAdapter:
        """Serve the adapter at `path` (an exported adapter, a checkpoint, or a run directory: its
        latest checkpoint) as `name`; requests may name it once this returns.

        Raises:
            ConfigError: a name that is invalid or already served, a path that holds no adapter.
            CheckpointError: an adapter that does not fit this base (its tensors' shapes are
                another model's, or it adapts modules this model lacks); nothing is changed.
        """
        from peft import PeftModel

        check_served_name(name)
        saved = find_adapter(path)
        with self._changes:
            if name == self.base_name or name in self._adapters:
                raise ConfigError(f"{name!r} is already served ({'the base model' if name == self.base_name else 'an adapter'}"
                                  "); choose another name, or remove that adapter first")
            check_adapter_fits(self.model, saved.adapter_dir)
            trained_on = adapter_base(saved)
            if trained_on is not None and export_base_name(trained_on) != export_base_name(self.base_model):
                log.warning("adapter %r (%s) names %s as its base; this server serves %s (the shapes fit)", name,
                            saved.adapter_dir, export_base_name(trained_on), export_base_name(self.base_model))
            self._num_loads += 1
            peft_name = f"adapter-{self._num_loads}"  # a PEFT name is a module key: no '.', unique per load
            with self.gate:  # the module tree an engine step reads changes between two steps
                try:
                    if self._peft is None:
                        self._peft = run_in_own_thread(PeftModel.from_pretrained, self.model, str(saved.adapter_dir),
                                                       adapter_name=peft_name, is_trainable=False)
                    else:
                        run_in_own_thread(self._peft.load_adapter, str(saved.adapter_dir), adapter_name=peft_name,
                                          is_trainable=False)
                except Exception as exc:
                    if self._peft is not None and peft_name in self._peft.peft_config:  # half-loaded: take it out
                        self._peft.delete_adapter(peft_name)
                    raise CheckpointError(f"could not load the adapter in {saved.adapter_dir}: {exc}") from exc
            loaded = LoadedAdapter(name, peft_name, saved,
                                   AdapterPolicy(self._peft, peft_name, saved.step or 0, restore=None))
            self._adapters[name] = loaded
        log.info("serving adapter %r (%s, step %s) on %s", name, saved.adapter_dir, saved.step, self.base_name)
        return loaded

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter `name` and free it; its queued and running requests fail with the reason.

        Raises:
            UnknownModelError: if no adapter of that name is served.
        """
        with self._changes:
            loaded = self._adapters.pop(name, None)
            if loaded is None:
                raise UnknownModelError(f"no adapter named {name!r} is served; served adapters: {list(self._adapters)}")
            with self.gate:
                if isinstance(self.engine, Engine):
                    self.engine.forget_adapter(loaded.peft_name)
                self._peft.delete_adapter(loaded.peft_name)
        log.info("removed adapter %r", name)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("this server only serves (tempering serve --adapter): train with `tempering serve` "
                          "without --adapter, or LocalBackend")

    train_sft = train


def check_served_name(name: str) -> str:
    """Return `name` if requests can use it as a model name; raise ConfigError otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or "@" in name:
        raise ConfigError(f"{name!r} cannot be a served model name: use 1-1024 characters, no spaces or '@', "
                          "not starting with '-'")
    return name


def base_of_adapters(paths: dict[str, str | Path]) -> str:
    """The one base the adapters at `paths` ({name: directory}) were trained on, as an export names it.

    Raises:
        ConfigError: if one names no base, or they name different ones.
    """
    bases: dict[str, list[str]] = {}
    for name, path in paths.items():
        base = adapter_base(find_adapter(path))
        if not base:
            raise ConfigError(f"adapter {name!r} ({path}) does not name its base model; pass it (--base-model)")
        bases.setdefault(export_base_name(base), []).append(name)
    if len(bases) != 1:
        described = "; ".join(f"{', '.join(names)} on {base}" for base, names in bases.items())
        raise ConfigError(f"the adapters were trained on different base models ({described}): one server serves one "
                          "base; serve each base's adapters from a server of its own (or pass --base-model)")
    return next(iter(bases))


def check_adapter_fits(model: Any, adapter_dir: Path) -> None:
    """Check, reading only the adapter's tensor shapes, that each LoRA tensor of the adapter in
    `adapter_dir` fits its module of `model` (A [r, in], B [out, r] on a linear layer).

    Raises:
        CheckpointError: naming the first tensor that does not fit, or the module the model lacks.
    """
    from safetensors import safe_open

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        return  # PEFT's older .bin format: PEFT's own load checks it
    with safe_open(str(weights), framework="pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    for key, shape in shapes.items():
        module_name, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        if not kind or ".base_layer" in module_name:
            continue  # not a LoRA tensor, or nested in a stacked-experts wrapper (PEFT checks those)
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise CheckpointError(f"the adapter in {adapter_dir} adapts {module_name}, which this base model does not "
                                  "have: it was trained on another model; serve it on that base") from None
        if not isinstance(module, torch.nn.Linear):
            module = getattr(module, "base_layer", module)  # a LoRA layer already wrapped by PEFT
        if not isinstance(module, torch.nn.Linear):
            continue
        expected = module.in_features if kind.startswith("A") else module.out_features
        got = shape[1] if kind.startswith("A") else shape[0]
        if got != expected:
            raise CheckpointError(f"the adapter in {adapter_dir} does not fit this base model: {key} has shape {shape}, "
                                  f"but {module_name} has {module.in_features} inputs and {module.out_features} outputs; "
                                  "it was trained on another model, serve it on that base")
