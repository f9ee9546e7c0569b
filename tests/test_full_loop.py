"""The whole loop on the real default model: gather → train → get_step, resume, bad input."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import weakref

import pytest
import torch
from openai.types.chat.chat_completion import Choice

import tempering as art
from tempering.errors import CheckpointError, TrajectoryError, UnknownModelError

PROMPTS = ["What is 3+4? Answer with just the number.", "Name a color."]
PROBE = [{"role": "user", "content": "What is 5+6? Answer with just the number."}]


async def rollout(model: art.TrainableModel, prompt: str) -> art.Trajectory:
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages(), max_tokens=8, temperature=1.0)
    choice = completion.choices[0]
    traj.messages_and_choices.append(choice)
    # a continuous reward in (0, 1] that differs between samples, so every group has spread
    logprobs = list(choice.sampled_logprobs)
    traj.reward = math.exp(sum(logprobs) / len(logprobs))
    return traj


async def gather(model, group_size=4):
    return await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, p) for _ in range(group_size)) for p in PROMPTS), pbar_desc=None)


async def probe_logprobs(model, name=None):
    completion = await model.openai_client().chat.completions.create(
        model=name or model.name, messages=PROBE, max_tokens=6, temperature=0)
    choice = completion.choices[0]
    return choice.token_ids, list(choice.sampled_logprobs)


def assert_same_policy(probe, expected, tol=1e-4):
    """Same greedy tokens and logprobs within `tol` (batching and prefix caching change the last bits)."""
    (ids, lps), (ids_expected, lps_expected) = probe, expected
    assert ids == ids_expected
    assert max(abs(a - b) for a, b in zip(lps, lps_expected)) < tol


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, loop, default_model_dir):
    """A model trained for one step with model.train; yields (model, backend, root, probes)."""
    root = tmp_path_factory.mktemp("loop")
    backend = art.LocalBackend(path=root)
    model = art.TrainableModel(name="loop", project="tests", base_model="SmolLM2-135M-Instruct")

    async def setup():
        await model.register(backend)
        assert await model.get_step() == 0
        before = await probe_logprobs(model)
        groups = await gather(model)
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        after = await probe_logprobs(model)
        return result, before, after

    result, before, after = loop.run_until_complete(setup())
    yield model, backend, root, {"result": result, "before": before, "after": after}
    loop.run_until_complete(backend.close())


def test_a_train_step_advances_the_step_and_serves_the_new_adapter(trained, loop):
    model, _, root, probes = trained
    assert probes["result"].step == 1
    assert loop.run_until_complete(model.get_step()) == 1
    (ids_before, lp_before), (ids_after, lp_after) = probes["before"], probes["after"]
    # logprobs are comparable while the greedy tokens agree; a different greedy token is a change too
    same = 0
    while same < min(len(ids_before), len(ids_after)) and ids_before[same] == ids_after[same]:
        same += 1
    changed = ids_before != ids_after or max(abs(a - b) for a, b in zip(lp_before[:same], lp_after[:same])) > 1e-4
    assert changed, "the train step did not change the served policy"
    # name@0 still serves the policy the model started from
    ids0, lp0 = loop.run_until_complete(probe_logprobs(model, f"{model.name}@0"))
    assert ids0 == ids_before
    assert max(abs(a - b) for a, b in zip(lp0, lp_before)) < 1e-4


def test_the_checkpoint_is_a_peft_adapter_with_optimizer_state(trained, default_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, _, root, _ = trained
    checkpoint = root / "tests" / "models" / "loop" / "checkpoints" / "0001"
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name
    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(checkpoint))
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B started at 0: the step changed it


def test_history_and_trajectories_are_written(trained):
    _, _, root, _ = trained
    model_dir = root / "tests" / "models" / "loop"
    [row] = [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()]
    for key in ("train/reward", "train/reward_std_dev", "loss/train", "loss/grad_norm", "data/step_trainer_tokens",
                "data/step_num_groups_skipped", "time/step_wall_s", "time/step_prepare_s", "time/step_checkpoint_s",
                "time/step_send_adapter_s", "time/step_write_trajectories_s"):
        assert key in row and math.isfinite(row[key]), key
    # the call's phases, each apart from the trainer's own step, within its wall time
    phases = ("time/step_prepare_s", "time/step_trainer_s", "time/step_checkpoint_s", "time/step_send_adapter_s",
              "time/step_write_trajectories_s")
    assert row["time/step_checkpoint_s"] > 0 and sum(row[k] for k in phases) <= row["time/step_wall_s"]
    assert row["step"] == 0
    lines = (model_dir / "trajectories" / "train" / "0000.jsonl").read_text().splitlines()
    assert len(lines) == 8
    assert json.loads((model_dir / "model.json").read_text())["base_model"] == "SmolLM2-135M-Instruct"


def test_bad_input_is_rejected_and_nothing_changes(trained, loop):
    model, backend, _, probes = trained

    async def check():
        with pytest.raises(TrajectoryError, match="empty list"):
            await model.train([])
        groups = await gather(model, group_size=2)
        groups[0].trajectories[0].reward = float("nan")
        with pytest.raises(TrajectoryError, match="finite"):
            await model.train(groups)
        no_choice = art.TrajectoryGroup([
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], reward=r)
            for r in (0.0, 1.0)
        ])
        with pytest.raises(TrajectoryError, match="nothing to train on"):
            await model.train([no_choice])
        groups = await gather(model, group_size=2)
        groups[0].trajectories[1].messages_and_choices[-1].token_ids[0] = 10**6  # a Choice of another model
        with pytest.raises(TrajectoryError, match="group 0, trajectory 1: token id 1000000 is outside the model's vocab"):
            await model.train(groups)  # an IndexError; on a GPU a device-side assert that ends the server
        assert await model.get_step() == 1
        assert_same_policy(await probe_logprobs(model), probes["after"])

    loop.run_until_complete(check())


def test_a_trajectory_with_no_assistant_turn_counts_in_its_group_and_adds_no_tokens(trained, loop):
    """ART's self-play tic-tac-toe, as its train loop calls it: when X's first move is invalid the
    game ends, and O's trajectory holds only its system prompt."""
    _, backend, root, _ = trained
    o_player = art.TrainableModel(name="self-play", project="tests", base_model="SmolLM2-135M-Instruct")

    async def check():
        await o_player.register(backend)
        played = await rollout(o_player, PROMPTS[0])
        played.reward = 1.0
        unplayed = [art.Trajectory(messages_and_choices=[{"role": "system", "content": "You play O."}], reward=r)
                    for r in (0.0, 0.5)]
        with pytest.raises(TrajectoryError, match="none of the 2 trajectories has an assistant turn"):
            await o_player.train([art.TrajectoryGroup(unplayed)])  # no tokens in the whole batch: refused
        assert await o_player.get_step() == 0
        return await o_player.train([art.TrajectoryGroup([played, unplayed[0]])],
                                    config=art.TrainConfig(learning_rate=1e-3))

    result = loop.run_until_complete(check())
    # alone, `played` would have no reward spread; the unplayed game's reward gives it its advantage
    assert result.step == 1 and result.num_groups_trainable == 1 and not result.is_adapter_unchanged
    [row] = [json.loads(line) for line in (root / "tests/models/self-play/history.jsonl").read_text().splitlines()]
    assert row["data/step_num_trajectories_without_tokens"] == 1 and row["train/num_trajectories"] == 2


