"""Building blocks of the engine's decoder models."""

from .attention import paged_attention, store_kv
from .norm import rms_norm
from .rotary import RotaryTable, apply_rotary

__all__ = ["RotaryTable", "apply_rotary", "paged_attention", "rms_norm", "store_kv"]
