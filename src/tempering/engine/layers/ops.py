"""The elementwise ops of the decoder, per device: fused Triton kernels on CUDA, PyTorch elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import torch

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
)


def ops_for(device: torch.device) -> SimpleNamespace:
    """rms_norm, add_rms_norm, rotary_, rotary_and_store_ and silu_and_mul for tensors on `device`."""
    if device.type == "cuda":
        try:
            from . import triton_ops
        except ImportError:  # no Triton: the PyTorch versions work on CUDA too
            return TORCH_OPS
        return SimpleNamespace(
            rms_norm=triton_ops.rms_norm,
            add_rms_norm=triton_ops.add_rms_norm,
            rotary_=triton_ops.rotary_,
            rotary_and_store_=triton_ops.rotary_and_store_,
            silu_and_mul=triton_ops.silu_and_mul,
        )
    return TORCH_OPS
