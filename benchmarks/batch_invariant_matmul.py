"""The batch-invariant matrix product (engine/layers/triton_matmul.py): are its tile configs
bitwise alike, and how fast is each against cuBLAS, at decode and prefill sizes?

For each weight shape of the Qwen2.5-1.5B and SmolLM2-135M layers (q/k/v, o, gate/up, down, the
LM head with float32 output), random bf16 x of 4,096 rows is multiplied by every config in
CONFIGS at several row counts M; each result must equal, bit for bit, the first M rows of the
default config's product of all 4,096 rows (what batch invariance means: a row's result does
not depend on M or the config). Then each config and `torch.nn.functional.linear` (cuBLAS) are
timed at M = 64, 256, 4,096 and 16,384. Prints one JSON line: per config, whether it was
bitwise equal everywhere; per shape and M, microseconds per product and the best config's time
over cuBLAS's.

    python benchmarks/batch_invariant_matmul.py            # CUDA with Triton
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import triton.testing

from tempering.engine.layers import triton_matmul

SHAPES = {  # name: (K, N)
    "1.5b.qkv": (1536, 2048), "1.5b.o": (1536, 1536), "1.5b.gate_up": (1536, 17920), "1.5b.down": (8960, 1536),
    "1.5b.lm_head": (1536, 151936),
    "135m.qkv": (576, 960), "135m.o": (576, 576), "135m.gate_up": (576, 3072), "135m.down": (1536, 576),
    "135m.lm_head": (576, 49152),
}
CHECK_M = (1, 7, 64, 100, 256, 1000, 4096)
TIME_M = (64, 256, 4096, 16384)


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    equal = {name: True for name in triton_matmul.CONFIGS}
    timings: dict = {}
    buckets: dict = {}
    for shape, (K, N) in SHAPES.items():
        out_dtype = torch.float32 if shape.endswith("lm_head") else torch.bfloat16
        w = (torch.randn(N, K, device=device) / K ** 0.5).to(torch.bfloat16)
        x = torch.randn(max(TIME_M), K, device=device).to(torch.bfloat16)
        ref = triton_matmul.matmul(x[:4096], w, out_dtype=out_dtype)
        for name in triton_matmul.CONFIGS:
            for m in CHECK_M:
                y = triton_matmul.matmul(x[:m], w, out_dtype=out_dtype, config=name)
                if not torch.equal(y, ref[:m]):
                    equal[name] = False
        for m in TIME_M:
            if shape.endswith("lm_head") and m > 4096:
                continue
            xm = x[:m]
            row = {"cublas": triton.testing.do_bench(lambda: F.linear(xm, w).to(out_dtype)) * 1e3}
            for name in triton_matmul.CONFIGS:
                row[name] = triton.testing.do_bench(lambda n=name: triton_matmul.matmul(xm, w, out_dtype=out_dtype, config=n)) * 1e3
            best = min((k for k in row if k != "cublas"), key=row.__getitem__)
            timings[f"{shape}.M{m}"] = {**{k: round(v, 1) for k, v in row.items()}, "best": best,
                                        "best_vs_cublas": round(row[best] / row["cublas"], 2),
                                        "default_vs_cublas": round(row[triton_matmul.DEFAULT_CONFIG] / row["cublas"], 2),
                                        "selected": triton_matmul.config_for(m, N),
                                        "selected_vs_cublas": round(row[triton_matmul.config_for(m, N)] / row["cublas"], 2)}
            ratios = buckets.setdefault(bucket(m, N), {})
            for name in triton_matmul.CONFIGS:
                ratios[name] = ratios.get(name, 0.0) + row[name] / row["cublas"]
    # per SELECT bucket, the bitwise-equal config with the least summed time over cuBLAS's
    suggested = {"/".join(b): min((c for c in r if equal[c]), key=r.__getitem__) for b, r in buckets.items()}
    print(json.dumps({"benchmark": "batch_invariant_matmul", "machine": torch.cuda.get_device_name(device),
                      "torch": torch.__version__, "bitwise_equal_to_default": equal, "suggested_select": suggested,
                      "us": timings}))


def bucket(M: int, N: int) -> tuple[str, str]:
    """The SELECT key of a product (triton_matmul.config_for)."""
    return ("large" if M >= triton_matmul.LARGE_M else "small", "large" if N >= triton_matmul.LARGE_N else "small")


if __name__ == "__main__":
    main()
