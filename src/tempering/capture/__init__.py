"""Automatic trajectory capture: httpx transports that see each chat completion, and the
`capture_auto_trajectory` scope that records them into a Trajectory (client layer)."""

from .auto_trajectory import CaptureScope, auto_trajectory, capture_auto_trajectory, capture_scope, record_exchange
from .transport import (
    AsyncCaptureTransport,
    CaptureTransport,
    Exchange,
    capture_client,
    capturing_http_client,
    capturing_sync_http_client,
    listen,
)

__all__ = [
    "AsyncCaptureTransport",
    "CaptureScope",
    "CaptureTransport",
    "Exchange",
    "auto_trajectory",
    "capture_auto_trajectory",
    "capture_client",
    "capture_scope",
    "capturing_http_client",
    "capturing_sync_http_client",
    "listen",
    "record_exchange",
]
