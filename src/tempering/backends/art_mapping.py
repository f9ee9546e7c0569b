"""Apply ART's options (the table in `art_options`) to tempering's settings.

`resolve_internal_config` turns a model's `_internal_config` into engine, LoRA, max-length and
step-default settings; `train_config_from_options` turns `backend.train` keyword options (and
`model.train(_config=...)`) into a TrainConfig; `lora_config_from_art` reads ART's LoRAConfig
dict. Ignored options get one `ArtOptionWarning` per call naming all of them; refused ones raise
`UnsupportedOptionError`; unknown names raise `UnknownOptionError` where ART would fail too.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, UnknownOptionError, UnsupportedOptionError
from ..types import LoRAConfig, TrainConfig
from .art_options import BY_KEY, SECTIONS, ArtOption

__all__ = [
    "ArtOptionWarning",
    "ModelOptions",
    "apply_train_defaults",
    "as_engine_config",
    "check_backend_options",
    "engine_config_with",
    "lora_config_from_art",
    "merge_lora",
    "resolve_internal_config",
    "train_config_from_options",
]


class ArtOptionWarning(UserWarning):
    """An ART option was accepted but has no effect in tempering (results do not depend on it)."""


@dataclass(slots=True)
class ModelOptions:
    """Tempering settings resolved from a model's ART options.

    Attributes:
        engine: EngineConfig field overrides.
        lora: LoRAConfig fields.
        train: TrainConfig fields used as the default of every step (a step's own value wins).
        max_seq_len: the model's max sequence length in tokens (None: the model's context length).
        dtype: the model's dtype name ("bfloat16", "float16", "float32"; None: the device's default).
        placement: ART's `trainer_gpu_ids` / `inference_gpu_ids`, as given.
        num_gpus: with both ids given (dedicated mode: rank 0 trains, the others serve), the
            GPUs the backend must run on; None otherwise.
    """

    engine: dict[str, Any] = field(default_factory=dict)
    lora: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    max_seq_len: int | None = None
    dtype: str | None = None
    placement: dict[str, Any] = field(default_factory=dict)
    num_gpus: int | None = None

    @property
    def dedicated(self) -> bool:
        return self.num_gpus is not None


def _accepts(option: ArtOption, value: Any) -> bool:
    for ok in option.accepts:
        if isinstance(value, bool) or isinstance(ok, bool):  # True == 1, but True is not an accepted 1
            if value is ok:
                return True
        elif value == ok:
            return True
    return False


def _apply_section(section: str, values: Mapping[str, Any], out: ModelOptions, ignored: list[str]) -> None:
    """Apply one section's options to `out`; collect ignored names; raise on refused values."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{section} must be a dict of options, got {type(values).__name__}")
    for name, value in values.items():
        option = BY_KEY.get((section, name))
        where = f"{section}.{name}" if section in ("engine_args", "init_args", "peft_args", "trainer_args") else name
        if option is None:
            if SECTIONS[section].unknown == "error":
                raise UnknownOptionError(f"unknown option {where!r}; see the table of ART options in docs/guides/art-compatibility.md#art-options")
            ignored.append(where)
        elif option.status in ("mapped", "differs") and option.to is not None:
            if value is None:  # ART's TypedDicts allow None for "not set"
                continue
            bucket, convert = option.to
            updates = convert(value)
            if bucket == "model":
                if "dtype" in updates:  # engine_args.dtype wins over init_args.dtype (read later); "auto": none
                    out.dtype = updates["dtype"]
                if "max_seq_len" in updates:  # init_args.max_seq_length and engine_args.max_model_len: the smaller wins
                    given = int(updates["max_seq_len"])
                    out.max_seq_len = given if out.max_seq_len is None else min(out.max_seq_len, given)
            else:
                getattr(out, bucket).update(updates)
        elif option.status == "ignored":
            ignored.append(where)
        elif option.status == "refused" and not _accepts(option, value):
            raise UnsupportedOptionError(
                f"tempering cannot honour {where}={value!r} ({option.note}); ignoring it would change results. "
                f"Leave it out or set it to {option.accepts[0]!r}.")


