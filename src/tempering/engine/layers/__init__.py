"""Building blocks of the engine's decoder models."""

from .attention import paged_attention, store_kv
from .ops import ops_for
from .rotary import RotaryTable

__all__ = ["RotaryTable", "ops_for", "paged_attention", "store_kv"]
