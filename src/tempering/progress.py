"""A progress bar for training calls, fed by the backend's progress events."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

__all__ = ["TrainProgress"]


class TrainProgress:
    """tqdm over a step's optimizer updates, with the running loss.

    Use as a context manager and pass `on_event` to the backend; events are dicts with a "type"
    ("started", "update", "checkpoint").
    """

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.bar: Any = None

    def __enter__(self) -> TrainProgress:
        self.bar = tqdm(total=None, desc=self.desc, unit="update", dynamic_ncols=True, leave=False)
        return self

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "started" and event.get("num_updates"):
            self.bar.total = event["num_updates"]
            self.bar.refresh()
        elif kind == "update":
            if self.bar.total is None and event.get("num_updates"):
                self.bar.total = event["num_updates"]
            self.bar.set_postfix(loss=f"{event.get('loss', float('nan')):.4f}", refresh=False)
            self.bar.update(1)
        elif kind == "checkpoint":
            self.bar.set_postfix_str(f"saved step {event.get('step')}")

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