def _warn_ignored(ignored: list[str], where: str) -> None:
    if ignored:
        warnings.warn(
            f"{where}: tempering has no equivalent of {', '.join(ignored)} and ignores "
            f"{'it' if len(ignored) == 1 else 'them'} (results do not depend on "
            f"{'it' if len(ignored) == 1 else 'them'}; see the table of ART options in docs/guides/art-compatibility.md#art-options)",
            ArtOptionWarning, stacklevel=2)


def resolve_internal_config(config: Mapping[str, Any] | None, *, warn: bool = True) -> ModelOptions:
    """Tempering settings from ART's `_internal_config` (an `art.dev.InternalModelConfig` dict).

    Args:
        config: None, or a dict with ART's keys (`engine_args`, `init_args`, `peft_args`,
            `trainer_args`, ...); nested values are dicts too.
        warn: emit one ArtOptionWarning naming every option that has no effect.

    Raises:
        ConfigError: if `config` or one of its sections is not a dict.
        UnsupportedOptionError: an option tempering cannot honour with the given value.
    """
    out = ModelOptions()
    if config is None:
        return out
    if not isinstance(config, Mapping):
        raise ConfigError(f"_internal_config must be a dict (art.dev.InternalModelConfig), got {type(config).__name__}")
    ignored: list[str] = []
    top = {k: v for k, v in config.items() if k not in ("engine_args", "init_args", "peft_args", "trainer_args")}
    _apply_section("internal_config", top, out, ignored)
    for section in ("init_args", "engine_args", "peft_args", "trainer_args"):
        if config.get(section) is not None:
            _apply_section(section, config[section], out, ignored)
    if out.placement:
        out.num_gpus = _dedicated_gpus(out.placement.get("trainer_gpu_ids"), out.placement.get("inference_gpu_ids"))
    if warn:
        _warn_ignored(ignored, "_internal_config")
    return out


def _dedicated_gpus(trainer: Any, inference: Any) -> int:
    """The GPUs dedicated mode runs on, from ART's `trainer_gpu_ids` and `inference_gpu_ids`.

    Raises:
        ConfigError: if only one is given, or either is not a list of GPU indices.
        UnsupportedOptionError: for a placement tempering does not run: it trains on GPU 0 alone
            and serves from every other GPU of the run.
    """
    if trainer is None or inference is None:
        given, missing = ("trainer_gpu_ids", "inference_gpu_ids")
        if trainer is None:
            given, missing = missing, given
        raise ConfigError(f"_internal_config has {given} but not {missing}; dedicated mode needs both "
                          "(e.g. trainer_gpu_ids=[0], inference_gpu_ids=[1])")
    for key, ids in (("trainer_gpu_ids", trainer), ("inference_gpu_ids", inference)):
        indices = ids if isinstance(ids, list | tuple) else []
        if not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            raise ConfigError(f"_internal_config[{key!r}] must be a non-empty list of GPU indices, got {ids!r}")
    if list(trainer) != [0]:
        raise UnsupportedOptionError(f"trainer_gpu_ids={list(trainer)!r}: in dedicated mode tempering trains on GPU 0 "
                                     "alone; use trainer_gpu_ids=[0]")
    if sorted(inference) != list(range(1, len(inference) + 1)) or len(set(inference)) != len(inference):
        raise UnsupportedOptionError(f"inference_gpu_ids={list(inference)!r}: tempering serves from GPUs 1..N-1 of a "
                                     f"run on N GPUs; use inference_gpu_ids={list(range(1, len(inference) + 1))!r}")
    return 1 + len(inference)


