"""Training jobs of a server: one running step per model, progress as a resumable event log.

`POST .../train` starts a job in a thread and returns at once; the client then reads the job's
events (`GET /v1/jobs/{id}/events?after=N`, newline-delimited JSON). The job runs to its end
whether or not anybody listens, so a client that times out or is killed just reconnects (or a new
client asks for the step), and the checkpoint is written atomically either way. A request id
makes a retried POST return the job it already started instead of training twice.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import TemperingError
from .hub import ModelHub

__all__ = ["TrainJob", "TrainJobs", "TrainingConflict"]


class TrainingConflict(TemperingError):
    """A training step of this model is already running (HTTP 409)."""


class TrainJob:
    def __init__(self, model_name: str, request_id: str) -> None:
        self.id = "job-" + uuid.uuid4().hex
        self.model_name = model_name
        self.request_id = request_id
        self.status = "running"
        self.events: list[dict[str, Any]] = []
        self.cond = threading.Condition()

    def add(self, event: dict[str, Any]) -> None:
        with self.cond:
            self.events.append({"seq": len(self.events), "time": time.time(), **event})
            self.cond.notify_all()

    def end(self, status: str, event: dict[str, Any]) -> None:
        with self.cond:
            self.events.append({"seq": len(self.events), "time": time.time(), **event})
            self.status = status
            self.cond.notify_all()

    def wait(self, seen: int, timeout_s: float) -> None:
        with self.cond:
            if len(self.events) <= seen and self.status == "running":
                self.cond.wait(timeout_s)

    def summary(self) -> dict[str, Any]:
        return {"job_id": self.id, "model": self.model_name, "status": self.status, "num_events": len(self.events)}


class TrainJobs:
    """Jobs of one hub; keeps the last `history` finished jobs for clients that come back."""

    def __init__(self, hub: ModelHub, history: int = 256) -> None:
        self.hub = hub
        self.history = history
        self._jobs: OrderedDict[str, TrainJob] = OrderedDict()
        self._by_request: dict[str, str] = {}
        self._lock = threading.Lock()

    def start(self, name: str, request_id: str, work: Callable[[Callable[[dict], None]], Any]) -> TrainJob:
        """Run `work(on_event)` (a training call of `name` returning a TrainResult) as a job, or return
        the job this request id already started.

        Raises:
            TrainingConflict: if another step of this model is running.
            UnknownModelError: if the model is not registered for training.
        """
        self.hub.service(name)
        with self._lock:
            existing = self._by_request.get(request_id)
            if existing is not None and existing in self._jobs:
                return self._jobs[existing]
            running = [j for j in self._jobs.values() if j.model_name == name and j.status == "running"]
            if running:
                raise TrainingConflict(
                    f"a training step of {name!r} is already running ({running[0].id}); wait for it to finish"
                )
            job = TrainJob(name, request_id)
            self._jobs[job.id] = job
            self._by_request[request_id] = job.id
            while len(self._jobs) > self.history:
                old_id, old = next(iter(self._jobs.items()))
                if old.status == "running":
                    break
                del self._jobs[old_id]
                self._by_request.pop(old.request_id, None)
        self.hub.submit_training(self._run, job, work)
        return job

    def get(self, job_id: str) -> TrainJob | None:
        return self._jobs.get(job_id)

    def _run(self, job: TrainJob, work: Callable[[Callable[[dict], None]], Any]) -> None:
        try:
            result = work(job.add)
        except BaseException as exc:  # reported to the client as an event, never a dead server
            # (nor a job left "running", which would refuse every later step of the model with a 409)
            job.end("failed", {"type": "failed", "error": {"type": type(exc).__name__, "message": str(exc)}})
            if not isinstance(exc, Exception):
                raise
            return
        job.end("finished", {"type": "finished", "result": result.model_dump(mode="json")})

    async def stream(self, job: TrainJob, after: int, heartbeat_s: float = 10.0) -> AsyncIterator[str]:
        """Events from index `after` on, one JSON object per line, until the job has ended."""
        seen = after
        while True:
            for event in job.events[seen:]:
                yield json.dumps(event) + "\n"
            seen = max(seen, len(job.events))
            if job.status != "running" and seen >= len(job.events):
                return
            before = len(job.events)
            await asyncio.to_thread(job.wait, seen, heartbeat_s)
            if len(job.events) == before and job.status == "running":
                yield json.dumps({"type": "heartbeat", "time": time.time()}) + "\n"
