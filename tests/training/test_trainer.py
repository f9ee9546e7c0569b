"""The trainer (CPU, fp32): the on-policy ratio of the engine's own samples on the real default model;
resume, KL, ratio corrections, the losses and failure handling on a 2-layer random Llama with the
default model's tokenizer (`tiny_model_dir`), since they test the trainer's bookkeeping, not the
model, and take a fraction of the time there."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tempering.chat import ChatRenderer
from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.training import TokenizedSequence, Trainer
from tempering.types import LoRAConfig, TrainConfig


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def random_sequences(n=8, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length, k = rng.randint(20, 40), rng.randint(4, 12)
        out.append(TokenizedSequence(
            [rng.randint(10, 40000) for _ in range(length)], [False] * (length - k) + [True] * k,
            [float("nan")] * (length - k) + [rng.uniform(-3, -0.5) for _ in range(k)],
            advantage=1.0 if i % 2 else -1.0, group_index=i // 4, trajectory_index=i % 4,
        ))
    return out


def lora_state(trainer):
    return [p.detach().clone() for p in trainer.params]


def test_the_first_step_is_on_policy_for_tokens_the_engine_sampled(default_model_dir):
    model = load(default_model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    renderer = ChatRenderer(tokenizer)
    trainer = Trainer.new(model, LoRAConfig(rank=4))
    engine = Engine(engine_model_for(model, 2048), tokenizer, stop_token_ids=renderer.stop_token_ids,
                    lock=threading.RLock(), config=EngineConfig(cpu_kv_cache_bytes=64 << 20))
    try:
        sequences = []
        for i, question in enumerate(["What is 2+2?", "Name a planet.", "Say hello."]):
            prompt = renderer.render_prompt([{"role": "user", "content": question}])
            for j, c in enumerate(engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.8), n=2,
                                                policy=BasePolicy()).result()):
                sequences.append(TokenizedSequence(
                    prompt + c.token_ids, [False] * len(prompt) + [True] * len(c.token_ids),
                    [float("nan")] * len(prompt) + c.logprobs,
                    temperatures=[1.0] * len(prompt) + [c.logprob_temperature] * len(c.token_ids),
                    advantage=1.0 if j else -1.0, group_index=i, trajectory_index=j,
                ))
    finally:
        engine.close()
    metrics = trainer.step(sequences, TrainConfig(learning_rate=1e-4)).values
    assert metrics["offpolicy/mismatch_abs_logprob"] < 1e-4
    assert abs(metrics["offpolicy/ratio_mean"] - 1.0) < 1e-4
    assert metrics["loss/clip_fraction"] == 0.0


def test_stopping_after_a_step_and_resuming_gives_the_same_next_step(tiny_model_dir, tmp_path):
    config = TrainConfig(learning_rate=1e-3, batch_size=3)  # several shuffled mini-batches per step
    first, second = random_sequences(seed=1), random_sequences(seed=2)

    uninterrupted = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=7)
    uninterrupted.step(first, config)
    uninterrupted.step(second, config)

    stopped = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=7)
    stopped.step(first, config)
    stopped.save(tmp_path, step=1)
    random.random(), torch.rand(3)  # the rest of the process moves the global RNGs on
    resumed = Trainer.from_adapter(load(tiny_model_dir), tmp_path)
    resumed.load_state(tmp_path)
    resumed.step(second, config)

    assert resumed.num_updates == uninterrupted.num_updates == 6
    for a, b in zip(lora_state(resumed), lora_state(uninterrupted)):
        assert torch.equal(a, b)


def test_kl_penalty_is_zero_at_the_start_and_grows_after_updates(tiny_model_dir):
    trainer = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4))
    seqs = random_sequences()
    config = TrainConfig(learning_rate=5e-3, kl_penalty_coef=0.1)
    first = trainer.step(seqs, config).values
    assert first["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the adapter is the base model
    second = trainer.step(seqs, config).values
    assert second["loss/kl"] > 1e-6


def test_ratio_corrections_and_their_metrics(tiny_model_dir):
    """Sampled logprobs set off the trainer's own by fixed amounts: ratios of e^1.5 (capped by
    truncated importance sampling at 2 and masked), 1 and e^-0.5 (kept) and e^-1.5 (masked)."""
    from tempering.training.batching import pack_sequences

    trainer = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4))
    seqs = random_sequences()
    offsets = [-1.5, 0.0, 0.5, 1.5]  # sampled = own + offset: ratio = exp(-offset)
    counts = {o: 0 for o in offsets}
    with torch.no_grad():
        for s in seqs:
            k = s.loss_mask.index(True)
            own = trainer._logprobs(pack_sequences([s], max_tokens=4096)[0])[0].tolist()  # tokens k..
            for i, value in enumerate(own):
                offset = offsets[i % 4]
                s.sampled_logprobs[k + i] = value + offset
                counts[offset] += 1
    n = sum(counts.values())
    metrics = trainer.step(seqs, TrainConfig(learning_rate=1e-4, truncated_importance_sampling=2.0,
                                             importance_ratio_mask=(0.5, 2.0))).values
    assert metrics["offpolicy/tis_capped_fraction"] == pytest.approx(counts[-1.5] / n)
    assert metrics["offpolicy/masked_fraction"] == pytest.approx((counts[-1.5] + counts[1.5]) / n)
    assert metrics["offpolicy/mismatch_abs_logprob"] == pytest.approx(sum(abs(o) * c for o, c in counts.items()) / n,
                                                                       abs=1e-4)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_each_loss_takes_a_finite_step_and_checkpointing_does_not_change_it(tiny_model_dir, loss_fn):
    """Recomputation comes before any loss, so it is compared once (PPO's step with and without it)."""
    seqs = random_sequences()
    results = []
    for checkpointing in (True, False) if loss_fn == "ppo" else (True,):
        trainer = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4))
        metrics = trainer.step(seqs, TrainConfig(learning_rate=1e-3, loss_fn=loss_fn,
                                                 gradient_checkpointing=checkpointing, micro_batch_tokens=64)).values
        assert torch.isfinite(torch.tensor(metrics["loss/train"])) and metrics["loss/grad_norm"] > 0
        results.append(lora_state(trainer))
    if len(results) == 2:
        for a, b in zip(*results):
            assert torch.allclose(a, b, atol=1e-6)


