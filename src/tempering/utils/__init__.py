"""Helpers of ART's `art.utils`: `retry`, `iterate_dataset`, `limit_concurrency`, `get_trajectory_messages`."""

from .get_trajectory_messages import get_trajectory_messages
from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .retry import retry

__all__ = ["DatasetBatch", "get_trajectory_messages", "iterate_dataset", "limit_concurrency", "retry"]
