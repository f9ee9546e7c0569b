"""The decode attention of an agent's batch: how close the paged decode kernel comes to HBM
bandwidth, whether rows sharing a system prompt's cache blocks already gain from the L2 cache,
and what cascade attention (EngineConfig.cascade_attention) gains over them.

At Qwen3-8B's attention shape (32 query heads, 8 KV heads, head dim 128, bf16, pages of 16), B
decode rows each read a shared prefix of `--shared` keys (an agent's system prompt and tool
schemas) plus their own keys (uniform in `--own`, the conversation so far). One layer's
attention is timed (`triton.testing.do_bench`, the median) in four ways:
- `distinct`: every row's keys in blocks of its own (no sharing; what the bytes model counts),
- `distinct_uniform`: the same number of keys in all, every row the same length (what the
  split kernel loses to rows of different lengths, whose keys it splits alike),
- `shared`: the prefix's blocks the same for every row, as the prefix cache leaves them (the
  kernel still reads them once per row; the L2 cache may serve the repeats),
- `cascade`: the same tables with the shared prefix read once per tile of rows,
- `tilings`: the `distinct` case under other tilings of the split kernel (keys per tile, warps,
  pipeline stages), to choose its defaults.
Each gets its achieved bandwidth over the bytes it must read (`distinct`: every row's keys;
`shared`/`cascade`: the prefix once plus each row's own keys), against the HBM bandwidth measured
in the same run (roofline.py), and its time for a 36-layer step.

    python benchmarks/decode_attention.py                       # CUDA with Triton
    python benchmarks/decode_attention.py --rows 32,64,128 --shared 2000 --own 0,4000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from roofline import measure_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64,128", help="decode batch sizes, comma-separated")
    parser.add_argument("--shared", type=int, default=2000, help="keys of the prefix every row shares")
    parser.add_argument("--own", default="0,4000", help="each row's own keys: uniform in LOW,HIGH")
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim (Qwen3-8B's)")
    parser.add_argument("--layers", type=int, default=36, help="layers of a step, for the per-step time")
    parser.add_argument("--skip-tilings", action="store_true")
    args = parser.parse_args()

    import triton.testing

    from tempering.engine.layers.triton_attention import paged_decode_attention

    device, page = torch.device("cuda"), 16
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    low, high = (int(x) for x in args.own.split(","))
    hw = measure_device(device)
    result: dict = {"benchmark": "decode_attention", "device": torch.cuda.get_device_name(device),
                    "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "page": page},
                    "shared_keys": args.shared, "own_keys": [low, high], "hbm_gb_s": hw["hbm_gb_s"], "rows": {}}
    bytes_per_key = 2 * kv_heads * dim * 2  # K and V, bf16
    scale = dim ** -0.5
    for B in (int(x) for x in args.rows.split(",")):
        g = torch.Generator().manual_seed(B)
        own = torch.randint(low, high + 1, (B,), generator=g)
        lens = (args.shared + own).to(torch.int32)
        shared_blocks = args.shared // page
        per_row = -(-int(lens.max()) // page)
        num_blocks = 1 + B * per_row
        k_cache = torch.randn(num_blocks, page, kv_heads, dim, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        distinct = (1 + torch.arange(B * per_row)).view(B, per_row).to(torch.int32)  # each row its own blocks
        shared = distinct.clone()
        shared[:, :shared_blocks] = distinct[0, :shared_blocks]
        distinct, shared, lens = distinct.to(device), shared.to(device), lens.to(device)
        q = torch.randn(B, heads, dim, device=device, dtype=torch.bfloat16)
        uniform = torch.full_like(lens, int(lens.float().mean()))
        prefix = torch.tensor([shared_blocks * page], device=device)
        all_bytes = int(lens.sum()) * bytes_per_key
        unique_bytes = (shared_blocks * page + int(lens.sum()) - B * shared_blocks * page) * bytes_per_key

        def timed(fn, bytes_: int) -> dict:
            us = triton.testing.do_bench(fn) * 1e3
            return {"us": round(us, 1), "gb_s": round(bytes_ / us / 1e3, 1),
                    "of_hbm": round(bytes_ / us / 1e3 / hw["hbm_gb_s"], 3), "step_ms": round(us * args.layers / 1e3, 2)}

        row: dict = {
            "mean_keys": round(float(lens.float().mean()), 1),
            "bytes_mb": {"every_row": round(all_bytes / 1e6, 1), "prefix_once": round(unique_bytes / 1e6, 1)},
            "distinct": timed(lambda: paged_decode_attention(q, k_cache, v_cache, distinct, lens, scale), all_bytes),
            "distinct_uniform": timed(lambda: paged_decode_attention(q, k_cache, v_cache, distinct, uniform, scale),
                                      int(uniform.sum()) * bytes_per_key),
            "shared": timed(lambda: paged_decode_attention(q, k_cache, v_cache, shared, lens, scale), unique_bytes),
            "cascade": timed(lambda: paged_decode_attention(q, k_cache, v_cache, shared, lens, scale,
                                                            shared_prefix=prefix), unique_bytes),
        }
        reference = paged_decode_attention(q, k_cache, v_cache, shared, lens, scale)
        cascaded = paged_decode_attention(q, k_cache, v_cache, shared, lens, scale, shared_prefix=prefix)
        row["cascade_max_abs_difference"] = float((cascaded.float() - reference.float()).abs().max())
        row["cascade_speedup_over_shared"] = round(row["shared"]["us"] / row["cascade"]["us"], 3)
        if not args.skip_tilings:
            tilings = {}
            for block_n in (64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        try:
                            t = timed(lambda: paged_decode_attention(q, k_cache, v_cache, distinct, lens, scale,
                                                                     block_n=block_n, num_warps=warps,
                                                                     num_stages=stages), all_bytes)
                        except Exception as exc:  # e.g. out of shared memory for the tile
                            t = {"error": type(exc).__name__}
                        tilings[f"n{block_n}_w{warps}_s{stages}"] = t
            row["tilings"] = tilings
        result["rows"][B] = row
        del k_cache, v_cache
        torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