def test_a_failed_step_puts_the_adapter_and_optimizer_back_exactly(tiny_model_dir):
    config = TrainConfig(learning_rate=1e-3)
    first, second = random_sequences(seed=1), random_sequences(seed=2)
    reference = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=3)
    reference.step(first, config)
    reference.step(second, config)

    trainer = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=3)
    trainer.step(first, config)
    before = lora_state(trainer)

    def fail():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        trainer.step(second, config, commit=fail)  # the update ran; writing the checkpoint failed
    assert all(torch.equal(a, b) for a, b in zip(lora_state(trainer), before))
    assert trainer.num_updates == 1
    trainer.step(second, config)  # the optimizer state came back too: the same step as never failing
    assert all(torch.equal(a, b) for a, b in zip(lora_state(trainer), lora_state(reference)))


def test_an_update_with_a_non_finite_gradient_is_skipped_and_counted_not_fatal(tiny_model_dir):
    trainer = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=3)
    config = TrainConfig(learning_rate=1e-3, batch_size=4)  # two updates of four trajectories
    before = lora_state(trainer)
    hook = trainer.params[0].register_hook(lambda grad: grad * float("nan"))
    try:
        metrics = trainer.step(random_sequences(), config).values
    finally:
        hook.remove()
    assert metrics["loss/num_updates_skipped"] == 2 and metrics["data/step_num_optimizer_updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(lora_state(trainer), before))  # nothing written
    metrics = trainer.step(random_sequences(seed=1), config).values  # the run goes on
    assert metrics["loss/num_updates_skipped"] == 0 and metrics["loss/grad_norm"] > 0
    assert not all(torch.equal(a, b) for a, b in zip(lora_state(trainer), before))


def test_every_update_bumps_the_adapters_version_counters_even_with_a_fused_optimizer(tiny_model_dir):
    """The engine's copies of the live adapter (A in spare rows, B^T shadows) refresh when a tensor's
    version counter moves; a fused AdamW (the trainer's on CUDA) writes in place without moving it,
    and the engine then sampled a stale mix of old and new adapter tensors."""
    trainer = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=3)
    trainer.optimizer = torch.optim.AdamW(trainer.params, lr=1e-3, fused=True)  # as on CUDA
    before = [p._version for p in trainer.params]
    trainer.step(random_sequences(), TrainConfig(learning_rate=1e-3))
    assert all(p._version > v for p, v in zip(trainer.params, before))


