"""Edge cases of the training core: equal large rewards, the mismatch KL estimator, the step's
grad-norm metric and per-update events, and a failed SFT call's shuffle (tiny random Llama, CPU)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from tempering.training import TokenizedSequence, Trainer, group_advantages
from tempering.training.objective import STATS, rl_objective
from tempering.types import LoRAConfig, TrainConfig, Trajectory, TrainSFTConfig


def test_equal_rewards_of_any_magnitude_have_no_advantage():
    # the mean of 8 x 99999.7 is not 99999.7 to 1e-12: every centred value had one sign, A ~ -1e-5
    for normalize in (True, False):
        assert group_advantages([99999.7] * 8, normalize=normalize) == [0.0] * 8
        assert group_advantages([54321.123] * 8, normalize=normalize) == [0.0] * 8
    assert group_advantages([1.0, 2.0], normalize=True) == pytest.approx([-1.0, 1.0], abs=1e-5)


def test_mismatch_kl_estimates_kl_of_the_engine_to_the_trainer_from_the_engines_samples():
    g = torch.Generator().manual_seed(0)
    vocab, n = 50, 100_000
    engine = torch.log_softmax(torch.randn(vocab, generator=g) * 2, 0)
    trainer = torch.log_softmax(engine + torch.randn(vocab, generator=g), 0)
    tokens = torch.multinomial(engine.exp(), n, replacement=True, generator=g)
    new, sampled = trainer[tokens].clone().requires_grad_(), engine[tokens]
    row = SimpleNamespace(valid=torch.ones(n, dtype=torch.bool), exact_logprobs=None, sampled_logprobs=sampled,
                          advantages=torch.zeros(n), seq_index=torch.zeros(n, dtype=torch.long), num_seqs=1,
                          weights=torch.full((n,), 1 / n))
    _, stats = rl_objective(lambda r, c, lora=True: (new, torch.zeros(n)), row, TrainConfig())
    estimate = stats[STATS.index("mismatch_k3")].item() / n
    exact = (engine.exp() * (engine - trainer)).sum().item()  # KL(engine || trainer), ~0.7 here
    assert estimate == pytest.approx(exact, rel=0.05)  # the reversed estimator read 2.2


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    trainer = Trainer.new(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoRAConfig())
    with torch.no_grad():
        for name, p in trainer.named_params:
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return trainer


def sequences(advantages, seed=0):
    rng = random.Random(seed)
    out = []
    for i, advantage in enumerate(advantages):
        prompt, completion = [rng.randrange(1000) for _ in range(12)], [rng.randrange(1000) for _ in range(8)]
        out.append(TokenizedSequence(token_ids=prompt + completion, loss_mask=[False] * 12 + [True] * 8,
                                     sampled_logprobs=[math.nan] * 12 + [-rng.uniform(5, 12) for _ in range(8)],
                                     advantage=advantage, group_index=i // 2, trajectory_index=i % 2))
    return out


def test_the_grad_norm_metric_averages_the_updates_taken_and_each_event_has_its_updates_loss(trainer):
    seqs = sequences([1.0, -1.0, 0.5, -0.5])
    events = []
    metrics = trainer.step(seqs, TrainConfig(learning_rate=1e-9, batch_size=1, max_grad_norm=None),
                           on_update=events.append).values
    assert len(events) == 4  # the events summed the losses so far; the metric is their mean
    assert sum(e["loss"] for e in events) / 4 == pytest.approx(metrics["loss/train"], abs=1e-6)
    skipping = sequences([-1.0, 1.0])
    skipping[0].sampled_logprobs = [x if math.isnan(x) else -1e4 for x in skipping[0].sampled_logprobs]  # inf ratio
    metrics = trainer.step(skipping, TrainConfig(learning_rate=1e-9, batch_size=1)).values
    assert metrics["loss/num_updates_skipped"] == 1.0
    assert metrics["loss/grad_norm"] == metrics["loss/grad_norm_max"]  # one update taken: its norm, not half


def test_a_failed_sft_call_leaves_the_trainers_shuffle_where_it_was(tmp_path, tiny_model_dir):
    from tempering.service.service import ModelService
    from tempering.storage import ModelPaths

    service = ModelService(ModelPaths(tmp_path, "p", "m"), str(tiny_model_dir), device="cpu")
    try:
        service._ensure_trainer(TrainConfig())
        rng = service.trainer.rng.getstate()

        def disk_full(*args, **kwargs):
            raise OSError("disk full")

        service._save = disk_full
        examples = [Trajectory(messages_and_choices=[{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"a{i}"}]) for i in range(6)]
        with pytest.raises(OSError, match="disk full"):
            service.train_sft(examples, TrainSFTConfig(batch_size=2, learning_rate=1e-3))
        assert service.step == 0 and service.trainer.rng.getstate() == rng  # a retry shuffles as the first try did
    finally:
        service.close()
