"""How a choice's routed experts travel in JSON (`choice.routed_experts`), and back.

A mixture-of-experts sample's routing is [P + C - 1, L_moe, k] small integers: the experts each
token of prompt + completion but the last was routed to in each MoE layer (the last sampled
token was never an input). As JSON lists that is ~15 bytes per id; as base64 of the raw bytes it
is 1.33 bytes per id (uint8 up to 256 experts), so a 1,000-token Qwen3-30B-A3B sample carries
~0.5 MB instead of ~6 MB:

    {"dtype": "uint8", "shape": [n, layers, k], "data": "<base64 of the C-order bytes>"}

The same layout as vLLM's and SGLang's `routed_experts` ([tokens - 1, layers, k]).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

__all__ = ["decode_routed_experts", "encode_routed_experts"]

_DTYPES = {"uint8": np.uint8, "int16": np.int16}


def encode_routed_experts(ids: np.ndarray) -> dict[str, Any]:
    """[n, L, k] uint8/int16 array → the JSON object above."""
    ids = np.ascontiguousarray(ids)
    if ids.dtype.name not in _DTYPES or ids.ndim != 3:
        raise ValueError(f"routed experts must be a [n, layers, k] uint8 or int16 array, got {ids.dtype} {ids.shape}")
    data = ids.astype(ids.dtype.newbyteorder("<"), copy=False).tobytes()  # little-endian on any host
    return {"dtype": ids.dtype.name, "shape": list(ids.shape), "data": base64.b64encode(data).decode()}


def decode_routed_experts(value: Any) -> np.ndarray:
    """The JSON object above (or a nested [n][L][k] list) → [n, L, k] int16 array.

    Raises:
        ValueError: if it is malformed.
    """
    if isinstance(value, dict):
        try:
            dtype = np.dtype(_DTYPES[value["dtype"]]).newbyteorder("<")
            shape = tuple(int(s) for s in value["shape"])
            ids = np.frombuffer(base64.b64decode(value["data"]), dtype=dtype)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed routed_experts: {exc}") from exc
        if len(shape) != 3 or ids.size != int(np.prod(shape)):
            raise ValueError(f"routed_experts holds {ids.size} ids, not the {shape} it declares")
        return ids.reshape(shape).astype(np.int16)
    ids = np.asarray(value, dtype=np.int16)
    if ids.ndim != 3:
        raise ValueError(f"routed_experts must be [tokens][layers][k], got shape {ids.shape}")
    return ids
