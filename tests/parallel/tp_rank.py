"""One rank of the tensor-parallel tests (run by test_tensor_parallel.py with torchrun's env vars).

    python tp_rank.py SCENARIO OUT_DIR [SPEC[+SPEC...]]

SPEC: cpu, cpu-bf16, cpu-bf16-spare, cuda or cuda-f32; several joined by "+" run the scenario once
each in the same process group (one launch for the test's CPU variants), and OUT_DIR/rank{RANK}.pt
then maps each SPEC to its results.

"engine": the tiny model sharded over the ranks; rank 0's engine generates greedily with the
base model and with a LoRA adapter while rank 1's engine follows (rank 1 wraps its shards with
the adapter 3 s late: its engine waits for it); then both ranks run one forward of a prefill
batch outside the engine (rank 0 keeps the logits).
"train": the tiny model sharded, its trainer loaded from the full adapter in OUT_DIR/start (each
rank keeps its slices) and an engine (leader and follower) on the same shards; step 1, a
checkpoint (OUT_DIR/ckpt1, written by rank 0), the engine's greedy tokens with the trained adapter,
step 2 and OUT_DIR/ckpt2; then a fresh trainer resumed from ckpt1 takes step 2 again (OUT_DIR/resumed2).
Each rank saves what it saw to OUT_DIR/rank{RANK}.pt (tensors on the CPU). On "cuda" rank r
computes on cuda:r and the ranks talk through NCCL; on "cpu" through gloo.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from rank_processes import start_rank
from tp_model import engine_for, full_adapter, generate, lora_grads, tiny_llama, wrap_with_adapter

from tempering.modeling.tensor_parallel import TensorParallel, shard_llama_


SPARE_ROWS = None  # the engine scenario's LlamaFamilyModel(spare_rows=...): "cpu-bf16-spare" sets True


def to_cpu(value):
    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def direct_logits(model, peft, tp) -> dict:
    """One prefill forward of two prompts, with and without the adapter, outside any engine."""
    from tempering.engine.context import PrefillSpan, StepContext
    from tempering.engine.lora import EngineAdapter, LoRASegment, collect_adapter
    from tempering.engine.models import LlamaFamilyModel

    m = LlamaFamilyModel(model, 256, tp=tp)
    device = m.device
    adapter = EngineAdapter(collect_adapter(m.hf_layers, "default", m.fused_slices),
                            {"o": m.hidden_size, "down": m.hidden_size})
    out = {}
    for key, lora in (("base", []), ("lora", [LoRASegment(0, 10, adapter)])):
        kv = torch.zeros(m.num_layers, 2, 4, 16, m.num_kv_heads, m.head_dim, device=device, dtype=m.dtype)
        ids = torch.tensor([5, 17, 42, 9, 100, 3, 7, 7, 120, 33], device=device)
        positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3], device=device)
        slots = torch.tensor([16, 17, 18, 19, 20, 21, 32, 33, 34, 35], device=device)
        tables = [torch.tensor([1], device=device), torch.tensor([2], device=device)]
        ctx = StepContext(slot_mapping=slots, num_decode=0,
                          prefill=[PrefillSpan(0, 6, 6, tables[0]), PrefillSpan(6, 4, 4, tables[1])])
        if device.type == "cuda":  # the packed varlen prefill (as ModelRunner.prepare builds it on a GPU)
            ctx.prefill_key_slots = slots
            ctx.cu_q = ctx.cu_k = torch.tensor([0, 6, 10], dtype=torch.int32, device=device)
            ctx.max_q = ctx.max_k = 6
        out[key] = m.logits(m.forward(ids, positions, ctx, kv, lora)).float().cpu()
    return out


def engine(tp: TensorParallel, result: dict, out: Path, device: torch.device) -> None:
    import time

    model = tiny_llama(device=device)
    shard_llama_(model, tp)
    result["q_rows"] = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    holder: dict = {}
    e = engine_for(model, lambda: holder.get("peft"), tp, spare_rows=SPARE_ROWS)
    try:
        if not tp.is_leader:  # the follower gets its adapter late: the leader's first LoRA steps wait for it
            time.sleep(3)
        holder["peft"] = wrap_with_adapter(model, full_adapter(), tp)
        if tp.is_leader:
            result["generated"] = generate(e)
    finally:
        e.close()
    result["logits"] = direct_logits(model, holder["peft"], tp)


@contextlib.contextmanager
def train_stream(device: torch.device):
    """On CUDA, the trainer's work on a stream of its own, as the service runs it (Service._on_train_stream):
    a follower's trainer then never queues its collectives on the stream its engine follows the leader on."""
    device = torch.device(str(device).split("-")[0])  # "cpu-bf16": the CPU; "cuda:N-f32": cuda:N
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)


