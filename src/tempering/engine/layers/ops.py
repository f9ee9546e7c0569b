"""The elementwise ops and matrix products of the decoder, per device: fused Triton kernels on CUDA,
PyTorch elsewhere; with `batch_invariant`, products whose rows do not depend on the batch."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ...modeling.precision import linear, linear_f32
from . import activation, norm, rotary
from .attention import store_kv

__all__ = ["ops_for"]


def rotary_and_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """Rotate q in place and k, then write k and v to their cache slots (the fused kernel's twin)."""
    rotary.rotary_(q, cos, sin)
    rotary.rotary_(k, cos, sin)
    store_kv(k_cache, v_cache, k, v, slot_mapping)


TORCH_OPS = SimpleNamespace(
    rms_norm=norm.rms_norm,
    add_rms_norm=norm.add_rms_norm,
    rotary_=rotary.rotary_,
    rotary_and_store_=rotary_and_store_,
    silu_and_mul=activation.silu_and_mul,
    linear=linear,  # [N, in] x [out, in] -> [N, out] in the model dtype
    linear_f32=linear_f32,  # the same, float32 and unrounded
    batch_invariant=False,
)


def ops_for(device: torch.device, *, batch_invariant: bool = False) -> SimpleNamespace:
    """rms_norm, add_rms_norm, rotary_, rotary_and_store_, silu_and_mul, linear and linear_f32 for
    tensors on `device`. `batch_invariant` (CUDA): the products through triton_matmul, whose rows
    come out the same whatever else is in the batch (the elementwise kernels already are), and
    `batch_invariant` set on the namespace for the LoRA kernels' fixed tiles. On CPU the flag has
    no effect (the PyTorch ops there are not promised to be batch-invariant).
    """
    if device.type == "cuda":
        try:
            from . import triton_matmul, triton_ops
        except ImportError:  # no Triton: the PyTorch versions work on CUDA too
            return TORCH_OPS
        ops = SimpleNamespace(
            rms_norm=triton_ops.rms_norm,
            add_rms_norm=triton_ops.add_rms_norm,
            rotary_=triton_ops.rotary_,
            rotary_and_store_=triton_ops.rotary_and_store_,
            silu_and_mul=triton_ops.silu_and_mul,
            linear=F.linear,
            linear_f32=linear_f32,
            batch_invariant=batch_invariant,
        )
        if batch_invariant:
            ops.linear = triton_matmul.matmul
            ops.linear_f32 = functools.partial(triton_matmul.matmul, out_dtype=torch.float32)
        return ops
    return TORCH_OPS
