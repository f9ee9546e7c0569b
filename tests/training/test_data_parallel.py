"""The trainer data-parallel over two ranks against one rank on the same data: two CPU processes
through gloo, and (skipped without two GPUs) two GPU processes through NCCL."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import rank_processes  # noqa: E402
from dp_data import config, make_trainer, sequences, sft_batches, shared_config

from tempering.training.data_parallel import DataParallel

RANK_SCRIPT = Path(__file__).with_name("dp_rank.py")


def run_ranks(scenario: str, out: Path, *, device: str = "cpu", world_size: int = 2, timeout_s: float = 120) -> list[dict]:
    """Run dp_rank.py SCENARIO as `world_size` processes with torchrun's variables; their results."""
    return rank_processes.run_ranks(RANK_SCRIPT, scenario, out, device=device, world_size=world_size, timeout_s=timeout_s)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))])
def trained(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"train-{request.param}")
    return run_ranks("train", out, device=request.param), out, request.param


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    return run_ranks("faults", tmp_path_factory.mktemp("faults"))


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Equal up to float reassociation of the gradient sums, as Adam magnifies it: an entry whose
    gradient is near zero moves by about lr × sign, so a last-bit difference of the gradient can
    move it by up to ~1e-3 of the step (lr 1e-2 here)."""
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=2e-5)


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_shards_split_the_tokens_evenly_and_cover_every_item_once():
    class Two(DataParallel):
        def __init__(self, rank):  # no process group: shard() needs only rank and size
            self.group, self.rank, self.world_size = None, rank, 2

    sizes = [40, 12, 33, 33, 7, 20, 26, 5]
    parts = [Two(r).shard(sizes) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in part) for part in parts]
    assert abs(loads[0] - loads[1]) <= max(sizes) // 4


def single_params(trainer) -> list[torch.Tensor]:
    return [p.detach().cpu() for p in trainer.params]


def test_a_two_rank_step_gives_the_update_of_one_rank_on_the_same_data(trained):
    ranks, _, device = trained
    single = make_trainer(seed=0, device=device)  # rank 0's adapter: the one every rank starts from
    metrics = single.step(sequences(1), config()).values
    assert_close(ranks[0]["after_1"], single_params(single))
    single.step(sequences(2), config())
    assert_close(ranks[0]["after_2"], single_params(single))
    for key in ("loss/train", "loss/grad_norm", "loss/entropy", "offpolicy/ratio_max", "offpolicy/ratio_mean"):
        assert ranks[0]["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    for key in ("data/step_trainer_tokens", "data/step_completion_tokens", "data/step_num_optimizer_updates"):
        assert ranks[0]["metrics"][key] == metrics[key] == ranks[1]["metrics"][key], key


def test_every_rank_holds_the_same_adapter_after_each_step(trained):
    ranks, _, _ = trained
    for key in ("after_1", "after_2", "resumed_2", "after_sft"):
        assert_equal(ranks[0][key], ranks[1][key])


def test_a_two_rank_sft_step_gives_the_update_of_one_rank(trained):
    ranks, _, device = trained
    single = make_trainer(seed=0, device=device)
    metrics = single.sft_step(sft_batches(), config()).values
    assert_close(ranks[0]["after_sft"], single_params(single))
    assert ranks[0]["sft_metrics"]["sft/loss"] == pytest.approx(metrics["sft/loss"], rel=1e-5)
    assert ranks[0]["sft_metrics"]["sft/trained_tokens"] == metrics["sft/trained_tokens"]


def test_resuming_from_a_checkpoint_of_two_ranks_gives_the_same_next_step(trained):
    ranks, out, device = trained
    for result in ranks:  # bit for bit on the CPU; GPU kernels may sum in another order from run to run
        (assert_equal if device == "cpu" else assert_close)(result["after_2"], result["resumed_2"])
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".pt")) == ["checkpoint"]  # no temporary left


def test_a_failure_on_one_rank_undoes_the_step_on_every_rank(faulted):
    rank0, rank1 = faulted
    assert rank1["fail_error"].startswith("OutOfMemoryError: a training step ran out of host memory (MemoryError: rank 1 ran out of memory)")
    assert rank0["fail_error"].startswith("DistributedError: 1 other rank(s) failed")
    assert rank0["fail_unchanged"] and rank1["fail_unchanged"]
    assert_equal(rank0["after_retry"], rank1["after_retry"])


def test_a_rank_that_dies_gives_an_error_on_the_others_not_a_hang(faulted):
    rank0, _ = faulted
    assert rank0["dead_error"] is not None and "Connection" in rank0["dead_error"], rank0["dead_error"]
    assert rank0["dead_unchanged"]


def test_a_step_shared_with_an_idle_rank_gives_the_update_of_one_rank(faulted):
    """Work sharing (dedicated mode): rank 1 computes the micro-batches it claims, rank 0 the rest;
    the summed gradient gives rank 0's step alone, whoever computed which row."""
    rank0, rank1 = faulted
    single = make_trainer(seed=0)
    metrics = single.step(sequences(1), shared_config()).values
    assert_close(rank0["both_params"], single_params(single))
    for key in ("loss/train", "loss/grad_norm", "loss/entropy", "offpolicy/ratio_max", "data/step_completion_tokens"):
        assert rank0["both_metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    count = rank0["both_metrics"]["data/step_micro_batches"]
    assert count >= 3 and 1 <= rank1["both_computed"] < count  # both ranks computed rows
    assert rank0["both_metrics"]["data/step_micro_batches_shared"] == rank1["both_computed"]
    # a rank whose engine is never idle claims nothing: rank 0 computes every row
    single.step(sequences(2), shared_config())
    assert_close(rank0["rank0_params"], single_params(single))
    assert rank1["rank0_computed"] == 0 and rank0["rank0_metrics"]["data/step_micro_batches_shared"] == 0


def test_a_failure_in_a_shared_step_stops_both_ranks_and_changes_nothing(faulted):
    rank0, rank1 = faulted
    assert rank0["fail0_error"].startswith("OutOfMemoryError: a training step ran out of host memory (MemoryError: rank 0 ran out of memory)")
    assert rank1["fail0_error"].startswith("DistributedError: 1 other rank(s) failed")
    assert rank1["fail1_error"].startswith("OutOfMemoryError: a training step ran out of host memory (MemoryError: rank 1 ran out of memory)")
    assert rank0["fail1_error"].startswith("DistributedError: 1 other rank(s) failed")
    # rank 0 refused the step before any claim (several updates): rank 1 is released, not left waiting
    assert rank0["refused_error"].startswith("ValueError: a shared step has one optimizer update")
    assert rank1["refused_error"].startswith("DistributedError: 1 other rank(s) failed")
    assert rank0["unchanged"] and rank1["unchanged"]