def test_with_a_scorer_the_objective_takes_its_values_and_the_trainers_gradient(tiny_model_dir):
    """Exact on-policy (a batch-invariant engine as the scorer): the logprobs' values come from the
    scorer, so a scorer that reproduces the sampled logprobs makes every ratio exactly 1; the
    gradient is the trainer's own, so the update is the one without a scorer where the ratio is
    1 + 1e-5."""
    from tempering.training.batching import pack_sequences

    seqs = random_sequences()
    base = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=3)
    # the trainer's own logprobs, 1e-5 lower, as the sampled ones: without a scorer every ratio is 1 + 1e-5, never
    # exactly 1 (a row of one sequence and a packed row can give the same bits on some CPUs: a 16-core host did)
    with torch.no_grad():
        for s in seqs:
            k = s.loss_mask.index(True)
            s.sampled_logprobs[k:] = [v - 1e-5 for v in base._logprobs(pack_sequences([s], max_tokens=4096)[0])[0].tolist()]
    sampled = {tuple(s.token_ids): s.sampled_logprobs[1:] for s in seqs}  # logprob of token t at index t - 1
    asked = []

    def scorer(token_ids, temperatures, routed_experts):
        asked.append(token_ids)
        assert routed_experts == [None] * len(token_ids)  # a dense model: no routing to replay
        return [sampled[tuple(ids)] for ids in token_ids]

    config = TrainConfig(learning_rate=1e-3)
    exact = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=3)
    init = lora_state(exact)
    copies = [TokenizedSequence(s.token_ids, list(s.loss_mask), list(s.sampled_logprobs), advantage=s.advantage,
                                group_index=s.group_index, trajectory_index=s.trajectory_index) for s in seqs]
    metrics = exact.step(copies, config, scorer=scorer).values
    assert asked == [[s.token_ids for s in seqs]]
    assert metrics["offpolicy/bitwise_equal_fraction"] == 1.0 and metrics["offpolicy/ratio_max"] == 1.0
    assert metrics["offpolicy/mismatch_abs_logprob"] == 0.0
    plain = base.step(seqs, config).values
    assert plain["offpolicy/bitwise_equal_fraction"] < 1.0
    assert metrics["offpolicy/rescored_fraction"] == 1.0
    # sampled with the weights the step starts from: the sampled values are exact, nothing is rescored
    on_policy = [TokenizedSequence(s.token_ids, list(s.loss_mask), list(s.sampled_logprobs), advantage=s.advantage,
                                   group_index=s.group_index, trajectory_index=s.trajectory_index) for s in seqs]
    for s in on_policy:
        s.on_policy = True
    again = Trainer.new(load(tiny_model_dir), LoRAConfig(rank=4), seed=3).step(on_policy, config, scorer=scorer).values
    assert len(asked) == 1 and again["offpolicy/rescored_fraction"] == 0.0
    assert again["offpolicy/bitwise_equal_fraction"] == 1.0
    moved = torch.cat([(a - i).flatten() for a, i in zip(lora_state(exact), init)])
    other = torch.cat([(b - i).flatten() for b, i in zip(lora_state(base), init)])
    assert moved.norm() > 0 and (moved - other).norm() <= 1e-2 * moved.norm()
