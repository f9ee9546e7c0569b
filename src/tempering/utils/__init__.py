"""Helpers of ART's `art.utils`: `retry`, `iterate_dataset`, `limit_concurrency`, `get_trajectory_messages`,
`format_message`, `log_http_errors`, `get_model_step` and `init_weave_with_wandb`."""

from .format_message import format_message
from .get_model_step import get_model_step
from .get_trajectory_messages import get_trajectory_messages
from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .log_http_errors import log_http_errors
from .retry import retry
from .weave_integration import init_weave_with_wandb

__all__ = [
    "DatasetBatch",
    "format_message",
    "get_model_step",
    "get_trajectory_messages",
    "init_weave_with_wandb",
    "iterate_dataset",
    "limit_concurrency",
    "log_http_errors",
    "retry",
]
