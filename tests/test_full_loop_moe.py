"""The whole loop with `base_model=` a (tiny, random) Qwen3-MoE directory, through tempering's own engine and
trainer: register → rollouts (choices carry their routed experts) → a train step that replays them →
a PEFT checkpoint with the experts' LoRA → that step served by name."""

from __future__ import annotations

import asyncio

import pytest

import tempering as art
from tempering.engine import EngineConfig
from tempering.engine.models import Qwen3MoeModel
from tempering.modeling.routing_format import decode_routed_experts
from tempering.training.moe import MoEPackedDecoder

pytestmark = pytest.mark.filterwarnings("ignore:.*_pattern keys did not match any targeted module")


def shift_routing(trajectory: art.Trajectory) -> art.Trajectory:
    """A copy whose choice says each token went to the next experts (mod 8) instead."""
    from tempering.modeling.routing_format import encode_routed_experts

    message, choice = trajectory.messages_and_choices
    shifted = choice.model_copy()
    shifted.routed_experts = encode_routed_experts(((decode_routed_experts(choice.routed_experts) + 1) % 8).astype("uint8"))
    return art.Trajectory(messages_and_choices=[message, shifted], reward=trajectory.reward)


async def greedy(model, name=None):
    completion = await model.openai_client().chat.completions.create(
        model=name or model.name, messages=[{"role": "user", "content": "Say a number."}], max_tokens=6, temperature=0)
    return completion.choices[0].token_ids, list(completion.choices[0].sampled_logprobs)


def test_the_whole_loop_runs_on_a_qwen3_moe_directory_with_routing_replay(tmp_path, tiny_moe_dir):
    async def run():
        backend = art.LocalBackend(path=tmp_path, device="cpu",
                                   engine_config=EngineConfig(cpu_kv_cache_bytes=16 << 20, max_num_seqs=32))
        model = art.TrainableModel(name="moe", project="tests", base_model=str(tiny_moe_dir))
        try:
            await model.register(backend)
            client = model.openai_client()
            groups = []
            for prompt in ("Say a number.", "Name a color."):
                completion = await client.chat.completions.create(
                    model=model.name, messages=[{"role": "user", "content": prompt}], max_tokens=8, n=4, temperature=1.0)
                trajectories = []
                for k, choice in enumerate(completion.choices):
                    routed = decode_routed_experts(choice.routed_experts)  # asked for by the tempering client
                    assert routed.shape == (len(choice.prompt_token_ids) + len(choice.token_ids) - 1, 2, 2)
                    trajectories.append(art.Trajectory(
                        messages_and_choices=[{"role": "user", "content": prompt}, choice], reward=float(k)))
                groups.append(art.TrajectoryGroup(trajectories))
            plain = await client.with_options(default_headers={"X-Return-Routed-Experts": "false"}).chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert getattr(plain.choices[0], "routed_experts", None) is None  # not in the payload unless asked for
            stream = await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}],
                                                          max_tokens=3, stream=True)
            streamed = [c.choices[0] async for c in stream if c.choices]
            ids = streamed[0].prompt_token_ids + [t for c in streamed for t in (getattr(c, "token_ids", None) or [])]
            assert decode_routed_experts(streamed[-1].routed_experts).shape[0] == len(ids) - 1  # in the last chunk

            service = backend.hub.service(model.name)
            assert isinstance(service.engine.model, Qwen3MoeModel)  # tempering's own engine, not the fallback
            # the routing reaches the trainer: replaying other experts than the sampler's (a shifted copy)
            # makes the trainer's logprobs differ, unless replay is off (lr ~0: the policy stays put)
            shifted = [art.TrajectoryGroup([shift_routing(t) for t in g]) for g in groups]
            for replay, bound in ((True, 5e-4), (False, 1e-4)):
                config = art.TrainConfig(learning_rate=1e-12, moe_routing_replay=replay)
                mismatch = (await model.train(shifted, config=config)).metrics["offpolicy/mismatch_abs_logprob"]
                assert (mismatch > bound) if replay else (mismatch < bound), (replay, mismatch)
            before = await greedy(model)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
            assert result.step == 3 and await model.get_step() == 3
            # replayed routing: the trainer's logprobs before its update are the sampler's, to float32 precision
            assert result.metrics["offpolicy/mismatch_abs_logprob"] < 1e-4
            after = await greedy(model)
            assert after != before  # the new adapter (experts' LoRA included) is served at once
            assert isinstance(service.trainer.decoder, MoEPackedDecoder)  # and its own trainer forward
            ids, logprobs = await greedy(model, f"{model.name}@3")  # the checkpoint, loaded beside the live adapter
            assert ids == after[0] and max(abs(a - b) for a, b in zip(logprobs, after[1])) < 1e-4
        finally:
            await backend.close()

    asyncio.run(run())
    checkpoint = tmp_path / "tests" / "models" / "moe" / "checkpoints" / "0003"
    from safetensors.torch import load_file

    keys = load_file(checkpoint / "adapter_model.safetensors").keys()
    assert any("mlp.experts.lora_A" in k for k in keys) and any("mlp.experts.base_layer.lora_B" in k for k in keys)


def test_exact_on_policy_mode_trains_a_qwen3_moe_at_its_sampled_values(tmp_path, tiny_moe_dir):
    """Exact on-policy mode with routing replay: on-policy rollouts keep their sampled logprobs (every
    ratio exactly 1, nothing rescored); a second update in the same step rescores its tokens through the
    engine's MoE forward (Engine.score), and the step trains."""
    async def run():
        backend = art.LocalBackend(path=tmp_path, device="cpu", engine_config=EngineConfig(
            batch_invariant=True, cpu_kv_cache_bytes=16 << 20, max_num_seqs=32))
        model = art.TrainableModel(name="moe-exact", project="tests", base_model=str(tiny_moe_dir))
        try:
            await model.register(backend)

            async def groups():
                out = []
                for prompt in ("Say a number.", "Name a color."):
                    completion = await model.openai_client().chat.completions.create(
                        model=model.name, messages=[{"role": "user", "content": prompt}], max_tokens=6, n=4,
                        temperature=1.0)
                    out.append(art.TrajectoryGroup(
                        art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}, c], reward=float(k))
                        for k, c in enumerate(completion.choices)))
                return out

            one = (await model.train(await groups(), config=art.TrainConfig(learning_rate=1e-2))).metrics
            two = (await model.train(await groups(), config=art.TrainConfig(learning_rate=1e-2, batch_size=4))).metrics
        finally:
            await backend.close()
        return one, two

    one, two = asyncio.run(run())
    assert one["offpolicy/rescored_fraction"] == 0.0 and one["offpolicy/bitwise_equal_fraction"] == 1.0
    assert one["offpolicy/ratio_max"] == 1.0 and one["loss/grad_norm"] > 0
    assert two["data/step_num_optimizer_updates"] == 2 and 0.0 < two["offpolicy/rescored_fraction"] < 1.0
