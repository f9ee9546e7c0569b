"""The GPU attention kernels against the plain PyTorch path (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def reference_decode(q, k_cache, v_cache, tables, lens, scale, window=None):
    out = []
    page = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        if n == 0:
            out.append(torch.zeros_like(q[b]))
            continue
        first = max(0, n - window) if window is not None else 0  # a sliding window: the last `window` keys
        blocks = tables[b, : -(-n // page)].long()
        k = k_cache[blocks].flatten(0, 1)[first:n].transpose(0, 1)[None].float()
        v = v_cache[blocks].flatten(0, 1)[first:n].transpose(0, 1)[None].float()
        o = F.scaled_dot_product_attention(q[b][None, :, None].float(), k, v, scale=scale, enable_gqa=True)
        out.append(o[0, :, 0].to(q.dtype))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 16, 100], ids=["all-keys", "window-16", "window-100"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (9, 3, 64), (8, 8, 64), (32, 8, 128), (4, 1, 256)])
def test_triton_paged_decode_matches_sdpa(heads, kv_heads, dim, window):
    from tempering.engine.layers.triton_attention import paged_decode_attention

    torch.manual_seed(0)
    device, page, num_blocks = "cuda", 16, 512
    k_cache = torch.randn(num_blocks, page, kv_heads, dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([1, 15, 16, 17, 300, 0, 1000, 64], device=device, dtype=torch.int32)
    tables = torch.randint(1, num_blocks, (len(lens), 80), device=device, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, device=device, dtype=torch.bfloat16)
    scale = dim ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window=window)
    ref = reference_decode(q, k_cache, v_cache, tables, lens, scale, window)
    assert (out.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64), (12, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("rows", [8, 40, 130])
def test_cascade_decode_attention_equals_each_row_reading_its_own_keys(heads, kv_heads, dim, rows):
    """Rows whose first blocks are the same cache blocks (an agent's system prompt): the shared prefix
    read once per tile of rows, merged with each row's own keys, is the attention each row computes
    alone, for prefixes of 0, one block, a few tiles and every row's whole context but one key;
    padding rows (no keys) stay zero."""
    from tempering.engine.layers.triton_attention import paged_decode_attention

    torch.manual_seed(0)
    device, page, num_blocks = "cuda", 16, 4096
    k_cache = torch.randn(num_blocks, page, kv_heads, dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    shared_blocks = 20
    lens = torch.randint(shared_blocks * page + 1, 60 * page, (rows,), device=device, dtype=torch.int32)
    lens[-1] = 0  # a CUDA-graph bucket's padding row
    lens[0] = shared_blocks * page + 1
    tables = torch.randint(1, num_blocks, (rows, 64), device=device, dtype=torch.int32)
    tables[:, :shared_blocks] = tables[0, :shared_blocks]
    q = torch.randn(rows, heads, dim, device=device, dtype=torch.bfloat16)
    scale = dim ** -0.5
    ref = reference_decode(q, k_cache, v_cache, tables, lens, scale)
    for prefix in (0, page, 9 * page, shared_blocks * page):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                     shared_prefix=torch.tensor([prefix], device=device))
        assert (out.float() - ref.float()).abs().max() < 2e-2, prefix
        assert out[-1].abs().max() == 0


@pytest.mark.parametrize("window", [None, 24, 100], ids=["all-keys", "window-24", "window-100"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (9, 3, 64), (8, 8, 64), (32, 8, 128), (32, 2, 128),
                                                (4, 1, 256)])
def test_invariant_attention_prefills_each_query_bit_for_bit_as_it_decodes_it(heads, kv_heads, dim, window):
    """With a sliding window (Gemma 3's local layers) a prefill block's queries start at different
    tiles: the tiles before a query's window must leave it exactly as it would start decoded."""
    from tempering.engine.layers.triton_attention import invariant_attention, queries_per_block

    torch.manual_seed(0)
    device, page, num_blocks = "cuda", 16, 512
    k_cache = torch.randn(num_blocks, page, kv_heads, dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    # three chunks: a whole prompt, a chunk extending a cached prefix of 60 keys, a one-token chunk
    chunks = [(0, 130), (60, 75), (299, 1)]  # (cached keys, new queries)
    tables = [torch.randperm(num_blocks - 1, device=device)[:40] + 1 for _ in chunks]
    per_token_tables = torch.cat([t[None].expand(n, -1) for t, (_, n) in zip(tables, chunks)])
    lens = torch.cat([torch.arange(c + 1, c + n + 1, device=device) for c, n in chunks])
    per_block = queries_per_block(heads, kv_heads)
    blocks, first = [], 0
    for _, n in chunks:
        blocks += [(first + s, min(per_block, n - s)) for s in range(0, n, per_block)]
        first += n
    blocks = torch.tensor(blocks, device=device, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, device=device, dtype=torch.bfloat16)
    scale = dim ** -0.5
    prefilled = invariant_attention(q, k_cache, v_cache, per_token_tables, lens, scale, blocks, window=window)
    decoded = invariant_attention(q, k_cache, v_cache, per_token_tables, lens, scale,  # one query per program
                                  window=window)
    assert torch.equal(prefilled, decoded)
    # the same queries decoded among other rows (a padding row of 0 keys included)
    padded = torch.cat([q[:5], torch.zeros_like(q[:1]), q[5:]])
    padded_lens = torch.cat([lens[:5], lens.new_zeros(1), lens[5:]])
    padded_tables = torch.cat([per_token_tables[:5], per_token_tables[:1], per_token_tables[5:]])
    crowd = invariant_attention(padded, k_cache, v_cache, padded_tables, padded_lens, scale, window=window)
    assert torch.equal(torch.cat([crowd[:5], crowd[6:]]), decoded) and not crowd[5].any()
    ref = reference_decode(q, k_cache, v_cache, per_token_tables, lens, scale, window)
    assert (decoded.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.parametrize("window", [None, 8], ids=["all-keys", "window-8"])
def test_varlen_prefill_matches_per_sequence_sdpa(window):
    from tempering.engine.layers.triton_attention import HAS_VARLEN, varlen_prefill_attention

    if not HAS_VARLEN:
        pytest.skip("torch has no varlen_attn")
    torch.manual_seed(0)
    heads, kv_heads, dim = 12, 2, 128
    spans = [(7, 7), (5, 40), (16, 16)]  # (new queries, keys): the second extends a cached prefix
    qs = [torch.randn(nq, heads, dim, device="cuda", dtype=torch.bfloat16) for nq, _ in spans]
    ks = [torch.randn(nk, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _, nk in spans]
    vs = [torch.randn_like(k) for k in ks]
    cu_q = torch.tensor([0, 7, 12, 28], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 47, 63], device="cuda", dtype=torch.int32)
    out = varlen_prefill_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, cu_k, 16, 40, dim ** -0.5,
                                   window=window)
    start = 0
    for (nq, nk), q, k, v in zip(spans, qs, ks, vs):
        rows = torch.arange(nq, device="cuda")[:, None] + (nk - nq)
        cols = torch.arange(nk, device="cuda")[None, :]
        mask = (cols <= rows) & (cols > rows - window) if window is not None else cols <= rows
        ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(),
                                             v.transpose(0, 1)[None].float(), attn_mask=mask, enable_gqa=True)
        assert (out[start:start + nq].float() - ref[0].transpose(0, 1)).abs().max() < 2e-2
        start += nq


def test_fused_elementwise_kernels_match_their_pytorch_twins():
    from tempering.engine.layers import activation, norm, rotary, triton_ops

    torch.manual_seed(0)
    N, H, heads, D = 37, 1536, 12, 128
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(triton_ops.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    y, res = triton_ops.add_rms_norm(x, r, w, 1e-6)
    y_ref, res_ref = norm.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, res_ref)
    assert (y.float() - y_ref.float()).abs().max() <= 1e-2 * y_ref.float().abs().max()
    qkv = torch.randn(N, (heads + 4) * D, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : heads * D].view(N, heads, D)  # a strided view, as in the model
    cos, sin = torch.randn(N, D, device="cuda", dtype=torch.bfloat16), torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    expected = rotary.apply_rotary(q.clone(), cos, sin)
    triton_ops.rotary_(q, cos, sin)
    assert (q.float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max()
    qn = q.clone()
    assert (triton_ops.rms_norm(qn, w[:D], 1e-6).float() - norm.rms_norm(qn, w[:D], 1e-6).float()).abs().max() < 5e-2
    gate_up = torch.randn(N, 2 * 8960, device="cuda", dtype=torch.bfloat16)
    act = triton_ops.silu_and_mul(gate_up)
    act_ref = activation.silu_and_mul(gate_up)
    assert (act.float() - act_ref.float()).abs().max() <= 2e-2 * act_ref.float().abs().max()


def test_fused_rotary_and_kv_store_equals_rotary_then_store_kv():
    from tempering.engine.layers import ops, triton_ops

    torch.manual_seed(0)
    N, heads, kv_heads, D, blocks, page = 37, 12, 2, 128, 16, 16
    for _ in range(2):  # fresh inputs each time; a poisoned cache shows unwritten slots
        qkv = torch.randn(N, (heads + 2 * kv_heads) * D + 8, device="cuda", dtype=torch.bfloat16)[:, :-8]  # strided rows
        views = [qkv[:, a * D:b * D].view(N, b - a, D) for a, b in ((0, heads), (heads, heads + kv_heads),
                                                                     (heads + kv_heads, heads + 2 * kv_heads))]
        cos, sin = (torch.randn(N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        slots = torch.randperm(blocks * page, device="cuda")[:N]
        results = []
        for fn in (triton_ops.rotary_and_store_, ops.rotary_and_store_):
            q, k, v = (t.clone() for t in views)
            caches = [torch.full((blocks, page, kv_heads, D), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            fn(q, k, v, cos, sin, *caches, slots)
            results.append((q, *caches))
        for fused, twin in zip(*results):
            written = ~torch.isnan(twin)
            assert torch.equal(torch.isnan(fused), torch.isnan(twin))  # exactly the same slots written
            assert (fused[written].float() - twin[written].float()).abs().max() <= 2e-2 * twin[written].float().abs().max()


def test_fused_sampler_draws_the_same_tokens_as_its_pytorch_twin():
    from tempering.engine.layers.triton_sampler import gumbel_sample
    from tempering.engine.sampler import gumbel_sample_reference

    torch.manual_seed(0)
    B, V = 64, 151936
    logits = (torch.randn(B, V, device="cuda") * 4).to(torch.bfloat16)
    temperature = torch.rand(B, device="cuda") + 0.3
    temperature[::7] = 0.0  # greedy rows
    seeds = torch.randint(0, 2**31 - 1, (B,), device="cuda")
    counters = torch.randint(0, 1000, (B,), device="cuda")
    ids, lps, _ = gumbel_sample(logits, temperature, seeds, counters)
    ref_ids, ref_lps = gumbel_sample_reference(logits, temperature, seeds, counters)
    assert (ids == ref_ids).float().mean() > 0.98  # float rounding may flip a near-tie
    same = ids == ref_ids
    assert (lps[same] - ref_lps[same]).abs().max() < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [1, 37, 256, 1000])
def test_lora_kernels_match_the_pytorch_path(dtype, N):
    """Shrink/expand over fused slices (one without LoRA), and the SwiGLU fusion, against plain matmuls."""
    from tempering.engine.layers import triton_lora

    torch.manual_seed(0)
    K, r = 1536, 8
    x = torch.randn(N, K, device="cuda", dtype=dtype)
    A = [torch.randn(r, K, device="cuda") * 0.05 for _ in range(2)]  # float32, as the trainer keeps them
    columns = [slice(0, 1536), slice(1792, 2048)]  # q and v; k (1536:1792) has no LoRA
    B = [torch.randn(c.stop - c.start, r, device="cuda") * 0.05 for c in columns]
    scales = [2.0, 0.5]
    y = torch.randn(N, 2048, device="cuda", dtype=dtype)
    expected = y.float().clone()
    for a, b, c, s in zip(A, B, columns, scales):
        t = ((x.float() @ a.to(dtype).float().T) * s).to(dtype).float()
        expected[:, c] += t @ b.to(dtype).float().T
    t = triton_lora.lora_shrink(x, A)
    triton_lora.lora_expand_(y, t, B, columns, scales)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (y.float() - expected).abs().max() <= tol * expected.abs().max()
    I = 8960
    gate_up = torch.randn(N, 2 * I, device="cuda", dtype=dtype)
    Ag = [torch.randn(r, K, device="cuda") * 0.05 for _ in range(2)]
    Bg, Bu = (torch.randn(I, r, device="cuda") * 0.05 for _ in range(2))
    t2 = triton_lora.lora_shrink(x, Ag)
    fused = triton_lora.silu_and_mul_lora(gate_up, t2, Bg, Bu, 2.0, 2.0)
    plain = gate_up.clone()
    triton_lora.lora_expand_(plain, t2, [Bg, Bu], [slice(0, I), slice(I, 2 * I)], [2.0, 2.0])
    from tempering.engine.layers import activation

    assert (fused.float() - activation.silu_and_mul(plain).float()).abs().max() <= tol * 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [1, 37, 256])
def test_lora_deltas_fused_into_the_next_kernel_equal_expand_then_that_kernel(dtype, N):
    """add + RMSNorm with the o/down delta, and rotary + KV store with the q/k/v delta (k without LoRA),
    against `lora_expand_` followed by the plain kernel, reading x A^T from spare rows as the model does."""
    from tempering.engine.layers import triton_lora, triton_ops

    torch.manual_seed(0)
    H, r, heads, kv_heads, D, blocks, page = 1536, 8, 12, 2, 128, 16, 16
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    full = torch.randn(N, H + 8, device="cuda", dtype=dtype)  # the GEMM's output, x A^T in its spare rows
    y, t = full[:, :H], full[:, H:]
    B = torch.randn(H, r, device="cuda") * 0.05
    residual, weight = torch.randn(N, H, device="cuda", dtype=dtype), torch.rand(H, device="cuda").to(dtype)
    fused = triton_lora.add_rms_norm_lora(y, t, B.to(dtype).T.contiguous(), 2.0, residual, weight, 1e-6)
    expanded = y.clone()
    triton_lora.lora_expand_(expanded, t, [B], [slice(0, H)], [2.0])
    for a, b in zip(fused, triton_ops.add_rms_norm(expanded, residual, weight, 1e-6)):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    assert torch.equal(y, full[:, :H])  # the projection's output is left as it was

    width = (heads + 2 * kv_heads) * D
    qkv_full = torch.randn(N, width + 16, device="cuda", dtype=dtype)
    qkv, t = qkv_full[:, :width], qkv_full[:, width:]
    columns = [slice(0, heads * D), slice((heads + kv_heads) * D, width)]  # q and v
    Bs = [torch.randn(c.stop - c.start, r, device="cuda") * 0.05 for c in columns]
    cos, sin = (torch.randn(N, D, device="cuda", dtype=dtype) for _ in range(2))
    slots = torch.randperm(blocks * page, device="cuda")[:N]
    results = []
    for fuse in (True, False):
        x = qkv.clone()
        q, k, v = (x[:, a * D:b * D].view(N, b - a, D) for a, b in ((0, heads), (heads, heads + kv_heads),
                                                                      (heads + kv_heads, heads + 2 * kv_heads)))
        caches = [torch.full((blocks, page, kv_heads, D), float("nan"), device="cuda", dtype=dtype) for _ in range(2)]
        if fuse:
            slices = [(0, Bs[0].to(dtype).T.contiguous(), 2.0), None, (r, Bs[1].to(dtype).T.contiguous(), 0.5)]
            q = triton_lora.rotary_and_store_lora_(q, k, v, cos, sin, *caches, slots, t, slices, torch.empty_like(q))
        else:
            triton_lora.lora_expand_(x, t, Bs, columns, [2.0, 0.5])
            triton_ops.rotary_and_store_(q, k, v, cos, sin, *caches, slots)
        results.append((q, *caches))
    for a, b in zip(*results):
        written = ~torch.isnan(b)
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert (a[written].float() - b[written].float()).abs().max() <= tol * b[written].float().abs().max()


@pytest.mark.parametrize("N", [1, 37, 300])
def test_lora_kernels_round_a_float32_gemm_output_once_as_the_pytorch_twin_does(N):
    """With the base GEMM's float32 output (modeling/precision.py), each kernel adds the delta and
    rounds once to bf16: equal to engine.lora's PyTorch twin up to float32 summation order."""
    from tempering.engine import lora
    from tempering.engine.layers import triton_lora

    torch.manual_seed(0)
    H, r, I = 576, 8, 1536
    dt = torch.bfloat16
    y = torch.randn(N, H, device="cuda") * 4  # float32, unrounded
    t = torch.randn(N, r, device="cuda")
    B = torch.randn(H, r, device="cuda") * 0.05
    out = lora.expand(y, t, [B], [slice(0, H)], [2.0], dt)
    ref = lora._expand_reference(y, t, [B], [slice(0, H)], [2.0], dt)
    assert out.dtype == dt and (out.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()
    assert (out != ref).float().mean() < 0.01  # one rounding on both sides: rare flips only
    # the delta is not lost below half a bf16 spacing of y: rounding y first would keep y's bf16 value
    tiny_t = torch.full((N, r), 1e-3, device="cuda")
    kept = lora.expand(y, tiny_t, [B.abs()], [slice(0, H)], [1.0], dt)
    assert (kept != y.to(dt)).float().mean() > 0.01
    residual, weight = torch.randn(N, H, device="cuda", dtype=dt), torch.rand(H, device="cuda").to(dt)
    from tempering.engine.layers import triton_ops

    fused = triton_lora.add_rms_norm_lora(y, t, B.to(dt).T.contiguous(), 2.0, residual, weight, 1e-6)
    plain = triton_ops.add_rms_norm(out, residual, weight, 1e-6)
    for a, b in zip(fused, plain):
        assert a.dtype == dt and (a.float() - b.float()).abs().max() <= 2 ** -6 * b.float().abs().max()
    gate_up = torch.randn(N, 2 * I, device="cuda")
    Bg, Bu = (torch.randn(I, r, device="cuda") * 0.05 for _ in range(2))
    fused = triton_lora.silu_and_mul_lora(gate_up, t.repeat(1, 2), Bg, Bu, 2.0, 2.0, dtype=dt)
    expanded = lora._expand_reference(gate_up, t.repeat(1, 2), [Bg, Bu], [slice(0, I), slice(I, 2 * I)], [2.0, 2.0], dt)
    assert fused.dtype == dt
    assert (fused.float() - triton_ops.silu_and_mul(expanded).float()).abs().max() <= 2 ** -6 * fused.float().abs().max()


def test_lora_expand_leaves_columns_without_lora_untouched():
    from tempering.engine.layers import triton_lora

    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    A = [torch.randn(8, 256, device="cuda")]
    y = torch.randn(16, 640, device="cuda", dtype=torch.bfloat16)
    before = y.clone()
    triton_lora.lora_expand_(y, triton_lora.lora_shrink(x, A), [torch.randn(64, 8, device="cuda")], [slice(576, 640)], [1.0])
    assert torch.equal(y[:, :576], before[:, :576]) and not torch.equal(y[:, 576:], before[:, 576:])


def test_fused_sampler_with_grammar_bitmasks_draws_only_allowed_tokens():
    from tempering.engine.grammar.mask import unpack_bitmask
    from tempering.engine.layers.triton_sampler import gumbel_sample
    from tempering.engine.sampler import gumbel_sample_reference

    torch.manual_seed(0)
    B, V = 16, 151936
    logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
    temperature = torch.ones(B, device="cuda")
    seeds, counters = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.long, device="cuda")
    bits = torch.randint(-2**31, 2**31 - 1, (2, (V + 31) // 32), dtype=torch.int32, device="cuda")
    bits[1] = 0
    bits[1, 7] = 1 << 3  # row 1 of the masks allows only token 7 * 32 + 3
    index = torch.tensor([0, -1, 1] * 5 + [0], dtype=torch.int32, device="cuda")
    ids, lps, num_allowed = gumbel_sample(logits, temperature, seeds, counters, bits, index)
    allowed = torch.ones(B, V, dtype=torch.bool, device="cuda")
    unpacked = unpack_bitmask(bits, V)
    for b in range(B):
        if index[b] >= 0:
            allowed[b] = unpacked[index[b]]
    ref_ids, ref_lps = gumbel_sample_reference(logits, temperature, seeds, counters, allowed)
    assert allowed.gather(1, ids[:, None]).all()
    assert (ids == ref_ids).float().mean() > 0.9
    assert (ids[index == 1] == 7 * 32 + 3).all()
    assert (num_allowed[index >= 0] == allowed.sum(-1)[index >= 0]).all()
    full = torch.log_softmax(logits.float(), -1).gather(1, ids[:, None])[:, 0]
    assert (lps - full).abs().max() < 1e-3  # the logprob of the unmasked distribution


def test_grouped_matmul_gives_each_row_the_same_bits_whatever_its_experts_batch():
    """The batch-invariant experts' product (Qwen3-MoE in exact mode): a row alone with its expert,
    or among 300 rows over 16 experts (some with none), comes out bitwise the same, as the dense
    invariant product gives it, and close to each expert's F.linear."""
    from tempering.engine.layers.triton_matmul import grouped_matmul, matmul

    torch.manual_seed(0)
    E, N, K = 16, 96, 200
    weight = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([0, 37, 1, 0, 70, 5, 64, 65, 0, 3, 2, 20, 9, 11, 13, 0], device="cuda")
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), K, device="cuda", dtype=torch.bfloat16)
    y = grouped_matmul(x, weight, offsets)
    expert = torch.repeat_interleave(torch.arange(E, device="cuda"), counts)
    ref = torch.stack([F.linear(x[i].float(), weight[expert[i]].float()) for i in range(x.shape[0])])
    assert (y.float() - ref).abs().max() < 0.5  # bf16 outputs of sums of 200 products
    rows = slice(38, 108)  # expert 4's: the dense kernel with the same tiles sums them the same way
    assert torch.equal(matmul(x[rows], weight[4], config="64x64"), y[rows])
    for i in (0, 37, 38, 150, x.shape[0] - 1):
        alone = torch.zeros(E, dtype=torch.int32, device="cuda")
        alone[expert[i]:] = 1
        assert torch.equal(grouped_matmul(x[i:i + 1], weight, alone)[0], y[i])