def test_a_crash_during_a_step_leaves_the_checkpoint_and_the_live_policy_intact(trained, loop, monkeypatch):
    model, backend, root, probes = trained
    checkpoints = root / "tests" / "models" / "loop" / "checkpoints"

    def bad_choice(token_id):  # a token id outside the vocabulary: the forward pass raises
        return Choice.model_validate({
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "?"},
            "logprobs": {"content": [{"token": "?", "logprob": -1.0, "bytes": [], "top_logprobs": []}]},
            "token_ids": [token_id], "prompt_token_ids": [1, 2, 3],
        })

    async def check():
        groups = await gather(model, group_size=2)
        broken = art.TrajectoryGroup([
            art.Trajectory(messages_and_choices=[bad_choice(10**9)], reward=r) for r in (0.0, 1.0)
        ])
        with pytest.raises(Exception):
            await model.train([*groups, broken])
        assert await model.get_step() == 1
        assert_same_policy(await probe_logprobs(model), probes["after"])

        def disk_full(*args, **kwargs):
            raise OSError("No space left on device")

        monkeypatch.setattr(torch, "save", disk_full)  # the checkpoint write fails after the update
        with pytest.raises(CheckpointError, match="No space left"):
            await model.train(groups)
        monkeypatch.undo()
        assert sorted(p.name for p in checkpoints.iterdir()) == ["0001"]
        assert await model.get_step() == 1
        assert_same_policy(await probe_logprobs(model), probes["after"])

    loop.run_until_complete(check())


def test_a_fresh_backend_resumes_at_the_saved_step_and_serves_the_saved_adapter(trained, loop):
    model, backend, root, probes = trained

    async def check():
        saved = json.loads((root / "tests" / "models" / "loop" / "checkpoints" / "0001" / "trainer_state.json").read_text())
        async with art.LocalBackend(path=root) as fresh:
            again = art.TrainableModel(name="loop", project="tests", base_model="SmolLM2-135M-Instruct")
            await again.register(fresh)
            assert await again.get_step() == 1
            assert_same_policy(await probe_logprobs(again), probes["after"])
            trainer = fresh._registry.get("loop").trainer
            assert trainer.num_updates == saved["num_updates"]
            assert len(trainer.optimizer.state) > 0  # Adam moments restored
            # ART >= 0.5.18 style call on the resumed model
            result = await fresh.train(again, await gather(again, group_size=2), learning_rate=1e-3)
            assert result.step == 2 and await again.get_step() == 2
            # step 1's adapter is loaded on demand from its checkpoint, next to the live one
            assert_same_policy(await probe_logprobs(again, "loop@1"), probes["after"])
            assert (await probe_logprobs(again))[1] != probes["after"][1]

    loop.run_until_complete(check())


