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
sequence parallel (reduce-scatter, the norm on rows / P, the normed rows gathered). Last, a 72B
decode step's GEMMs and all-reduces at this many ranks, in sequence against two-batch overlap
(`layer_overlap`).

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


def time_graph(fn, make, reps: int = 20, calls: int = ALL_REDUCES_PER_GRAPH) -> float:
    """Microseconds per call of fn over buffers from make(), `calls` calls in a CUDA graph."""
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
        for i in range(calls):
            fn(bufs[i % len(bufs)])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps / calls * 1e6


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

    def all_reduce(_: torch.Tensor) -> torch.Tensor:
        torch.ops.symm_mem.two_shot_all_reduce_(partial, "sum", group)
        return triton_lora.add_rms_norm_lora(partial[:, :hidden], partial[:, hidden:hidden + rank], BT, 2.0,
                                             residual_all, weight, 1e-6)[0]

    def sequence_parallel(_: torch.Tensor) -> None:
        # split by rows = the flat array split in P (the op takes 1-D tensors)
        torch.ops.symm_mem.reduce_scatter_out(partial.view(-1), group, False, scattered.view(-1))
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
    ar_out = all_reduce(partial)
    torch.cuda.synchronize()
    equal = bool(torch.equal(sp_out, ar_out))
    a = time_graph(all_reduce, lambda: partial)
    partial.normal_()
    b = time_graph(sequence_parallel, lambda: partial)
    return {"all_reduce_then_norm": round(a, 1), "sequence_parallel": round(b, 1), "speedup": round(a / b, 2),
            "bitwise_equal": equal}


def layer_overlap(group: str, device: torch.device, rows: int = 256, layers: int = 80) -> dict:
    """Milliseconds per decode step of a 72B model's per-rank GEMMs at TP P (this many ranks) with
    their two float32 all-reduces per layer (attention and the elementwise kernels left out, a cast standing in for
    each norm): in sequence (the engine's schedule), with the all-reduces left out (the bound), and
    as two-batch overlap: the rows split in two halves, each half's all-reduce on a second stream
    beside the other half's GEMMs."""
    import torch.distributed._symmetric_memory as symm_mem

    P = dist.get_world_size()
    hidden, inter, q, kv, spare = 8192, 29568 // P, 8192 // P, 2 * 1024 // P, 64
    bf = torch.bfloat16

    def weights() -> dict:
        return {"qkv": torch.randn(q + kv + spare, hidden, device=device, dtype=bf) * 0.01,
                "o": torch.randn(hidden + spare, q, device=device, dtype=bf) * 0.01,
                "gate_up": torch.randn(2 * inter + spare, hidden, device=device, dtype=bf) * 0.01,
                "down": torch.randn(hidden + spare, inter, device=device, dtype=bf) * 0.01}

    sets = [weights(), weights()]  # alternating, so that no layer finds its weights in L2
    buffers = []  # the whole batch's, then each half's
    for n in (rows, rows // 2, rows // 2):
        b = symm_mem.empty((n, hidden + spare), dtype=torch.float32, device=device)
        symm_mem.rendezvous(b, group)
        buffers.append(b)
    x0 = torch.randn(rows, hidden, device=device, dtype=bf)

    def gemms(x: torch.Tensor, w: dict, buf: torch.Tensor, stage: str) -> None:
        """A half-layer's two products, the second's float32 partial output written into `buf`."""
        if stage == "attn":
            qkv = x @ w["qkv"].T
            torch.mm(qkv[:, :q], w["o"].T, out_dtype=torch.float32, out=buf)
        else:
            act = (x @ w["gate_up"].T)[:, :inter]
            torch.mm(act, w["down"].T, out_dtype=torch.float32, out=buf)

    def half(x: torch.Tensor, w: dict, buf: torch.Tensor, stage: str, reduce) -> torch.Tensor:
        gemms(x, w, buf, stage)
        reduce(buf)
        return buf[:, :hidden].to(bf)

    def two_shot(buf: torch.Tensor) -> None:
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)

    def sequential(reduce) -> None:
        x = x0
        for i in range(layers):
            w = sets[i % 2]
            x = half(half(x, w, buffers[0], "attn", reduce), w, buffers[0], "mlp", reduce)

    comm = torch.cuda.Stream()

    def overlapped() -> None:
        main = torch.cuda.current_stream()
        xs = [x0[: rows // 2], x0[rows // 2:]]
        done = [None, None]  # half h's all-reduce, which its next GEMM waits for
        for i in range(layers):
            w = sets[i % 2]
            for stage in ("attn", "mlp"):
                for h in (0, 1):
                    buf = buffers[1 + h]
                    if done[h] is not None:
                        main.wait_event(done[h])
                        xs[h] = buf[:, :hidden].to(bf)
                    gemms(xs[h], w, buf, stage)
                    ready = torch.cuda.Event()
                    ready.record(main)
                    comm.wait_event(ready)
                    with torch.cuda.stream(comm):  # beside the other half's GEMMs
                        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
                        done[h] = torch.cuda.Event()
                        done[h].record(comm)
        for h in (0, 1):
            main.wait_event(done[h])
        main.wait_stream(comm)

    def step_ms(fn) -> float:
        return time_graph(lambda _: fn(), lambda: x0, reps=10, calls=1) / 1e3

    out = {"rows": rows, "layers": layers, "gpus": P,
           "sequential_ms": round(step_ms(lambda: sequential(two_shot)), 2),
           "gemms_only_ms": round(step_ms(lambda: sequential(lambda b: None)), 2),
           "two_batch_overlap_ms": round(step_ms(overlapped), 2)}
    out["overlap_speedup"] = round(out["sequential_ms"] / out["two_batch_overlap_ms"], 3)
    return out


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
    out["decode_step_72b"] = layer_overlap(group, device)
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