@contextlib.contextmanager
def training(e, device: torch.device):
    """A training call as the service makes it under tensor parallelism (Service._training): the
    trainer's stream, and the engine paused for it (`Engine.paused_for_training`)."""
    with train_stream(device), e.paused_for_training(timeout_s=60):
        yield


def save(trainer, tp: TensorParallel, directory: Path, step: int) -> None:
    from tempering.storage import write_atomically

    if tp.is_leader:
        write_atomically(directory, lambda tmp: trainer.save(tmp, step=step))
    else:
        trainer.save(None, step=step)


def train(tp: TensorParallel, result: dict, out: Path, device: torch.device) -> None:
    from tp_model import config, sequences

    from tempering.training import Trainer

    model = tiny_llama(device=device)
    shard_llama_(model, tp)
    holder: dict = {}
    # the engine first, as the service makes them
    e = engine_for(model, lambda: holder["trainer"].peft_model if holder else None, tp)
    trainer = holder["trainer"] = Trainer.from_adapter(model, out / "start", tp=tp)
    try:
        with training(e, device):
            result["grads"] = lora_grads(trainer, sequences(1), tp)  # 169 tokens: not split over the ranks
            result["grads_sp"] = lora_grads(trainer, sequences(1)[:7], tp)  # 150: sequence parallel
            result["metrics_1"] = trainer.step(sequences(1), config()).values
            save(trainer, tp, out / "ckpt1", 1)
        if tp.is_leader:  # the follower goes on to step 2 at once: its call waits for the leader's pause
            result["generated_1"] = generate(e)
        with training(e, device):
            result["engine_steps_before_step_2"] = e.stats.num_steps  # a follower: the leader's steps it ran
            trainer.step(sequences(2), config())
            save(trainer, tp, out / "ckpt2", 2)
    finally:
        e.close()
    dist.barrier()
    model = tiny_llama(device=device)
    shard_llama_(model, tp)
    resumed = Trainer.from_adapter(model, out / "ckpt1", tp=tp)
    resumed.load_state(out / "ckpt1")
    resumed.step(sequences(2), config())
    save(resumed, tp, out / "resumed2", 2)


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    global SPARE_ROWS
    specs = (sys.argv[3] if len(sys.argv) > 3 else "cpu").split("+")
    rank, rank_device = start_rank(specs[0].split("-")[0])
    tp = TensorParallel()
    results: dict = {}
    for spec in specs:
        device, SPARE_ROWS = rank_device, None
        if spec.startswith("cpu-bf16"):
            device = spec  # tiny_llama's spec for the CPU in bfloat16 (tp_model.placement)
            SPARE_ROWS = True if spec.endswith("-spare") else None
        elif spec == "cuda-f32":
            device = f"{rank_device}-f32"  # this rank's GPU, float32
        results[spec] = {}
        {"engine": engine, "train": train}[scenario](tp, results[spec], out, device)
    torch.save(to_cpu(results if len(specs) > 1 else results[specs[0]]), out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
