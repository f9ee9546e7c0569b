"""Padded rows and CUDA-graph replay (training/cuda_graphs.py) give the eager, unpadded result.

The padding tests run on the CPU: they are the twin of the GPU path, which pads every row to its
shape bucket before capturing it. The graph tests need a GPU and skip without one.
"""

from __future__ import annotations

import pytest
import torch
from test_decoder import group_sequences, sequences, tiny_model, trainer_for

from tempering.training import TokenizedSequence, Trainer
from tempering.training.batching import RowShape, pack_sequences
from tempering.training.objective import STATS, rl_objective
from tempering.types import TrainConfig

CONFIGS = {
    "ppo": TrainConfig(loss_fn="ppo"),
    "cispo": TrainConfig(loss_fn="cispo"),
    "gspo+kl": TrainConfig(loss_fn="gspo", kl_penalty_coef=0.1),
    "ppo+tis+mask": TrainConfig(loss_fn="ppo", truncated_importance_sampling=1.5, importance_ratio_mask=(0.3, 3.0),
                                kl_penalty_coef=0.05, kl_estimator="k2"),
}


def with_sampled(seqs, seed=0):
    g = torch.Generator().manual_seed(seed)
    for i, s in enumerate(seqs):
        s.sampled_logprobs = [lp if not m else float(-torch.rand(1, generator=g) * 4 - 1.5)
                              for lp, m in zip(s.sampled_logprobs, s.loss_mask)]
        s.advantage = (-1.0) ** i * (i + 1) / 3
    return seqs


