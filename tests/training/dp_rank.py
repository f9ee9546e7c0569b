"""One rank of the data-parallel trainer tests (run by test_data_parallel.py with torchrun's env vars).

    python dp_rank.py SCENARIO OUT_DIR [cpu|cuda]

"train": two RL steps from a tiny random Llama whose adapter differs per rank (the first step
must make it rank 0's everywhere), a checkpoint after the first written by rank 0, a fresh
trainer restored from it on every rank taking the second step again, and an SFT step.
"faults": first work sharing (dedicated mode): rank 0 steps, rank 1 helps with micro-batches it
claims (every one it can, then none), then a shared step in which each rank fails in turn, and one
that rank 0 refuses before any claim; then a data-parallel step in which rank 1 raises, a step
after it, and rank 1 exits and rank 0 steps.
Each rank saves what it saw to OUT_DIR/rank{RANK}.pt (tensors on the CPU). On "cuda" rank r
computes on cuda:r and the ranks talk through NCCL; on "cpu" through gloo.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from dp_data import config, make_trainer, sequences, sft_batches, shared_config
from rank_processes import start_rank

from tempering.storage import write_atomically
from tempering.training.data_parallel import DataParallel
from tempering.training.work_sharing import SharedUpdate


def params(trainer) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in trainer.params]


def attempt(result: dict, key: str, fn) -> None:
    try:
        fn()
        result[key] = None
    except Exception as exc:
        result[key] = f"{type(exc).__name__}: {exc}"


def train(rank: int, dp: DataParallel, out: Path, result: dict, device: torch.device) -> None:
    trainer = make_trainer(seed=rank, dp=dp, device=device)
    result["metrics"] = trainer.step(sequences(1), config()).values
    result["after_1"] = params(trainer)
    checkpoint = out / "checkpoint"
    if rank == 0:  # written once, atomically
        write_atomically(checkpoint, lambda tmp: trainer.save(tmp, step=1))
    dist.barrier()
    trainer.step(sequences(2), config())
    result["after_2"] = params(trainer)
    resumed = make_trainer(seed=100 + rank, dp=dp, adapter=checkpoint, device=device)
    resumed.load_state(checkpoint)
    resumed.step(sequences(2), config())
    result["resumed_2"] = params(resumed)
    sft = make_trainer(seed=rank, dp=dp, device=device)
    result["sft_metrics"] = sft.sft_step(sft_batches(), config()).values
    result["after_sft"] = params(sft)


def faults(rank: int, dp: DataParallel, out: Path, result: dict, device: torch.device) -> None:
    shared(rank, dp, out, result, device)  # before rank 1 exits: the same two processes serve both
    trainer = make_trainer(seed=rank, dp=dp, device=device)
    trainer.step(sequences(1), config())
    before = params(trainer)
    rows_run = trainer.rows.run
    if rank == 1:  # a fault in rank 1's part of the next step
        trainer.rows.run = lambda *a, **k: (_ for _ in ()).throw(MemoryError("rank 1 ran out of memory"))
    attempt(result, "fail_error", lambda: trainer.step(sequences(2), config()))
    result["fail_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params(trainer)))
    trainer.rows.run = rows_run
    trainer.step(sequences(2), config())  # the group still works
    result["after_retry"] = params(trainer)
    torch.save(result, out / f"rank{rank}.pt")
    if rank == 1:
        os._exit(3)  # dies: rank 0's next step must fail, not hang
    before = params(trainer)
    attempt(result, "dead_error", lambda: trainer.step(sequences(3), config()))
    result["dead_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params(trainer)))
    torch.save(result, out / f"rank{rank}.pt")
    os._exit(0)  # the group is broken: skip its teardown


def shared(rank: int, dp: DataParallel, out: Path, result: dict, device: torch.device) -> None:
    store = dist.PrefixStore("shared/", dist.distributed_c10d._get_default_store())
    trainer = make_trainer(seed=0, device=device)  # the same adapter on both ranks, as after a broadcast
    cfg = shared_config()

    def update(key: str, seqs, *, claim=True, cfg=cfg) -> None:
        sharing = SharedUpdate(dp, store, key)
        if rank == 0:
            if claim:
                store.wait([key])  # rank 1 has claimed its first micro-batch
            result[f"{key}_metrics"] = trainer.step(seqs, cfg, sharing=sharing).values
            result[f"{key}_params"] = params(trainer)
        else:
            # the first micro-batch at once, the next ones once rank 0 has claimed one: both ranks compute
            # rows, however fast rank 1 is (alone it could claim them all before rank 0 starts)
            claimed = []

            def may_claim() -> bool:
                if not claim:
                    return False
                if not claimed:
                    claimed.append(True)
                    return True
                return store.add(key, 0) >= 2

            result[f"{key}_computed"] = trainer.help_update(seqs, cfg, sharing, may_claim)

    update("both", sequences(1))
    update("rank0", sequences(2), claim=False)
    before = params(trainer)
    rows_run = trainer.rows.run
    for failing in (0, 1):
        if rank == failing:
            trainer.rows.run = lambda *a, **k: (_ for _ in ()).throw(MemoryError(f"rank {rank} ran out of memory"))
        attempt(result, f"fail{failing}_error", lambda failing=failing: update(f"fail{failing}", sequences(3)))
        trainer.rows.run = rows_run
    # rank 0 refuses a step it cannot share (several updates) before any claim: rank 1 must not wait for it
    attempt(result, "refused_error", lambda: update("refused", sequences(3), claim=False,
                                                    cfg=shared_config(batch_size=4)))
    result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params(trainer)))


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, device = start_rank(sys.argv[3] if len(sys.argv) > 3 else "cpu", bind_device=True,
                              timeout=datetime.timedelta(seconds=30))
    result: dict = {}
    {"train": train, "faults": faults}[scenario](rank, DataParallel(), out, result, device)
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
