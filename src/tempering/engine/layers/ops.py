"""The elementwise ops of the decoder, per device: fused Triton kernels on CUDA, PyTorch elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import activation, norm, rotary

__all__ = ["ops_for"]

TORCH_OPS = SimpleNamespace(
    rms_norm=norm.rms_norm,
    add_rms_norm=norm.add_rms_norm,
    rotary_=rotary.rotary_,
    silu_and_mul=activation.silu_and_mul,
)


def ops_for(device: torch.device) -> SimpleNamespace:
    """rms_norm, add_rms_norm, rotary_ and silu_and_mul for tensors on `device`."""
    if device.type == "cuda":
        try:
            from . import triton_ops
        except ImportError:  # no Triton: the PyTorch versions work on CUDA too
            return TORCH_OPS
        return SimpleNamespace(
            rms_norm=triton_ops.rms_norm,
            add_rms_norm=triton_ops.add_rms_norm,
            rotary_=triton_ops.rotary_,
            silu_and_mul=triton_ops.silu_and_mul,
        )
    return TORCH_OPS
