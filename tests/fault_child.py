"""A training process that tests/test_faults.py kills, starves of disk or of memory: real faults.

    python tests/fault_child.py ROOT BASE_MODEL SCENARIO '{"option": ...}'

It prints one JSON object per line on stdout (what it saw), and the test reads them. Scenarios:

- `train`: register model "m" under ROOT (resuming from what is there), report the resumed step,
  any temporary file left (there must be none after a clean start), whether the optimizer state
  came back, and whether every checkpoint's files are whole; answer a chat completion; then train
  up to step `until`. With `kill_at` (a moment named in KILL_POINTS) and `kill_step`, the process
  SIGKILLs itself at that moment of the training call that makes step `kill_step`: inside the
  optimizer step (torch's optimizer hook), or at a file operation (a `sys.audit` hook, which sees
  every `open`, rename and unlink the process makes). Nothing is patched: the process dies as it
  would if `kill -9` came at that instant.
- `disk_full`: train step 1, then lower RLIMIT_FSIZE so that no file over 1 MiB can be written
  (the OS refuses the write, as a full disk does), train step 2 (its checkpoint write fails), check
  that the server still answers and the saved step still loads, raise the limit and train again.
- `oom`: train step 1, then cap the address space (RLIMIT_AS) at what the process uses plus
  `headroom_mb`, train a step far larger than that (the OS refuses the memory), check the step was
  undone and the server answers, lift the cap and train a normal step.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
from pathlib import Path

import tempering as art
from tempering.storage import ModelPaths, list_checkpoints, verify_checkpoint

NAME, PROJECT = "m", "faults"
KILL_POINTS = ("optimizer_step", "checkpoint_file", "checkpoint_rename", "drop_state", "retention_delete",
               "compaction", "history_append")
CONFIG = art.TrainConfig(learning_rate=1e-3, keep_last_checkpoints=3, best_checkpoint_metric=None)
training = {"step": None}  # the step the running training call makes


def say(**record) -> None:
    print(json.dumps(record), flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill_at: str, kill_step: int) -> None:
    """SIGKILL this process at `kill_at` (see the module docstring) during the call that makes `kill_step`."""
    tag, older = f"{kill_step:04d}", f"{kill_step - 1:04d}"

    def hook(event: str, args: tuple) -> None:
        if training["step"] != kill_step or not args:
            return
        path = os.fsdecode(args[0]) if isinstance(args[0], str | bytes | os.PathLike) else ""
        if ((kill_at == "checkpoint_file" and event == "open" and f"/.tmp-{tag}-" in path
             and path.endswith("trainer_state.json") and "w" in str(args[1]))
                or (kill_at == "checkpoint_rename" and event == "os.rename" and f"/.tmp-{tag}-" in path)
                or (kill_at == "drop_state" and event == "os.remove" and path.endswith(f"/{older}/optimizer.pt"))
                or (kill_at == "retention_delete" and event == "os.rename" and "/.del-" in os.fsdecode(args[1]))
                or (kill_at == "compaction" and event == "os.remove" and "/trajectories/" in path
                    and path.endswith(".jsonl"))
                or (kill_at == "history_append" and event == "open" and path.endswith("history.jsonl")
                    and str(args[1]).startswith("a"))):
            die()

    sys.addaudithook(hook)


async def rollouts(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    """One group of two short rollouts with rewards 0 and 1 (so the group has spread)."""
    client = model.openai_client()
    group = []
    for reward in (0.0, 1.0):
        completion = await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Count to three."}], max_tokens=4)
        group.append(art.Trajectory(messages_and_choices=[{"role": "user", "content": "Count to three."},
                                                          completion.choices[0]], reward=reward))
    return [art.TrajectoryGroup(group)]


def strays(paths: ModelPaths) -> list[str]:
    """Temporary files of an interrupted write that are still there."""
    found = [p for p in paths.checkpoints_dir.glob(".*")] if paths.checkpoints_dir.is_dir() else []
    found += list(paths.trajectories_dir.glob("*/.*")) if paths.trajectories_dir.is_dir() else []
    found += list(paths.model_dir.glob(".*"))
    return sorted(str(p.relative_to(paths.model_dir)) for p in found)


async def train_scenario(backend: art.LocalBackend, model: art.TrainableModel, paths: ModelPaths, options: dict) -> None:
    step = await model.get_step()
    service = backend.hub.service(model.name)
    damaged = []
    for info in list_checkpoints(paths.checkpoints_dir):
        try:
            verify_checkpoint(info.path)
        except art.CheckpointError as exc:
            damaged.append(str(exc))
    newest = list_checkpoints(paths.checkpoints_dir)
    say(registered=step, latest_on_disk=newest[-1].step if newest else 0, strays=strays(paths), damaged=damaged,
        optimizer_state=bool(service.trainer and service.trainer.optimizer.state))
    await rollouts(model)  # the server answers
    if len(newest) > 1:  # an older kept step (its adapter alone: no optimizer state) is served from its files
        await model.openai_client().chat.completions.create(
            model=model.get_inference_name(newest[0].step), messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        say(served_kept_step=newest[0].step)
    if options.get("kill_at"):
        arm(options["kill_at"], options["kill_step"])
    hooked = False
    while step < options["until"]:
        training["step"] = step + 1
        if options.get("kill_at") == "optimizer_step" and not hooked and service.trainer is not None:
            service.trainer.optimizer.register_step_post_hook(
                lambda *_: die() if training["step"] == options["kill_step"] else None)
            hooked = True
        say(training=step + 1)
        result = await model.train(await rollouts(model), config=CONFIG)
        step = result.step
        say(trained=step)
    say(done=step)


async def disk_full_scenario(model: art.TrainableModel, paths: ModelPaths) -> None:
    await model.train(await rollouts(model), config=CONFIG)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    groups = await rollouts(model)
    try:
        await model.train(groups, config=CONFIG)
        error = None
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    after = {"step": await model.get_step(), "checkpoints": sorted(p.name for p in paths.checkpoints_dir.iterdir())}
    verify_checkpoint(paths.checkpoint(1))
    served = await model.openai_client().chat.completions.create(  # the saved step, loaded from its files
        model=model.get_inference_name(1), messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    retried = await model.train(groups, config=CONFIG)
    say(error=error, after=after, served_saved_step=bool(served.choices), retried_step=retried.step,
        checkpoints=sorted(p.name for p in paths.checkpoints_dir.iterdir()))


def vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


async def oom_scenario(model: art.TrainableModel, service, options: dict) -> None:
    from tempering.types import Choice

    await model.train(await rollouts(model), config=CONFIG)
    probe = [{"role": "user", "content": "Count to three."}]
    prompt = service.renderer.render_prompt(probe)
    length = options["completion_tokens"]

    def long_choice(seed: int) -> Choice:
        return Choice.model_validate({
            "index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "x"},
            "token_ids": [(1000 + seed + 7 * i) % 40000 for i in range(length)], "prompt_token_ids": prompt,
            "sampled_logprobs": [-1.0] * length})

    big = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*probe, long_choice(s)], reward=float(s))
                                for s in range(2)])]
    too_big = CONFIG.model_copy(update={"gradient_checkpointing": False})
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size_bytes() + (options["headroom_mb"] << 20), hard))
    try:
        await model.train(big, config=too_big)
        error = None
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "is_memory_error": isinstance(exc, MemoryError)}
    step = await model.get_step()
    served = await model.openai_client().chat.completions.create(model=model.name, messages=probe, max_tokens=4)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    retried = await model.train(await rollouts(model), config=CONFIG)
    say(error=error, step_after_error=step, served=bool(served.choices), retried_step=retried.step)


async def main() -> None:
    root, base_model, scenario = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    paths = ModelPaths(root, PROJECT, NAME)
    async with art.LocalBackend(path=root) as backend:
        model = art.TrainableModel(name=NAME, project=PROJECT, base_model=base_model)
        await model.register(backend)
        if scenario == "train":
            await train_scenario(backend, model, paths, options)
        elif scenario == "disk_full":
            await disk_full_scenario(model, paths)
        elif scenario == "oom":
            await oom_scenario(model, backend.hub.service(model.name), options)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(main())
