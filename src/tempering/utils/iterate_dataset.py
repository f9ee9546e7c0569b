"""`iterate_dataset`: a dataset in shuffled batches of scenarios, epoch after epoch (ART's helper)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tqdm.auto import tqdm

__all__ = ["DatasetBatch", "iterate_dataset"]

T = TypeVar("T")


@dataclass(slots=True)
class DatasetBatch(Generic[T]):
    """One training step's scenarios.

    Attributes:
        items: the scenarios of this step (`groups_per_step` of them; fewer at an epoch's end).
        step: the global step, counted from 0 over all epochs.
        epoch: the epoch, from 0.
        epoch_step: the step within the epoch, from 0.

    Unpacks as ART's older tuple: `for items, epoch, step, epoch_step in iterate_dataset(...)`.
    """

    items: list[T]
    step: int
    epoch: int
    epoch_step: int

    def __iter__(self) -> Iterator[Any]:
        return iter((self.items, self.epoch, self.step, self.epoch_step))


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
) -> Iterator[DatasetBatch[T]]:
    """Yield `dataset` in batches of `groups_per_step` items, shuffled anew each epoch.

    Epoch e is shuffled with `random.Random(e)`, so the order depends only on the epoch and a
    resumed run (`initial_step=await model.get_step()`) sees the batches it would have seen;
    the global `random` state is left alone. Steps before `initial_step` are skipped. A tqdm
    bar counts steps out of ceil(len / groups_per_step) × num_epochs.

    Args:
        dataset: the scenarios (anything indexable with a length).
        groups_per_step: scenarios per step (one TrajectoryGroup each), >= 1.
        num_epochs: passes over the dataset, >= 0.
        initial_step: the first global step to yield, >= 0.
        use_tqdm: show the progress bar.

    Raises:
        ValueError: for groups_per_step < 1, num_epochs < 0 or initial_step < 0.
    """
    if groups_per_step < 1 or num_epochs < 0 or initial_step < 0:
        raise ValueError(f"iterate_dataset needs groups_per_step >= 1, num_epochs >= 0, initial_step >= 0; got "
                         f"{groups_per_step}, {num_epochs}, {initial_step}")
    size = len(dataset)
    if size == 0:
        return
    steps_per_epoch = math.ceil(size / groups_per_step)
    total = steps_per_epoch * num_epochs
    bar = tqdm(initial=min(initial_step, total), total=total, desc="Iterating dataset", unit="batch") if use_tqdm else None
    try:
        for epoch in range(num_epochs):
            if (epoch + 1) * steps_per_epoch <= initial_step:
                continue
            order = list(range(size))
            random.Random(epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                chunk = order[epoch_step * groups_per_step:(epoch_step + 1) * groups_per_step]
                yield DatasetBatch(items=[dataset[i] for i in chunk], step=step, epoch=epoch, epoch_step=epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
