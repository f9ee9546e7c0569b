"""The tensor-parallel engine's all-reduce at a decode step's sizes: NCCL against symmetric memory.

Prints one JSON line. Under tensor parallelism every decode step sums o's and down's float32
partial outputs over the ranks, twice per layer (`TensorParallel.all_reduce`): [rows, hidden +
spare] with the spare rows' x A^T beside them. This times, per all-reduce, 160 of them captured in
one CUDA graph (a 72B model's step at 80 layers) and replayed, for NCCL (`dist.all_reduce`) and for
PyTorch's two-shot all-reduce over symmetric memory (`torch.ops.symm_mem.two_shot_all_reduce_`,
the engine's choice where every rank can map the buffer), with the copy into the buffer that the
engine makes counted. Sizes: 256 and 64 rows (R's batch, and a quarter of it) of a 72B model's
8,192 + 64 columns (float32), and bfloat16 for comparison. Then a whole half-layer (`half_layer`):
the all-reduce and the add + RMSNorm with the LoRA delta that follows it, against the same work
sequence parallel (reduce-scatter, the norm on rows / P, the normed rows gathered).

    python benchmarks/all_reduce.py --gpus 4      # starts its own ranks (one process per GPU)
    torchrun --nproc-per-node 4 benchmarks/all_reduce.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

ALL_REDUCES_PER_GRAPH = 160


def time_graph(fn, make, reps: int = 20) -> float:
    """Microseconds per call of fn over buffers from make(), ALL_REDUCES_PER_GRAPH calls in a CUDA graph."""
    bufs = [make() for _ in range(4)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (NCCL's first call sets up its channels)
        for b in bufs:
            fn(b)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(ALL_REDUCES_PER_GRAPH):
            fn(bufs[i % len(bufs)])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps / ALL_REDUCES_PER_GRAPH * 1e6


def half_layer(rows: int, group: str, device: torch.device, hidden: int = 8192, rank: int = 8) -> dict:
    """Microseconds per half-layer of a decode step after o or down: the partial output (with x A^T
    beside it) summed, the LoRA delta, residual add and RMSNorm, and the normed rows on every rank.

    all_reduce: the float32 [rows, hidden + 64] two-shot all-reduce, then the norm on every row
    (the engine's path). sequence_parallel: a float32 reduce-scatter (each rank gets rows / P
    summed rows), the norm on those rows written into a bfloat16 symmetric buffer, a barrier, and
    the P blocks gathered from every rank's buffer into [rows, hidden] (one copy kernel).
    """
    import torch.distributed._symmetric_memory as symm_mem
    from tempering.engine.layers import triton_lora

    P, me = dist.get_world_size(), dist.get_rank()
    width = hidden + 64
    per = rows // P
    partial = symm_mem.empty((rows, width), dtype=torch.float32, device=device)
    symm_mem.rendezvous(partial, group)
    normed = symm_mem.empty((rows, hidden), dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(normed, group)
    blocks = [handle.get_buffer(r, (rows, hidden), torch.bfloat16)[r * per:(r + 1) * per] for r in range(P)]
    BT = torch.randn(rank, hidden, device=device).to(torch.bfloat16) * 0.01
    weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    residual_all = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
    residual_mine = residual_all[me * per:(me + 1) * per].clone()
    scattered = torch.empty(per, width, device=device)
    gathered = torch.empty(rows, hidden, device=device, dtype=torch.bfloat16)

    def all_reduce(_: torch.Tensor) -> None:
        torch.ops.symm_mem.two_shot_all_reduce_(partial, "sum", group)
        triton_lora.add_rms_norm_lora(partial[:, :hidden], partial[:, hidden:hidden + rank], BT, 2.0, residual_all,
                                      weight, 1e-6)

    def sequence_parallel(_: torch.Tensor) -> None:
        torch.ops.symm_mem.reduce_scatter_out(partial.view(-1), group, False, scattered.view(-1))  # rows split = the flat array split
        triton_lora.add_rms_norm_lora(scattered[:, :hidden], scattered[:, hidden:hidden + rank], BT, 2.0,
                                      residual_mine, weight, 1e-6, out=normed[me * per:(me + 1) * per])
        handle.barrier(channel=0)
        torch.cat(blocks, out=gathered)

    partial.normal_()
    original = partial.clone()
    sequence_parallel(partial)
    sp_out = gathered.clone()
    partial.copy_(original)
    dist.barrier()
    torch.ops.symm_mem.two_shot_all_reduce_(partial, "sum", group)
    ar_out = triton_lora.add_rms_norm_lora(partial[:, :hidden], partial[:, hidden:hidden + rank], BT, 2.0,
                                           residual_all, weight, 1e-6)[0]
    torch.cuda.synchronize()
    equal = bool(torch.equal(sp_out, ar_out))
    a = time_graph(all_reduce, lambda: partial)
    partial.normal_()
    b = time_graph(sequence_parallel, lambda: partial)
    return {"all_reduce_then_norm": round(a, 1), "sequence_parallel": round(b, 1), "speedup": round(a / b, 2),
            "bitwise_equal": equal}


def run() -> None:
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem

    shapes = {"f32_256x8256": ((256, 8256), torch.float32), "f32_64x8256": ((64, 8256), torch.float32),
              "bf16_256x8192": ((256, 8192), torch.bfloat16)}
    out: dict = {"benchmark": "all_reduce", "gpus": dist.get_world_size(),
                 "machine": torch.cuda.get_device_name(device), "torch": torch.__version__,
                 "all_reduces_per_graph": ALL_REDUCES_PER_GRAPH, "us": {}}
    for name, (shape, dtype) in shapes.items():
        nccl = time_graph(lambda b: dist.all_reduce(b), lambda: torch.randn(shape, device=device).to(dtype))
        buffer = symm_mem.empty(shape, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group)

        def two_shot(partial: torch.Tensor) -> None:  # as TensorParallel.all_reduce: into the buffer, summed there
            buffer.copy_(partial)
            torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group)

        symmetric = time_graph(two_shot, lambda: torch.randn(shape, device=device).to(dtype))
        out["us"][name] = {"nccl": round(nccl, 1), "symmetric_two_shot": round(symmetric, 1),
                           "speedup": round(nccl / symmetric, 2)}
    for rows in (256, 64):
        out["us"][f"half_layer_{rows}"] = half_layer(rows, group, device)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    if "RANK" in os.environ:
        return run()
    if args.gpus < 2:
        sys.exit("needs two GPUs or more")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {"WORLD_SIZE": str(args.gpus), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, __file__],
                              env={**os.environ, **base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(args.gpus)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
