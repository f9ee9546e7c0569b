"""Logprobs of chosen tokens from hidden states, in chunks, never materializing all logits.

The LM head turns N hidden states into an [N, V] logits matrix (V = 49,152 for SmolLM2, 151,936
for Qwen): 16 × 1024 tokens of fp32 Qwen logits are 10 GB, plus as much again for the softmax's
backward. Here each chunk of `chunk_size` rows computes its logits, the target's log-softmax and
the entropy (from float32 logits, as the engine samples them: modeling/precision.py), and right
away the gradient of the logprob with respect to its hidden state,
d logprob / d h = ((onehot - softmax) / T) @ W, an [N, H] tensor. Only one chunk's logits exist at
a time, and the backward pass only scales the stored gradient by the upstream one (the chain
rule holds for any loss built on the logprobs), so the LM head is never run a second time. The
LM head itself is frozen (LoRA). This is the trick of fused linear cross-entropy losses (as in
Liger-Kernel, Hsu et al. 2024, arXiv 2410.10989), applied to per-token logprobs.
"""

from __future__ import annotations

import torch

from ..modeling.precision import linear_f32
from .kernels import ops_for

__all__ = ["selective_logprobs"]


class _SelectiveLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temperature, chunk_size, need_grad):
        epilogue = ops_for(hidden.device).logprob_epilogue
        N = hidden.shape[0]
        logprobs = torch.empty(N, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(N, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        for start in range(0, N, chunk_size):
            end = min(start + chunk_size, N)
            logits = linear_f32(hidden[start:end], weight)  # [n, V] float32 (modeling/precision.py)
            lp, ent, grad = epilogue(logits, targets[start:end], inv_temperature[start:end], need_grad)
            logprobs[start:end] = lp
            entropy[start:end] = ent
            if need_grad:
                torch.matmul(grad.to(weight.dtype), weight, out=grad_hidden[start:end])
            del logits, grad
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(grad_hidden)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        (grad_hidden,) = ctx.saved_tensors
        grad = (grad_hidden.float() * grad_logprobs[:, None]).to(grad_hidden.dtype)
        return grad, None, None, None, None, None


def selective_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    *,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ W.T / T)[target] for each row, and the entropy of that distribution.

    Args:
        hidden: [N, H] final hidden states (after the last norm) at the positions that predict.
        lm_head_weight: [V, H] output embedding (frozen: it gets no gradient).
        targets: [N] int64 ids whose logprobs are wanted.
        temperature: [N] float, the temperature of each row's distribution.
        chunk_size: rows per chunk; peak memory is about chunk_size × V × 4 bytes × 3 (CPU) or
            chunk_size × V × 4 bytes (CUDA, fused kernel: the float32 logits, overwritten by their gradient).

    Returns:
        (logprobs [N] float32, differentiable in `hidden`; entropy [N] float32 in nats, detached).

    Raises:
        ValueError: if the LM head requires a gradient (train it with a different path).
    """
    if lm_head_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("selective_logprobs treats the LM head as frozen; it cannot train lm_head")
    inv_temperature = (1.0 / temperature).to(torch.float32)
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _SelectiveLogprobs.apply(hidden, lm_head_weight.detach(), targets, inv_temperature, chunk_size, need_grad)
