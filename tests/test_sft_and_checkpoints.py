"""SFT, SFT-then-RL on one adapter, checkpoint listing and forking, W&B offline, `tempering plot`."""

from __future__ import annotations

import asyncio
import json
import math
import shutil

import pytest

import tempering as art

FACTS = [("Capital of Freedonia?", "Zorbatown."), ("Color of the Glim fruit?", "Teal."),
         ("Who built Quux Tower?", "Ada Vex."), ("Largest lake on Mars?", "Lake Orrin.")]


def sft_examples():
    return [art.Trajectory(messages_and_choices=[{"role": "user", "content": q}, {"role": "assistant", "content": a}])
            for q, a in FACTS]


async def answer_logprob(model, question, answer_ids):
    """Sum of logprobs of `answer_ids` after the question, read from greedy decoding with top logprobs."""
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": question}], max_tokens=len(answer_ids),
        temperature=0, logprobs=True, top_logprobs=20)
    total = 0.0
    for position, target in zip(completion.choices[0].logprobs.content, answer_ids):
        found = [t.logprob for t in position.top_logprobs if t.token == target]
        total += found[0] if found else -30.0
    return total


def test_sft_lowers_the_loss_serves_the_adapter_and_rl_continues_on_it(tmp_path, default_model_dir):
    async def main():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="sft", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            tokenizer = backend._registry.get("sft").tokenizer
            question, answer = FACTS[0]
            target = [tokenizer.decode([i]) for i in tokenizer(answer, add_special_tokens=False)["input_ids"]]
            before = await answer_logprob(model, question, target)
            result = await model.train_sft(sft_examples(), config=art.TrainSFTConfig(learning_rate=2e-3, epochs=6, batch_size=4))
            assert result.step == 1 and await model.get_step() == 1
            assert result.metrics["sft/loss_last_batch"] < 0.5 * result.metrics["sft/loss_first_batch"]
            after = await answer_logprob(model, question, target)
            assert after > before + 1.0  # the served adapter is the fine-tuned one
            # RL continues on the same adapter
            async def rollout(i):
                t = art.Trajectory(messages_and_choices=[{"role": "user", "content": question}])
                c = await model.openai_client().chat.completions.create(model=model.name, messages=t.messages(),
                                                                        max_tokens=6, temperature=1.0)
                t.messages_and_choices.append(c.choices[0])
                lps = c.choices[0].sampled_logprobs
                # + i: a spread even when the fine-tuned model samples the same answer four times
                t.reward = math.exp(sum(lps) / len(lps)) + i
                return t
            groups = await art.gather_trajectory_groups([art.TrajectoryGroup(rollout(i) for i in range(4))], pbar_desc=None)
            assert (await model.train(groups)).step == 2
            history = [json.loads(line) for line in (tmp_path / "tests/models/sft/history.jsonl").read_text().splitlines()]
            assert "sft/loss" in history[0] and "loss/train" in history[1]

    asyncio.run(main())


def test_the_jsonl_helper_reads_chat_examples_with_tools_and_names_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    path.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "tools": [tool]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    ]))
    trajectories = art.read_sft_jsonl(path)
    assert len(trajectories) == 2 and trajectories[0].tools == [tool]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "only a question"}]}))
    with pytest.raises(art.TrajectoryError, match="bad.jsonl:1: no assistant"):
        art.read_sft_jsonl(bad)


def test_checkpoints_are_listed_with_metrics_and_forked_into_a_new_model(tmp_path, tiny_model_dir):
    """The bookkeeping of checkpoints (listing, forking), on the tiny random Llama: the model does not matter."""
    async def main():
        async with art.LocalBackend(path=tmp_path) as backend:
            parent = art.TrainableModel(name="parent", project="tests", base_model=str(tiny_model_dir))
            await parent.register(backend)
            await parent.train_sft(sft_examples(), config=art.TrainSFTConfig(learning_rate=1e-3))
            await parent.log([art.Trajectory(messages_and_choices=[], reward=0.3)], split="val")
            [checkpoint] = await backend.list_checkpoints(parent)
            assert checkpoint["step"] == 1 and checkpoint["metrics"]["val/reward"] == 0.3
            child = art.TrainableModel(name="child", project="tests", base_model=str(tiny_model_dir))
            assert await backend._experimental_fork_checkpoint(child, from_model="parent") == 1
            await child.register(backend)
            assert await child.get_step() == 1
            messages = [{"role": "user", "content": FACTS[1][0]}]
            a = await parent.openai_client().chat.completions.create(model="parent", messages=messages, max_tokens=6, temperature=0)
            b = await child.openai_client().chat.completions.create(model="child", messages=messages, max_tokens=6, temperature=0)
            assert a.choices[0].token_ids == b.choices[0].token_ids
            assert max(abs(x - y) for x, y in zip(a.choices[0].sampled_logprobs, b.choices[0].sampled_logprobs)) < 1e-4
            with pytest.raises(art.ConfigError, match="registered"):
                await backend.fork_checkpoint(child, from_project="tests", from_model="parent")
            # a target with a later checkpoint would resume there, not at the fork: refused, nothing copied
            grown = art.TrainableModel(name="grown", project="tests", base_model=str(tiny_model_dir))
            later = tmp_path / "tests" / "models" / "grown" / "checkpoints" / "0002"
            shutil.copytree(tmp_path / "tests" / "models" / "parent" / "checkpoints" / "0001", later)
            with pytest.raises(art.ConfigError, match=r"checkpoints after step 1 \(\[2\]\).*would resume at step 2"):
                await backend.fork_checkpoint(grown, from_project="tests", from_model="parent")
            assert sorted(p.name for p in later.parent.iterdir()) == ["0002"]

    asyncio.run(main())


def test_wandb_offline_run_holds_the_logged_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")

    async def main():
        async with art.LocalBackend(path=tmp_path / "root") as backend:
            model = art.Model(name="tracked", project="tests", report_metrics=["wandb"])
            await model.register(backend)
            await model.log([art.Trajectory(messages_and_choices=[], reward=0.75, metrics={"turns": 2.0})], split="val", step=3)
            model.finish_reporting()

    asyncio.run(main())
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    [path] = runs[0].glob("*.wandb")
    [row] = [h for h in wandb_history(path) if "val/reward" in h]
    assert row["val/reward"] == 0.75 and row["val/turns"] == 2.0 and row["training_step"] == 3
    del wandb


def wandb_history(path):
    """The history rows of an offline W&B run file: a LevelDB-style log (32 KiB blocks of records
    with a 7-byte header: crc32, length, type) of `Record` protobufs, after a 7-byte file header."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer or padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.HasField("history"):
                yield {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}


def test_tempering_plot_draws_and_compares_models(tmp_path):
    from tempering.storage import append_history

    for name, slope in (("a", 0.1), ("b", 0.05)):
        for step in range(4):
            append_history(tmp_path / "proj" / "models" / name / "history.jsonl",
                           {"step": step, "train/reward": step * slope, "loss/train": 1 - step * slope, "loss/entropy": 1.0})
    from typer.testing import CliRunner

    from tempering.cli import app

    out = CliRunner().invoke(app, ["plot", "proj", "--path", str(tmp_path)])  # the command, in this process
    assert out.exit_code == 0, out.output
    png = tmp_path / "proj" / "plots" / "reward.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