def test_a_peft_adapter_directory_as_base_model_starts_from_that_adapter(trained, loop, tmp_path):
    model, _, root, probes = trained
    adapter = root / "tests" / "models" / "loop" / "checkpoints" / "0001"

    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            child = art.TrainableModel(name="child", project="tests", base_model=str(adapter))
            await child.register(backend)
            assert await child.get_step() == 0
            assert_same_policy(await probe_logprobs(child), probes["after"])

    loop.run_until_complete(check())


def test_unknown_base_model_is_a_clear_error(tmp_path, loop):
    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            with pytest.raises(UnknownModelError, match="SmolLM2-135M-Instruct"):
                await art.TrainableModel(name="x", project="tests", base_model="no/such-model-anywhere").register(backend)

    loop.run_until_complete(check())


def test_delete_checkpoints_keeps_the_latest_and_the_best(tmp_path, loop, tiny_model_dir):
    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="prune", project="tests", base_model=str(tiny_model_dir))
            await model.register(backend)  # a local HF model directory as base_model
            for reward in (0.2, 0.9, 0.1):
                await model.train(await gather(model, group_size=2), config=art.TrainConfig(learning_rate=1e-5))
                val = art.Trajectory(messages_and_choices=[], reward=reward)
                await model.log([val], split="val")  # logged at the new step
            checkpoints = tmp_path / "tests" / "models" / "prune" / "checkpoints"
            assert sorted(p.name for p in checkpoints.iterdir()) == ["0001", "0002", "0003"]
            deleted = await model.delete_checkpoints("val/reward")
            assert deleted == [1]  # step 2 is the best (0.9), step 3 the latest
            assert sorted(p.name for p in checkpoints.iterdir()) == ["0002", "0003"]
            history = [json.loads(line) for line in (checkpoints.parent / "history.jsonl").read_text().splitlines()]
            assert [(r["step"], r["val/reward"]) for r in history if "val/reward" in r] == [(1, 0.2), (2, 0.9), (3, 0.1)]

    loop.run_until_complete(check())


def test_registering_a_name_twice_at_once_loads_it_once_and_another_base_model_is_refused(tmp_path, loop, tiny_model_dir):
    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            loads = []
            load = backend.hub._load
            backend.hub._load = lambda *args, **kwargs: loads.append(1) or load(*args, **kwargs)
            twins = [art.TrainableModel(name="twice", project="tests", base_model=str(tiny_model_dir)) for _ in range(2)]
            await asyncio.gather(*(m.register(backend) for m in twins))
            assert len(loads) == 1  # each loaded a copy, and the second one was never closed
            other = art.TrainableModel(name="twice", project="tests", base_model="SmolLM2-135M-Instruct")
            with pytest.raises(art.ConfigError, match="registered with base model .*Register it with base_model="):
                await other.register(backend)
            model_json = json.loads((tmp_path / "tests" / "models" / "twice" / "model.json").read_text())
            assert model_json["base_model"] == str(tiny_model_dir)  # not overwritten by the refused one

    loop.run_until_complete(check())


def test_a_train_call_still_queued_when_the_backend_closes_fails_with_backend_error(tmp_path, loop, tiny_model_dir):
    import threading

    async def check():
        backend = art.LocalBackend(path=tmp_path)
        model = art.TrainableModel(name="closing", project="tests", base_model=str(tiny_model_dir))
        await model.register(backend)
        groups = await gather(model, group_size=2)
        busy = threading.Event()
        backend.hub.train_executor.submit(busy.wait, 30)  # the training thread is taken: the next call queues
        queued = asyncio.ensure_future(backend.train(model, groups))
        await asyncio.sleep(0.1)
        await backend.close()
        busy.set()
        with pytest.raises(art.BackendError, match="closed before this training call ran"):
            await queued  # a bare CancelledError, as if the caller's own task had been cancelled

    loop.run_until_complete(check())


def test_a_plain_model_logs_metrics_without_a_trainer(tmp_path, loop):
    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            baseline = art.Model(name="gpt-baseline", project="tests", inference_base_url="http://127.0.0.1:9/v1")
            await baseline.register(backend)
            metrics = await baseline.log([art.Trajectory(messages_and_choices=[], reward=0.5, metrics={"turns": 3})])
            assert metrics["val/reward"] == 0.5 and metrics["val/turns"] == 3
            assert baseline.get_inference_name() == "gpt-baseline"

    loop.run_until_complete(check())


def test_closing_a_backend_lets_its_models_go(tmp_path, loop):
    """FastAPI caches endpoint functions beyond an app's life; closing must still free the weights."""
    async def serve_and_close():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="gone", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            await probe_logprobs(model)
            return weakref.ref(backend._registry.get("gone").model)

    weights = loop.run_until_complete(serve_and_close())
    gc.collect()
    assert weights() is None