def test_a_padded_row_fits_its_bucket_and_keeps_padding_apart():
    seqs = sequences(211, lengths=(30, 17, 9))
    [micro] = pack_sequences(seqs, max_tokens=4096, weights=[0.1, 0.2, 0.3])
    shape = RowShape.bucket(micro)
    assert shape == RowShape(num_tokens=256, num_predictions=64, num_segments=8, max_seq_len=128)
    row = micro.row(shape)
    assert row.input_ids.shape == row.position_ids.shape == (256,)
    # padding: segments of at most 128 tokens, then empty ones up to the static count
    assert row.cu_seq_lens.tolist() == [0, 30, 47, 56, 184, 256, 256, 256, 256]
    assert row.position_ids[56:60].tolist() == [0, 1, 2, 3] and row.position_ids[184].item() == 0
    n = micro.loss_mask[0, 1:].sum().item()
    assert row.num_valid == n and row.valid.sum().item() == n and not row.valid[n:].any()
    assert (row.weights[n:] == 0).all() and (row.seq_index[n:] == row.num_seqs - 1).all()
    assert row.seq_index[:n].max().item() < 3 and torch.isfinite(row.sampled_logprobs).all()
    with pytest.raises(ValueError, match="does not fit"):
        micro.row(RowShape(num_tokens=32, num_predictions=64, num_segments=8, max_seq_len=32))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_padding_changes_neither_the_loss_nor_the_gradient_nor_the_statistics(name, checkpointing):
    config = CONFIGS[name]
    trainer = trainer_for(tiny_model("qwen2"))
    seqs = with_sampled(sequences(211, lengths=(30, 17, 9, 21)))
    [micro] = pack_sequences(seqs, max_tokens=4096, weights=[0.05, 0.1, 0.2, 0.3])
    objective = lambda row: rl_objective(trainer._row_logprobs, row, config)
    results = []
    with trainer._forward_mode(checkpointing):
        for pad in (False, True):
            trainer.rows.begin_update()
            stats = trainer.rows.run(micro, objective, key=name, capture=False, pad=pad)
            results.append((stats.clone(), [g.clone() for g in trainer.rows.grads]))
    (stats, grads), (padded_stats, padded_grads) = results
    torch.testing.assert_close(padded_stats, stats, rtol=1e-5, atol=1e-6)
    assert stats[STATS.index("trained")].item() == micro.loss_mask[0, 1:].sum().item()
    assert any(g.abs().sum() > 0 for g in grads)
    for a, b in zip(padded_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_a_padded_row_with_shared_prompts_keeps_its_keys_and_gives_padding_its_own():
    seqs = group_sequences(211)
    [micro] = pack_sequences(seqs, max_tokens=4096, share_prefixes=True, min_shared_tokens=8)
    assert micro.shares_prefixes and micro.num_segments == len(micro.sequences) + 2  # two prompts
    shape = RowShape.bucket(micro)
    K = len(micro.key_index)
    entries = K + shape.num_tokens - micro.num_tokens  # the row's keys, then each padding token's own
    assert shape.num_keys >= entries > shape.num_keys // 2 and shape.max_key_len == 128
    row = micro.row(shape)
    T, S = micro.num_tokens, micro.num_segments
    assert row.key_index[:K].tolist() == micro.key_index.tolist()
    # each padding segment reads its own tokens, then nothing is read past the last key
    ends = row.cu_seq_lens[S:].tolist()
    key_ends = row.cu_keys[S:].tolist()
    assert row.cu_keys.shape == row.cu_seq_lens.shape == (shape.num_segments + 1,)
    assert [k - K for k in key_ends] == [e - T for e in ends]
    assert row.key_index[K:K + shape.num_tokens - T].tolist() == list(range(T, shape.num_tokens))
    assert row.max_key_len == shape.max_key_len
    with pytest.raises(ValueError, match="does not fit"):  # a row with shared prompts needs a shape with keys
        micro.row(RowShape(shape.num_tokens, shape.num_predictions, shape.num_segments, shape.max_seq_len))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_padding_a_row_with_shared_prompts_changes_neither_the_loss_nor_the_gradient(checkpointing):
    config = CONFIGS["ppo+tis+mask"]
    trainer = trainer_for(tiny_model("qwen2"))
    seqs = with_sampled(group_sequences(trainer.model.config.vocab_size))
    [micro] = pack_sequences(seqs, max_tokens=4096, weights=[0.05 * (i + 1) for i in range(len(seqs))],
                             share_prefixes=True, min_shared_tokens=8)
    assert micro.shares_prefixes
    objective = lambda row: rl_objective(trainer._row_logprobs, row, config)
    results = []
    with trainer._forward_mode(checkpointing):
        for pad in (False, True):
            trainer.rows.begin_update()
            stats = trainer.rows.run(micro, objective, key="shared", capture=False, pad=pad)
            results.append((stats.clone(), [g.clone() for g in trainer.rows.grads]))
    (stats, grads), (padded_stats, padded_grads) = results
    torch.testing.assert_close(padded_stats, stats, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads)
    for a, b in zip(padded_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_statistics_are_the_eager_trainers(default_model_dir):
    """The objective's sums equal a direct computation from the trained tokens' logprobs."""
    from transformers import AutoModelForCausalLM

    from tempering.training.losses import policy_loss
    from tempering.types import LoRAConfig

    trainer = Trainer.new(AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
                          LoRAConfig(rank=4))
    seqs = with_sampled(sequences(40000, lengths=(40, 25)))
    [micro] = pack_sequences(seqs, max_tokens=4096, weights=[0.5, 0.25])
    config = TrainConfig(loss_fn="ppo")
    row = micro.row()
    _, stats = rl_objective(trainer._row_logprobs, row, config)
    with torch.no_grad():
        lp, entropy = trainer._logprobs(micro)
        per_token, clipped, ratio = policy_loss(lp, row.sampled_logprobs, row.advantages, loss_fn="ppo",
                                                clip_low=0.2, clip_high=0.2)
    s = dict(zip(STATS, stats.tolist()))
    assert s["loss"] == pytest.approx(float((per_token * row.weights).sum()), rel=1e-5)
    assert s["entropy"] == pytest.approx(float(entropy.sum()), rel=1e-5)
    assert s["clipped"] == float(clipped.sum())
    assert s["ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert s["mismatch_abs"] == pytest.approx(float((lp - row.sampled_logprobs).abs().sum()), rel=1e-5)


# ---- GPU ---------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_trainer(seed=0, device="cuda"):
    import transformers

    from tempering.types import LoRAConfig

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    return Trainer.new(model, LoRAConfig(rank=8), seed=seed)


def gpu_batches():
    out = []
    for seed, lengths in ((1, (300, 120, 64, 200)), (2, (250, 180, 90)), (3, (310, 100, 70, 150))):
        seqs = with_sampled(sequences(1000, lengths=lengths), seed=seed)
        for j, s in enumerate(seqs):
            s.group_index, s.trajectory_index = seed, j
        out.append(seqs)
    return out


@cuda
@pytest.mark.parametrize("name", ["ppo", "gspo+kl", "ppo+tis+mask"])
def test_replayed_graphs_take_the_same_steps_as_eager_rows(name):
    """Three steps with graphs (the first captures, later ones replay) equal three eager steps."""
    results = []
    for graphs in (False, True):
        trainer = gpu_trainer()
        config = CONFIGS[name].model_copy(update={"learning_rate": 1e-3, "micro_batch_tokens": 512,
                                                  "cuda_graphs": graphs})
        metrics = [trainer.step(seqs, config).values for seqs in gpu_batches()]
        if graphs:
            assert trainer.rows.num_captures >= 1 and trainer.rows.num_replays >= 1
        results.append((metrics, [p.detach().float().clone() for p in trainer.params]))
    (eager_metrics, eager_params), (graph_metrics, graph_params) = results
    # padding changes the GEMM shapes, so bf16 rounding differs a little; Adam amplifies it on
    # elements whose gradient is near zero, so compare each tensor as a whole
    for a, b in zip(eager_params, graph_params):
        assert (b - a).norm() <= 2e-2 * a.norm() + 1e-6
    for m_eager, m_graph in zip(eager_metrics, graph_metrics):
        for key in ("loss/train", "loss/entropy", "offpolicy/ratio_mean", "data/step_completion_tokens"):
            assert m_graph[key] == pytest.approx(m_eager[key], rel=2e-2, abs=1e-4), key


@cuda
def test_a_replay_reads_the_current_adapter_and_the_new_row():
    """The graph reads the LoRA tensors in place and the row from its input buffers: replaying it for a
    new row after an update gives what an eager run gives."""
    trainer = gpu_trainer()
    first, second, _ = gpu_batches()
    config = TrainConfig(learning_rate=1e-3, micro_batch_tokens=1024)
    trainer.step(first, config)  # captures
    captures = trainer.rows.num_captures
    objective = lambda row: rl_objective(trainer._row_logprobs, row, config)
    [micro] = pack_sequences(second, max_tokens=1024, weights=[0.01] * len(second))
    key = ("probe",)
    out = []
    for capture in (True, True, False):  # capture (eager warm-up), replay, plain eager
        trainer.rows.begin_update()
        with trainer._forward_mode(True):
            stats = trainer.rows.run(micro, objective, key, capture=capture, pad=True).clone()
        out.append((stats, [g.clone() for g in trainer.rows.grads]))
    assert trainer.rows.num_captures == captures + 1
    for stats, grads in out[1:]:
        torch.testing.assert_close(stats, out[0][0], rtol=1e-3, atol=1e-4)
        for a, b in zip(grads, out[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


@cuda
def test_a_row_that_cannot_be_captured_falls_back_to_eager_rows():
    """An objective that reads a value back to the host cannot be captured: the trainer warns, keeps
    the row's eager gradient, and runs later rows eagerly."""
    trainer = gpu_trainer()
    first, second, _ = gpu_batches()
    config = TrainConfig(micro_batch_tokens=1024)

    def syncing(row):
        loss, stats = rl_objective(trainer._row_logprobs, row, config)
        if loss.item() > 1e30:  # a host sync: not allowed while capturing
            raise AssertionError
        return loss, stats

    [micro] = pack_sequences(second, max_tokens=1024, weights=[0.01] * len(second))
    grads = []
    for capture in (True, True, False):
        trainer.rows.begin_update()
        with trainer._forward_mode(True):
            trainer.rows.run(micro, syncing, ("syncing",), capture=capture)
        grads.append([g.clone() for g in trainer.rows.grads])
    assert trainer.rows.capture_error is not None and trainer.rows.num_captures == 0
    assert torch.isfinite(torch.randn(8, device="cuda")).all()  # the device's random generator still works
    for run in grads[1:]:
        for a, b in zip(run, grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    metrics = trainer.step(first, config).values  # later steps: eager, and they still train
    assert metrics["loss/grad_norm"] > 0


def gpu_group_batches():
    """RL groups whose prompts (100-300 tokens) are longer than their completions, as agents' are."""
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(3):
        seqs = []
        for group, (prompt_len, completions) in enumerate(((300, (40, 90, 60, 25)), (180, (70, 30, 55)), (120, (20, 80)))):
            prompt = torch.randint(0, 1000, (prompt_len,), generator=g).tolist()
            for i, n in enumerate(completions):
                ids = prompt + torch.randint(0, 1000, (n,), generator=g).tolist()
                seqs.append(TokenizedSequence(ids, [False] * prompt_len + [True] * n, [float("nan")] * prompt_len + [-1.0] * n,
                                              advantage=0.0, group_index=10 * step + group, trajectory_index=i))
        out.append(with_sampled(seqs, seed=step))
    return out


@cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_on_a_gpu_rows_with_shared_prompts_give_the_gradient_of_whole_sequences(graphs):
    """Rows that hold each group's prompt once (eager, or captured and replayed) give the statistics
    and LoRA gradients of every sequence computed whole: PyTorch's varlen attention over more keys
    than queries, in the forward and the backward."""
    trainer = gpu_trainer()
    with torch.no_grad():  # B = 0 would leave A without a gradient
        for name, p in trainer.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    config = CONFIGS["ppo"]
    seqs = gpu_group_batches()[0]
    objective = lambda row: rl_objective(trainer._row_logprobs, row, config)
    out = {}
    for share in (False, True):
        micros = pack_sequences(seqs, max_tokens=1024, weights=[0.01] * len(seqs), share_prefixes=share)
        assert any(m.shares_prefixes for m in micros) == share
        for _ in range(2 if graphs else 1):  # with graphs: capture, then replay
            trainer.rows.begin_update()
            with trainer._forward_mode(True):
                stats = sum(trainer.rows.run(m, objective, ("probe", share), capture=graphs).clone() for m in micros)
        if graphs:
            assert trainer.rows.capture_error is None and trainer.rows.num_replays >= len(micros)
        out[share] = (stats, [g.clone() for g in trainer.rows.grads])
    (whole_stats, whole_grads), (shared_stats, shared_grads) = out[False], out[True]
    for name in ("loss", "trained", "entropy", "ratio_sum"):
        i = STATS.index(name)
        assert shared_stats[i].item() == pytest.approx(whole_stats[i].item(), rel=1e-2, abs=1e-4), name
    for a, b in zip(whole_grads, shared_grads):
        assert (b - a).norm() <= 3e-2 * a.norm() + 1e-7


@cuda
def test_a_padded_row_with_shared_prompts_passes_no_gradient_from_key_entries_no_segment_reads():
    """A padded row's key entries past the last segment's are read by no segment, and the varlen
    backward leaves their gradient uninitialized: with garbage there (NaN-filled memory that the
    allocator hands out again) the LoRA gradients must stay those of the unpadded row."""
    trainer = gpu_trainer()
    with torch.no_grad():
        for name, p in trainer.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    objective = lambda row: rl_objective(trainer._row_logprobs, row, CONFIGS["ppo"])
    seqs = gpu_group_batches()[0]
    [micro] = pack_sequences(seqs, max_tokens=4096, weights=[0.01] * len(seqs), share_prefixes=True)
    shape = RowShape.bucket(micro)
    assert shape.num_keys > len(micro.key_index) + shape.num_tokens - micro.num_tokens  # unread key entries
    grads = {}
    for pad in (False, True):
        poison = torch.full((1 << 26,), float("nan"), device="cuda")  # cached by the allocator once freed
        del poison
        trainer.rows.begin_update()
        with trainer._forward_mode(True):
            trainer.rows.run(micro, objective, ("pad", pad), capture=False, pad=pad)
        grads[pad] = [g.clone() for g in trainer.rows.grads]
    for a, b in zip(grads[False], grads[True]):
        assert torch.isfinite(b).all()
        assert (b - a).norm() <= 3e-2 * a.norm() + 1e-7


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_trainer_on_the_second_gpu_steps_from_a_thread_whose_current_device_is_the_first():
    """CUDA's current device is per thread; the service steps from its own threads. A trainer on
    cuda:1 gives there what it gives on cuda:0 (graphs and Triton kernels launched on its GPU)."""
    import concurrent.futures

    config = CONFIGS["ppo"].model_copy(update={"learning_rate": 1e-3, "micro_batch_tokens": 512, "cuda_graphs": True})
    params = []
    for device in ("cuda:0", "cuda:1"):
        trainer = gpu_trainer(device=device)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for seqs in gpu_batches():
                pool.submit(trainer.step, seqs, config).result()
        params.append([p.detach().float().cpu() for p in trainer.params])
    for a, b in zip(*params):
        assert (b - a).norm() <= 2e-2 * a.norm() + 1e-6
