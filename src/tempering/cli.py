"""The `tempering` command: `tempering demo`, `tempering plot`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Reinforcement learning for LLM agents.")


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="training steps")] = 12,
    groups_per_step: Annotated[int, typer.Option(help="problems per step")] = 4,
    group_size: Annotated[int, typer.Option(help="rollouts per problem")] = 8,
    learning_rate: Annotated[float, typer.Option(help="LoRA learning rate")] = 2e-4,
    num_val: Annotated[int, typer.Option(help="held-out validation problems")] = 64,
    path: Annotated[Path, typer.Option(help="storage root")] = Path(".tempering"),
    seed: Annotated[int, typer.Option(help="seed of the problem sets")] = 0,
    max_staleness: Annotated[int, typer.Option(
        min=0, help="the next step's rollouts run while the model trains (PipelineTrainer), trained tokens at most this "
                    "many steps old; 0: the explicit loop, each step's rollouts gathered, then trained on")] = 1,
    base_model: Annotated[str, typer.Option(help="model to train: SmolLM2-135M-Instruct, gemma-3-270m, or a "
                                                 "model directory")] = "SmolLM2-135M-Instruct",
    task: Annotated[str | None, typer.Option(help="addition, or repeat-word (for a pretrained model that cannot follow "
                                                  "the addition prompt); default: the model's own, repeat-word for "
                                                  "gemma-3-270m, else addition")] = None,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs to run on, one process each (data parallel)")] = 1,
    dedicated: Annotated[bool, typer.Option(help="with --gpus > 1: GPU 0 trains, the others serve")] = False,
) -> None:
    """Train the default model (SmolLM2-135M-Instruct) on addition and show the reward rising."""
    from transformers.utils import logging as hf_logging

    from .demo import run_demo
    from .demo.run import TASKS

    hf_logging.disable_progress_bar()
    if task is not None and task not in TASKS:
        raise typer.BadParameter(f"unknown task {task!r}; choose one of {sorted(TASKS)}", param_hint="--task")
    if dedicated and gpus < 2:
        raise typer.BadParameter("dedicated mode trains on GPU 0 and serves from the others: add --gpus 2 (or more)",
                                 param_hint="--dedicated")
    result = run_demo(
        path=path, steps=steps, groups_per_step=groups_per_step, group_size=group_size,
        learning_rate=learning_rate, num_val=num_val, seed=seed, max_staleness=max_staleness or None, base_model=base_model,
        task=task, gpus=gpus, dedicated=dedicated, echo=typer.echo,
    )
    typer.echo("")
    typer.echo(f"validation reward: {result.val_reward_before:.3f} -> {result.val_reward_after:.3f} "
               f"({result.improvement:+.3f}) in {result.seconds / 60:.1f} min")
    typer.echo(f"history: {result.history_path}")
    typer.echo(f"plot:    {result.plot_path}")


@app.command()
def plot(
    project: Annotated[str, typer.Argument(help="project name")],
    models: Annotated[list[str] | None, typer.Argument(help="model names (default: every model of the project)")] = None,
    path: Annotated[Path, typer.Option(help="storage root")] = Path(".tempering"),
    metric: Annotated[list[str] | None, typer.Option(help="history keys to draw (repeatable)")] = None,
    out: Annotated[Path | None, typer.Option(help="PNG file to write")] = None,
) -> None:
    """Draw reward (and other metrics) over steps for one or several models to a PNG."""
    from .storage import ModelPaths, plot_history, read_history

    project_dir = path / project / "models"
    names = models or (sorted(p.name for p in project_dir.iterdir() if p.is_dir()) if project_dir.is_dir() else [])
    if not names:
        raise typer.BadParameter(f"no models under {project_dir}")
    histories = {name: read_history(ModelPaths(path, project, name).history) for name in names}
    metrics = tuple(metric) if metric else ("train/reward", "val/reward", "loss/train", "loss/entropy")
    target = out or (path / project / "plots" / ("reward.png" if len(names) > 1 else f"{names[0]}.png"))
    try:
        written = plot_history(histories, target, metrics=metrics, title=project)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(str(written))


@app.command()
def export(
    path: Annotated[Path, typer.Argument(help="a model's run directory (.tempering/<project>/models/<name>) or a "
                                              "checkpoint directory")],
    out: Annotated[Path, typer.Option(help="directory to write (new, or empty)")],
    step: Annotated[int | None, typer.Option(min=0, help="the checkpoint to export (default: the latest)")] = None,
    best: Annotated[bool, typer.Option(help="export the saved step with the highest --metric")] = False,
    metric: Annotated[str, typer.Option(help="what --best ranks by")] = "val/reward",
    merged: Annotated[bool, typer.Option(help="merge the adapter into the base: a transformers model directory")] = False,
    dtype: Annotated[str | None, typer.Option(help="bfloat16, float16 or float32 (default: the base's own for "
                                                   "--merged, the adapter's float32 otherwise)")] = None,
    base_model: Annotated[str | None, typer.Option(help="the base to name and merge into (default: the run's)")] = None,
) -> None:
    """Export a trained checkpoint as a standalone adapter, or merged into its base.

    The adapter (default) is a PEFT directory naming its base as you gave it, with the tokenizer
    and chat template: for PEFT, vLLM's --lora-modules, `tempering serve --adapter`. With
    --merged, the base with the adapter merged in by PEFT: a transformers model directory for
    transformers, vLLM, TGI or llama.cpp's converter. A README.md model card records the base,
    the step, the run's reward at that step and this command."""
    import shlex

    from transformers.utils import logging as hf_logging

    from .errors import ConfigError
    from .service.export import export_model

    hf_logging.disable_progress_bar()
    options = [("--step", step), ("--best", best), ("--metric", metric if best else None), ("--merged", merged),
               ("--dtype", dtype), ("--base-model", base_model)]
    command = shlex.join(["tempering", "export", str(path), "--out", str(out),
                          *[part for flag, value in options if value not in (None, False)
                            for part in ([flag] if value is True else [flag, str(value)])]])
    try:
        result = export_model(path, out=out, step=step, best=best, merged=merged, dtype=dtype, base_model=base_model,
                              metric=metric, command=command)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    what = "a merged model" if result.merged else "an adapter"
    typer.echo(f"exported step {result.step} of {path} as {what} on {result.base_model} to {result.out}")
    for key, value in sorted(result.rewards.items()):
        typer.echo(f"  {key} at step {result.step}: {value:.4f}")
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="TEMPERING_API_KEY", help="bearer key clients must send")] = None,
    root: Annotated[Path, typer.Option(help="storage root of the models")] = Path(".tempering"),
    device: Annotated[str | None, typer.Option(help="cpu, cuda, ... (default: cuda when available)")] = None,
    max_body_mb: Annotated[int, typer.Option(min=1, help="largest request body, in MiB")] = 64,
    insecure: Annotated[bool, typer.Option(help="allow no API key (loopback hosts only)")] = False,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs to serve and train on, one process each "
                                      "(under torchrun: its processes)")] = 1,
    engine_config: Annotated[str | None, typer.Option(help="the engine's EngineConfig fields as a JSON object, "
                                                      'e.g. \'{"max_num_seqs": 128}\'')] = None,
    dedicated: Annotated[bool, typer.Option(help="with --gpus N: GPU 0 trains and the others serve (ART's "
                                            "dedicated mode), for every trainable model")] = False,
    tensor_parallel_size: Annotated[int, typer.Option(min=1, help="split each model over this many GPUs "
                                                      "(tensor parallelism; = --gpus for now)")] = 1,
    dtype: Annotated[str | None, typer.Option(help="the models' dtype: bfloat16, float16 or float32 (default: "
                                              "float32 on a CPU; on a GPU float32 up to 0.5B parameters, "
                                              "bfloat16 above)")] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        help="inference only: serve the LoRA adapter in DIR (an export, a checkpoint, or a run directory's latest) "
             "as model NAME (repeatable); no training routes, no trainer memory", metavar="NAME=DIR")] = None,
    base_model: Annotated[str | None, typer.Option(
        help="inference only: the base model to serve (default: the one the adapters were trained on)")] = None,
) -> None:
    """Serve inference (OpenAI routes) and training (for RemoteBackend clients) on one port.

    With --adapter NAME=DIR (or --base-model) it serves inference only: the base model and each
    adapter by name on the OpenAI routes, from one engine that batches them together, with no
    trainer; `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes) add and
    remove adapters while it serves.

    With --gpus N (or under `torchrun --nproc-per-node N -m tempering.cli serve ...`, also over
    several machines with `--nnodes`) every GPU holds the model, an engine replica and a
    data-parallel trainer; rank 0 serves HTTP. With --dedicated, GPU 0 trains and the others
    serve, receiving the adapter after every step. With --tensor-parallel-size N (and --gpus N)
    the GPUs split one model instead: each holds its shards, rank 0's engine leads the others'.
    If a worker process or a node dies, the server stops with an error naming its rank and node
    (exit code 1).
    """
    import ipaddress
    import os

    import uvicorn

    from .errors import ConfigError
    from .parallel import Driver
    from .service import create_app
    from .service.hub import ModelHub
    from .service.jobs import TrainJobs
    from .service.worker import main as worker_main
    from .service.worker import worker_command

    if api_key is not None and not api_key.strip():  # e.g. `--api-key "$KEY"` with KEY unset: no key at all
        raise typer.BadParameter("the API key is empty: pass a non-empty --api-key or TEMPERING_API_KEY (a blank "
                                 "one would let any 'Authorization: Bearer' header in)")
    if api_key is None:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not (insecure and loopback):
            raise typer.BadParameter(
                "no API key: pass --api-key or set TEMPERING_API_KEY (--insecure allows none, on a loopback host only)"
            )
    _log_to_stderr()
    if adapter or base_model is not None:
        if gpus > 1 or dedicated or tensor_parallel_size > 1:
            raise typer.BadParameter("inference-only serving (--adapter, --base-model) runs on one device: drop "
                                     "--gpus, --dedicated and --tensor-parallel-size", param_hint="--adapter")
        _serve_adapters(adapter or [], base_model=base_model, host=host, port=port, api_key=api_key, device=device,
                        dtype=dtype, engine_config=engine_config, max_body_mb=max_body_mb)
        return
    engine = _engine_config(engine_config)
    if tensor_parallel_size > 1:
        import dataclasses

        from .engine import EngineConfig

        engine = dataclasses.replace(engine or EngineConfig(), tensor_parallel_size=tensor_parallel_size)
    device_type = "cpu" if device is not None and device.startswith("cpu") else "cuda"
    driver = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: rank 0 serves, the others work
        if int(os.environ["RANK"]) != 0:
            worker_main(["--device-type", device_type])
            return
        driver = Driver.from_env(device_type=device_type)
    elif gpus > 1:
        driver = Driver.start(gpus, device_type=device_type, command=worker_command(device_type, 600.0))
    try:
        hub = ModelHub(root, device=device, driver=driver, engine_config=engine, dedicated=dedicated, dtype=dtype)
    except BaseException as exc:
        if driver is not None:
            driver.close()
        if isinstance(exc, ConfigError):  # a device this machine lacks, --dedicated on one GPU, an unshared --root
            hint = ("--dedicated" if "dedicated" in str(exc) else "--root" if "storage root" in str(exc)
                    else "--dtype" if "dtype" in str(exc) else "--tensor-parallel-size"
                    if "tensor_parallel_size" in str(exc) else "--device")
            raise typer.BadParameter(str(exc), param_hint=hint) from None
        raise
    application = create_app(hub.registry, api_key=api_key, hub=hub, jobs=TrainJobs(hub), max_body_bytes=max_body_mb << 20)
    server = uvicorn.Server(uvicorn.Config(application, host=host, port=port, log_level="warning"))
    failures = []
    if driver is not None:
        def stop(error: Exception) -> None:
            failures.append(error)
            server.should_exit = True

        driver.on_failure(stop)
    on = ""
    if driver is not None:
        on = f" on {driver.info.world_size} {'GPUs' if device_type == 'cuda' else 'CPU processes'}"
        on += f" of {len(driver.nodes)} nodes" if len(driver.nodes) > 1 else ""
    typer.echo(f"tempering serving {root}{on} on http://{host}:{port} (OpenAI base URL http://{host}:{port}/v1)")
    try:
        server.run()
    finally:
        hub.close()
        if driver is not None:
            driver.close()
    if failures:
        typer.echo(f"tempering serve stopped: {failures[0]}", err=True)
        raise typer.Exit(1)