def lora_config_from_art(config: Mapping[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """LoRAConfig fields from ART's `art.dev.LoRAConfig` dict (`rank`, `alpha`, `dropout`, ...).

    Raises:
        UnsupportedOptionError: an option tempering cannot honour with the given value.
    """
    out, ignored = ModelOptions(), []
    _apply_section("lora_config", config, out, ignored)
    if warn:
        _warn_ignored(ignored, "lora_config")
    return out.lora


def merge_lora(lora: LoRAConfig | None, options: ModelOptions) -> LoRAConfig | None:
    """The model's LoRAConfig: `lora_config`, or the one ART's `peft_args` describe.

    Raises:
        ConfigError: if both are given.
    """
    if not options.lora:
        return lora
    if lora is not None:
        raise ConfigError("both lora_config and _internal_config['peft_args'] are set; keep one (lora_config)")
    return LoRAConfig(**options.lora)


def check_backend_options(options: Mapping[str, Any]) -> None:
    """Check ART's `LocalBackend(...)` keyword options that tempering has no use for.

    Raises:
        UnknownOptionError: an option ART's LocalBackend does not have either.
    """
    ignored: list[str] = []
    _apply_section("local_backend", options, ModelOptions(), ignored)
    _warn_ignored(ignored, "LocalBackend")


def train_config_from_options(options: Mapping[str, Any], *, base: TrainConfig | None = None) -> TrainConfig:
    """A TrainConfig from ART >= 0.5.18 `backend.train` keyword options (or `model.train(_config=...)`).

    TrainConfig's own field names are accepted too; `base` supplies the values not given.

    Raises:
        UnknownOptionError: an option that neither TrainConfig nor ART's backend.train has.
        UnsupportedOptionError: an ART option tempering cannot honour with the given value.
        ConfigError: an invalid value.
    """
    native = {k: v for k, v in options.items() if k in TrainConfig.model_fields and (("train", k) not in BY_KEY)}
    art = {k: v for k, v in options.items() if k not in native}
    out, ignored = ModelOptions(), []
    _apply_section("train", art, out, ignored)
    _warn_ignored(ignored, "train options")
    fields = dict(base.model_dump(exclude_unset=True)) if base is not None else {}
    mask_ratio = out.train.pop("_mask_prob_ratio", False)
    fields.update(out.train)
    fields.update(native)
    config = TrainConfig(**fields)
    if mask_ratio:
        config = config.model_copy(update={"importance_ratio_mask": (1 - config.clip_low, 1 + config.clip_high)})
    return config


def apply_train_defaults(config: TrainConfig, defaults: Mapping[str, Any]) -> TrainConfig:
    """`config` with `defaults` filled in where the caller did not set the field itself."""
    unset = {k: v for k, v in defaults.items() if k not in config.model_fields_set}
    return TrainConfig(**{**config.model_dump(exclude_unset=True), **unset}) if unset else config


def as_engine_config(value: Any, max_batch_size: int) -> Any:
    """`LocalBackend(engine_config=...)` as an EngineConfig: None (max_num_seqs = max_batch_size),
    an EngineConfig, or a dict of its fields (as `tempering serve --engine-config` takes).

    Raises:
        UnknownOptionError: for a dict key that is not an EngineConfig field.
        ConfigError: for any other type.
    """
    from ..engine import EngineConfig

    if value is None:
        return EngineConfig(max_num_seqs=max_batch_size)
    if isinstance(value, EngineConfig):
        return value
    if isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise UnknownOptionError(f"engine_config has no option(s) {unknown}; EngineConfig's fields are {sorted(fields)}")
        return EngineConfig(**value)
    raise ConfigError(f"engine_config must be a tempering.engine.EngineConfig or a dict of its fields, "
                      f"got {type(value).__name__}")


def engine_config_with(base: Any, updates: Mapping[str, Any]) -> Any:
    """`base` (an EngineConfig) with `updates` applied (validated by EngineConfig itself)."""
    return dataclasses.replace(base, **updates) if updates else base
