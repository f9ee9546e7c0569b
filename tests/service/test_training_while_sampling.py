"""ModelService with the real default model: the engine keeps sampling while a training step runs,
every token carries the policy version it was sampled under, and a rollout that spans an update
is trained with the logprobs it was sampled with."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from openai.types.chat.chat_completion import Choice

import tempering as art
from tempering.engine import EngineConfig, SamplingParams
from tempering.engine.hf_engine import kv_cache_kwargs
from tempering.training import tokenize_trajectory

PROMPTS = ["What is 3+4? Answer with just the number.", "Name a color."]
LONG = [{"role": "user", "content": "Count from 1 to 200, separated by commas."}]


async def rollout(model, prompt):
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages(), max_tokens=8, temperature=1.0)
    traj.messages_and_choices.append(completion.choices[0])
    lps = list(completion.choices[0].sampled_logprobs)
    traj.reward = math.exp(sum(lps) / len(lps))  # differs between samples: every group has spread
    return traj


def as_choice(prompt_ids, completion, tokenizer):
    """The Choice the chat route returns for an engine Completion (what a rollout appends)."""
    return Choice.model_validate({
        "index": 0, "finish_reason": completion.finish_reason,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": {"content": [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": [], "top_logprobs": []}
                                 for t, lp in zip(completion.token_ids, completion.logprobs)]},
        "token_ids": completion.token_ids, "prompt_token_ids": prompt_ids,
        "logprob_temperature": completion.logprob_temperature, "policy_versions": completion.policy_versions,
    })


def test_a_rollout_spanning_a_training_step_keeps_sampling_and_trains_with_its_sampled_logprobs(tmp_path):
    async def run():
        async with art.LocalBackend(path=tmp_path, engine_config=EngineConfig(cpu_kv_cache_bytes=256 << 20)) as backend:
            model = art.TrainableModel(name="span", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, p) for _ in range(4)) for p in PROMPTS), pbar_desc=None)
            for group in groups:  # the route stamps every token with the version that sampled it
                for t in group:
                    assert t.messages_and_choices[-1].policy_versions == [0] * len(t.messages_and_choices[-1].token_ids)
            service = backend._registry.get(model.name)

            # a long sample of the live policy; after 60 tokens the engine thread waits for the
            # training step to end, so the sample is sure to span it (its 61st token is already launched)
            sampled = []  # per token, in order: was the training step over when it was sampled
            reached, trained = threading.Event(), threading.Event()

            def on_token(index, token_id, logprob, top):
                sampled.append(trained.is_set())
                if len(sampled) == 4:
                    reached.set()
                if len(sampled) == 60:
                    trained.wait(timeout=600)

            prompt = service.renderer.render_prompt(LONG)
            future = service.submit(prompt, SamplingParams(max_tokens=80, temperature=1.0, ignore_eos=True, seed=3),
                                    on_token=on_token)
            await asyncio.to_thread(reached.wait, 600)
            marks = {}

            def on_event(event):
                marks.setdefault(event["type"], len(sampled))

            try:
                result = await asyncio.to_thread(service.train, groups, art.TrainConfig(learning_rate=1e-3), on_event)
            finally:
                trained.set()
            completion = (await asyncio.wrap_future(future))[0]
            return model, backend, service, prompt, completion, marks, result

    _, _, service, prompt, completion, marks, result = asyncio.run(run())
    versions = completion.policy_versions
    assert result.step == 1
    k = versions.index(1)  # the first token sampled by the new adapter
    # at most 61: the engine's pipeline is one step deep, so when the 60th token's callback waits, the
    # step that samples the 61st is already launched under the old weights (a GPU gets there first)
    assert versions == [0] * k + [1] * (len(versions) - k) and 4 <= k <= 61
    # the engine kept decoding while the step ran: tokens of the old policy after the step began
    assert k - marks["started"] >= 3

    ids = prompt + completion.token_ids
    engine = torch.tensor(completion.logprobs)
    peft_model, cut = service.trainer.peft_model, len(prompt) + k - 1
    device = service.device  # a GPU where there is one

    def logprobs(logits, targets):  # at temperature 1, as sampled
        return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(targets, device=device)[:, None])[:, 0].cpu()

    def tokens(ids):
        return torch.tensor([ids], device=device)

    with torch.no_grad(), peft_model.disable_adapter():  # version 0: the base model (the adapter starts at B = 0)
        old = logprobs(peft_model(tokens(ids)).logits[0, len(prompt) - 1:-1], completion.token_ids)
    assert (engine[:k] - old[:k]).abs().max() < 1e-3  # sampled under the old weights
    # the later tokens were sampled by the new adapter, attending to the cache the old one wrote for
    # the earlier tokens (what an in-flight update means): recompute exactly that
    with torch.no_grad():
        with peft_model.disable_adapter():
            cache = peft_model(tokens(ids[:cut]), use_cache=True).past_key_values
        tail = peft_model(tokens(ids[cut:-1]), use_cache=True, **kv_cache_kwargs(peft_model, cache))
        new = logprobs(tail.logits[0],
                       completion.token_ids[k:])
    assert (new - old[k:]).abs().mean() > 1e-3  # the update changed these tokens' probabilities ...
    assert (engine[k:] - new).abs().max() < 1e-3  # ... and they were sampled by it

    # training takes exactly those per-token logprobs as the behaviour policy
    trajectory = art.Trajectory(messages_and_choices=[*LONG, as_choice(prompt, completion, service.tokenizer)], reward=1.0)
    assert trajectory.policy_versions() == versions
    (sequence,) = tokenize_trajectory(trajectory, service.renderer, max_seq_len=service.max_seq_len)
    assert sequence.sampled_logprobs[len(prompt):] == completion.logprobs
    other = art.Trajectory(messages_and_choices=[*LONG, as_choice(prompt, completion, service.tokenizer)], reward=0.0)
    other.messages_and_choices[-1].policy_versions = [1] * len(versions)
    metrics = service.train([art.TrajectoryGroup([trajectory, other])], art.TrainConfig(learning_rate=1e-4)).metrics
    assert metrics["data/step_num_trajectories_spanning_update"] == 1.0
    assert metrics["offpolicy/policy_age_max"] == 1.0
    assert 0 < metrics["offpolicy/policy_age_mean"] < 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_the_gate_orders_a_write_on_one_stream_before_a_read_on_another():
    from tempering.service.weights_gate import WeightsGate

    gate = WeightsGate(torch.device("cuda"))
    weights = torch.zeros(1 << 20, device="cuda")
    writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(writer), gate:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the write
        weights.fill_(1.0)
    with torch.cuda.stream(reader), gate:
        seen = weights.sum()
    torch.cuda.synchronize()
    assert seen.item() == weights.numel()


def test_the_gate_excludes_other_threads_and_carries_the_version():
    from tempering.service.weights_gate import WeightsGate

    gate = WeightsGate(torch.device("cpu"), version=3)
    order = []
    with gate:
        thread = threading.Thread(target=lambda: (gate.__enter__(), order.append(gate.version), gate.__exit__()))
        thread.start()
        thread.join(timeout=0.2)
        assert thread.is_alive()  # waiting for the gate
        gate.version = 4
        order.append("released")
    thread.join(timeout=10)
    assert order == ["released", 4]