def _serve_adapters(specs: list[str], *, base_model: str | None, host: str, port: int, api_key: str | None,
                    device: str | None, dtype: str | None, engine_config: str | None, max_body_mb: int) -> None:
    """`tempering serve --adapter NAME=DIR ...`: an AdapterServer on the OpenAI routes and the adapter routes."""
    import dataclasses
    import json

    import uvicorn

    from .engine import EngineConfig
    from .errors import CheckpointError, ConfigError
    from .service import create_app
    from .service.adapter_server import INFERENCE_GPU_MEMORY_FRACTION, AdapterServer, base_of_adapters
    from .service.hub import _check_device
    from .service.service import dtype_named

    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"{spec!r}: write NAME=DIR, e.g. --adapter demo=.tempering/demo/models/run",
                                     param_hint="--adapter")
        if name in adapters:
            raise typer.BadParameter(f"two adapters are named {name!r}", param_hint="--adapter")
        adapters[name] = path
    engine = _engine_config(engine_config) or EngineConfig()
    if "gpu_memory_fraction" not in (json.loads(engine_config) if engine_config else {}):  # nothing trains here
        engine = dataclasses.replace(engine, gpu_memory_fraction=INFERENCE_GPU_MEMORY_FRACTION)
    try:
        if device is not None:
            _check_device(device)
        base = base_model or base_of_adapters(adapters)
        server = AdapterServer(base, device=device, dtype=dtype_named(dtype), engine_config=engine)
        try:
            for name, path in adapters.items():
                server.add_adapter(name, path)
        except BaseException:
            server.close()
            raise
    except (ConfigError, CheckpointError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--base-model" if "base" in str(exc) else "--adapter") from None
    application = create_app(server, api_key=api_key, adapters=server, max_body_bytes=max_body_mb << 20)
    names = ", ".join(server.served_names())
    typer.echo(f"tempering serving {names} (inference only) on http://{host}:{port} "
               f"(OpenAI base URL http://{host}:{port}/v1)")
    try:
        uvicorn.Server(uvicorn.Config(application, host=host, port=port, log_level="warning")).run()
    finally:
        server.close()


def _log_to_stderr() -> None:
    """tempering's own log lines at INFO and above (which engine serves a model and why, training
    notes) on stderr, as `tempering serve` runs with no logging set up."""
    import logging

    logger = logging.getLogger("tempering")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s tempering: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _engine_config(text: str | None):
    """`--engine-config`'s JSON object as an EngineConfig (None: the hub's default)."""
    if text is None:
        return None
    import json

    from .engine import EngineConfig
    from .errors import ConfigError

    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise TypeError(f"a JSON object is needed, got {type(fields).__name__}")
        return EngineConfig(**fields)
    except (ValueError, TypeError, ConfigError) as exc:
        raise typer.BadParameter(f"--engine-config: {exc}") from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
