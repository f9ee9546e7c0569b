"""Exact on-policy mode's attention (engine/layers/triton_attention.py `invariant_attention`): is a
prefilled query bit for bit the same query decoded, and what does the mode's attention cost
against the per-query decode kernel it replaced and the default mode's kernels?

For the Qwen2.5-1.5B and SmolLM2-135M attention shapes, a scoring prefill (what exact mode runs
to recompute stale sequences: `--seqs` sequences of `--seq-len` tokens, every query over its
keys) and a decode step (`--decode-rows` rows over `--seq-len` cached keys each) are timed with:
- `invariant_attention` (blocks of queries of one sequence share each key tile),
- the former exact-mode path: the paged decode kernel with one split, one program per query,
- the default mode's kernels: FlashAttention varlen for the prefill, the split decode kernel.
Prints one JSON line: per shape, microseconds per layer call and the ratios, and whether every
prefilled query equalled its decoded self bit for bit.

    python benchmarks/batch_invariant_attention.py            # CUDA with Triton
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from tempering.engine.layers.triton_attention import (
    invariant_attention, paged_decode_attention, queries_per_block, varlen_prefill_attention,
)

SHAPES = {"1.5b": (12, 2, 128), "135m": (9, 3, 64)}  # name: (query heads, KV heads, head dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1152)
    parser.add_argument("--decode-rows", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, page = torch.device("cuda"), 16
    S, L = args.seqs, args.seq_len
    per_seq = -(-L // page)
    num_blocks = max(S, args.decode_rows) * per_seq + 1
    result: dict = {"seqs": S, "seq_len": L, "decode_rows": args.decode_rows}
    for name, (heads, kv_heads, dim) in SHAPES.items():
        k_cache = torch.randn(num_blocks, page, kv_heads, dim, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        scale = dim ** -0.5
        tables = (torch.arange(max(S, args.decode_rows) * per_seq, device=device) + 1).view(-1, per_seq)
        # the prefill: S whole sequences, each token a query over its keys
        T = S * L
        q = torch.randn(T, heads, dim, device=device, dtype=torch.bfloat16)
        token_tables = tables[:S].repeat_interleave(L, 0)
        lens = torch.arange(1, L + 1, device=device).repeat(S)
        per_block = queries_per_block(heads, kv_heads)
        blocks = torch.tensor([(s * L + i, min(per_block, L - i)) for s in range(S) for i in range(0, L, per_block)],
                              device=device, dtype=torch.int32)
        slots = (tables[:S, :, None] * page + torch.arange(page, device=device)).flatten(1)[:, :L].flatten()
        keys = k_cache.view(-1, kv_heads, dim)[slots]
        values = v_cache.view(-1, kv_heads, dim)[slots]
        cu = torch.arange(0, T + 1, L, device=device, dtype=torch.int32)

        prefilled = invariant_attention(q, k_cache, v_cache, token_tables, lens, scale, blocks)
        decoded = invariant_attention(q, k_cache, v_cache, token_tables, lens, scale)
        prefill_us = {
            "invariant": triton.testing.do_bench(
                lambda: invariant_attention(q, k_cache, v_cache, token_tables, lens, scale, blocks)) * 1e3,
            "per_query_decode_kernel": triton.testing.do_bench(
                lambda: paged_decode_attention(q, k_cache, v_cache, token_tables, lens, scale, num_splits=1)) * 1e3,
            "flash_varlen": triton.testing.do_bench(
                lambda: varlen_prefill_attention(q, keys, values, cu, cu, L, L, scale)) * 1e3,
        }
        # a decode step: B rows, each over L cached keys
        B = args.decode_rows
        qd = torch.randn(B, heads, dim, device=device, dtype=torch.bfloat16)
        dlens = torch.full((B,), L, device=device)
        decode_us = {
            "invariant": triton.testing.do_bench(
                lambda: invariant_attention(qd, k_cache, v_cache, tables[:B], dlens, scale)) * 1e3,
            "per_query_decode_kernel": triton.testing.do_bench(
                lambda: paged_decode_attention(qd, k_cache, v_cache, tables[:B], dlens, scale, num_splits=1)) * 1e3,
            "split_decode_kernel": triton.testing.do_bench(
                lambda: paged_decode_attention(qd, k_cache, v_cache, tables[:B], dlens, scale)) * 1e3,
        }
        result[name] = {
            "prefill_bitwise_equal_to_decode": bool(torch.equal(prefilled, decoded)),
            "prefill_us": {k: round(v, 1) for k, v in prefill_us.items()},
            "prefill_invariant_vs_per_query": round(prefill_us["invariant"] / prefill_us["per_query_decode_kernel"], 3),
            "prefill_invariant_vs_flash": round(prefill_us["invariant"] / prefill_us["flash_varlen"], 3),
            "decode_us": {k: round(v, 1) for k, v in decode_us.items()},
            "decode_invariant_vs_per_query": round(decode_us["invariant"] / decode_us["per_query_decode_kernel"], 3),
            "decode_invariant_vs_split": round(decode_us["invariant"] / decode_us["split_decode_kernel"], 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
