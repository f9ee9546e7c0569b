"""Where the engine and the trainer round: one contract, so both compute the same function.

Both sides run the model in its dtype (bfloat16 on a GPU above 0.5B parameters) and round exactly where Hugging
Face's modules round (RMSNorm, rotary, SwiGLU, residual adds), except in two places where
rounding to bfloat16 throws away what RL needs:

- **The logits.** A logit of 20 has a bfloat16 spacing of 0.125, so a bfloat16 LM head moves
  every logprob by up to ~0.06 nats. Both sides take the LM head's product in float32
  (bfloat16 inputs, float32 accumulation and output: `linear_f32`).
- **A LoRA projection.** `y = x W^T + s (x A^T) B^T` is rounded once, after the delta is added
  to the float32 accumulation of `x W^T`. Rounding `x W^T` first and then adding the delta
  loses every part of the delta below half a bfloat16 spacing of y (0.2% of |y|): the early,
  small adapter that RL trains would be partly invisible to the sampler, and the engine would
  sample from a policy nearer the base model than the one the trainer scores. `x A^T` is
  accumulated in float32 and rounded to the model dtype after scaling, `round(s · x A^T)`, as
  the delta's input.

Under tensor parallelism (modeling/tensor_parallel.py) both sides round where one device rounds:
a row-parallel projection (o, down) gives each rank a partial sum of its input columns in float32;
x A^T is summed over the ranks before `round(s · x A^T)`, the leader alone adds the delta, and the
float32 partial outputs are summed by one all-reduce before the one rounding. Column-parallel
projections round exactly as on one device. So the engine and the trainer still compute the same
function as each other; against one device the float32 sums differ only by their order (on CPU
processes in bfloat16 the split is bitwise one process).

References: on the precision a sampler/trainer pair needs, "Defeating Nondeterminism in LLM
Inference" (Thinking Machines, 2025) and "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (Yao et al., 2025).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear", "linear_f32"]

# On a CPU, MKL runs a product of a few rows (a decode step's) with a large weight faster as W x^T,
# transposed back, than as x W^T: the default model's decode steps with the live adapter, 2-core AMD
# EPYC, torch 2.13, 1.65x at 1 row (padded to 2), 2.58x at 2, 1.82x at 4, 1.1-1.2x at 8-32, even at
# 64 (benchmarks/cpu_decode.py); the products alone were about even at 128 rows and slower at 1,024.
SKINNY_ROWS = 64


def _is_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= SKINNY_ROWS
            and x.dtype == weight.dtype == torch.float32)


def _skinny_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T taken as (W x^T)^T: [N, out], a transposed view. One row is padded with a zero row:
    MKL takes a one-column product on one thread and a two-column one on all of them."""
    if x.shape[0] == 1:
        padded = x.new_zeros(2, x.shape[1])
        padded[0] = x[0]
        return torch.mm(weight, padded.t())[:, :1].t()
    return torch.mm(weight, x.t()).t()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`: x [N, in] x weight [out, in] (+ bias [out]) -> [N, out] contiguous, in x's dtype.
    A float32 CPU product of at most SKINNY_ROWS rows is taken as (W x^T)^T: the same products,
    summed by MKL in another order (float32 rounding apart, the same values)."""
    if not _is_skinny(x, weight):
        return F.linear(x, weight, bias)
    y = _skinny_mm(x, weight).contiguous()
    return y if bias is None else y.add_(bias)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) accumulated and returned in float32, whatever the inputs' dtype.

    Args:
        x: [N, in] (any float dtype; rows may be strided, the last dim contiguous).
        weight: [out, in] (x's dtype).
        bias: [out] or None.
        out: a contiguous float32 [N, out] tensor to write the product into (returned), or None.

    Returns:
        [N, out] float32. On CUDA a bfloat16/float16 product runs in cuBLAS with a float32 output
        (`torch.mm(..., out_dtype=torch.float32)`), the same products and accumulation as the
        model-dtype GEMM without its final rounding; elsewhere the inputs are widened to float32
        (exact products, float32 sums).
    """
    if x.dtype == torch.float32 and out is None:
        return linear(x, weight, bias)
    if out is not None and _is_skinny(x, weight):
        out.copy_(_skinny_mm(x, weight))
        return out if bias is None else out.add_(bias)
    into = {"out": out} if out is not None else {}
    if x.dtype == torch.float32:
        y = torch.mm(x, weight.T, **into)
    elif x.is_cuda:
        y = torch.mm(x, weight.T, out_dtype=torch.float32, **into)
    else:
        y = torch.matmul(x.float(), weight.float().T, **into)
    if bias is not None:
        y += bias.float()
    return y
