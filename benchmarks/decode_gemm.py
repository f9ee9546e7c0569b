"""A decode step's GEMMs: cuBLAS against Triton tiles that read each weight once.

Prints one JSON line. With the live adapter bound to the spare rows, every projection of a decode
step is one GEMM with a float32 output (`torch.mm(x, W.T, out_dtype=torch.float32)`, x [rows, in]
bfloat16, W [out + spare, in]). At a few hundred rows these products are bound by reading W, and
cuBLAS may tile the rows in two (each weight tile read twice) or leave SMs idle. This times, per
projection of a model shape at one tensor-parallel degree (each rank's shards), cuBLAS and the
engine's batch-invariant Triton kernel (engine/layers/triton_matmul.py) at several tile shapes,
in CUDA graphs over enough copies of the weights that none stays in L2, and reports microseconds,
the weight bytes read per second, and the best Triton tile's speed-up.

    python benchmarks/decode_gemm.py --model 72b --tp 4 --rows 256
    python benchmarks/decode_gemm.py --model 1.5b --tp 1 --rows 256 128
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {  # hidden, intermediate, query heads, KV heads, head dim
    "1.5b": (1536, 8960, 12, 2, 128),
    "32b": (5120, 27648, 40, 8, 128),
    "72b": (8192, 29568, 64, 8, 128),
}
SPARE = 64  # the spare rows' x A^T columns (about what rank-16 LoRA slices take)
TILES = [(128, 128, 8, 3), (64, 64, 4, 6), (64, 128, 4, 4), (128, 64, 4, 4), (256, 64, 8, 4), (256, 32, 8, 4),
         (128, 32, 4, 6), (256, 128, 8, 3)]


def projections(model: str, tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each rank's fused projection, spare rows included."""
    hidden, inter, heads, kv, dim = SHAPES[model]
    return {"qkv": ((heads + 2 * kv) * dim // tp + SPARE, hidden), "o": (hidden + SPARE, heads * dim // tp),
            "gate_up": (2 * inter // tp + SPARE, hidden), "down": (hidden + SPARE, inter // tp)}


def time_us(fn, copies: int, calls: int = 64, reps: int = 20) -> float:
    """Microseconds per call of fn(i) (i: which weight copy), `calls` calls in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="72b")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemm.py times GPU kernels: it needs a CUDA GPU")
    import triton

    from tempering.engine.layers import triton_matmul

    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    out: dict = {"benchmark": "decode_gemm", "machine": torch.cuda.get_device_name(device), "model": args.model,
                 "tp": args.tp, "torch": torch.__version__, "us": {}}
    for name, (N, K) in projections(args.model, args.tp).items():
        copies = max(2, -(-4 * l2 // (N * K * 2)))  # together 4x the L2
        weights = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(rows, K, device=device, dtype=torch.bfloat16)
            y = torch.empty(rows, N, device=device, dtype=torch.float32)
            ref = torch.mm(x, weights[0].T, out_dtype=torch.float32)
            def cublas(i: int, x=x, y=y, weights=weights) -> None:
                torch.mm(x, weights[i].T, out_dtype=torch.float32, out=y)

            row = {"cublas": round(time_us(cublas, copies), 1)}
            for bm, bn, warps, stages in TILES:
                def tri(i: int, bm=bm, bn=bn, warps=warps, stages=stages, x=x, y=y, weights=weights, rows=rows,
                        N=N, K=K) -> None:
                    w = weights[i]
                    triton_matmul._matmul_kernel[(triton.cdiv(rows, bm), triton.cdiv(N, bn))](
                        x, w, w, y, rows, N, K, x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=False,
                        BM=bm, BN=bn, BK=triton_matmul.BLOCK_K, num_warps=warps, num_stages=stages)
                try:
                    tri(0)
                    torch.cuda.synchronize()
                    close = torch.allclose(y, ref, rtol=1e-3, atol=1e-3)
                    row[f"{bm}x{bn}w{warps}s{stages}"] = round(time_us(tri, copies), 1) if close else "wrong"
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit shared memory: recorded
                    row[f"{bm}x{bn}w{warps}s{stages}"] = type(exc).__name__
            timed = {k: v for k, v in row.items() if k != "cublas" and isinstance(v, float)}
            best = min(timed, key=timed.get)
            row |= {"best_triton": best, "speedup": round(row["cublas"] / timed[best], 3),
                    "cublas_weight_gb_s": round(N * K * 2 / row["cublas"] / 1e3, 0),
                    "best_weight_gb_s": round(N * K * 2 / timed[best] / 1e3, 0)}
            out["us"][f"{name}_{rows}"] = row
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
