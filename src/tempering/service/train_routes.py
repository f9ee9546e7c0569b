"""Training routes of a tempering server: register, train (as jobs), step, logs, checkpoints, fork.

Model names are global on a server (requests for inference name them), so routes take the name;
its project is the one it was registered with. Routes that touch files or wait for a training step
run their work in a thread: the event loop also serves inference.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import StreamingResponse

from ..storage import check_name
from .hub import ModelHub
from .jobs import TrainJobs
from .schemas import CheckpointDeleteRequest, ForkRequest, LogRequest, RegisterRequest, TrainRequest, TrainSFTRequest

__all__ = ["build_train_router"]


def build_train_router(hub: ModelHub, jobs: TrainJobs) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["training"])

    def project(name: str) -> str:
        check_name(name, what="model name")
        return hub.project_of(name)

    @router.post("/register", summary="Register a model (load a trainable one, resuming at its latest step)")
    async def register(body: RegisterRequest) -> dict[str, Any]:
        if body.dedicated_gpus is not None and body.base_model is not None:
            hub.check_dedicated_gpus(body.dedicated_gpus, body.name)
        step = await asyncio.to_thread(
            hub.register, name=body.name, project=body.project, model_json=body.model_json,
            base_model=body.base_model, lora=body.lora_config,
            dedicated=True if body.dedicated_gpus is not None else None,
        )
        return {"name": body.name, "project": body.project, "step": step, "trainable": body.base_model is not None}

    @router.get("/models/{name}/step", summary="The model's latest trained step")
    async def get_step(name: str) -> dict[str, int]:
        return {"step": await asyncio.to_thread(hub.step, project(name), name)}

    @router.post("/models/{name}/train", status_code=202, summary="Start one training step; read its events")
    async def train(name: str, body: TrainRequest) -> dict[str, Any]:
        project(name)
        groups, config, log = list(body.groups), body.config, body.log
        job = jobs.start(name, body.request_id, lambda on_event: hub.train(name, groups, config, on_event=on_event, log_step=log))
        return job.summary()

    @router.post("/models/{name}/train_sft", status_code=202, summary="Start a supervised fine-tuning call; read its events")
    async def train_sft(name: str, body: TrainSFTRequest) -> dict[str, Any]:
        project(name)
        trajectories, config = list(body.trajectories), body.config
        job = jobs.start(name, body.request_id, lambda on_event: hub.train_sft(name, trajectories, config, on_event=on_event))
        return job.summary()

    @router.get("/jobs/{job_id}", summary="A training job's status")
    async def job_status(job_id: str) -> dict[str, Any]:
        job = jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no training job {job_id!r} (jobs are kept while the server runs)")
        return job.summary()

    @router.get("/jobs/{job_id}/events", summary="A job's progress events as newline-delimited JSON, from `after` on")
    async def job_events(job_id: str, after: int = Query(default=0, ge=0)) -> StreamingResponse:
        job = jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no training job {job_id!r} (jobs are kept while the server runs)")
        return StreamingResponse(jobs.stream(job, after), media_type="application/x-ndjson")

    @router.post("/models/{name}/log", summary="Append a history row and store trajectories")
    async def log(name: str, body: LogRequest) -> dict[str, str]:
        await asyncio.to_thread(hub.log, project(name), name, split=body.split, step=body.step, metrics=body.metrics,
                                groups=list(body.groups))
        return {"status": "ok"}

    @router.get("/models/{name}/history", summary="The model's history.jsonl rows")
    async def history(name: str) -> dict[str, Any]:
        return {"rows": await asyncio.to_thread(hub.history, project(name), name)}

    @router.get("/models/{name}/checkpoints", summary="Saved steps with their logged metrics")
    async def checkpoints(name: str) -> dict[str, Any]:
        return {"checkpoints": await asyncio.to_thread(hub.checkpoints, project(name), name)}

    @router.post("/models/{name}/checkpoints/delete", summary="Delete every checkpoint but these steps and the latest")
    async def delete(name: str, body: CheckpointDeleteRequest) -> dict[str, Any]:
        # waits for a running training step of the model: in a thread, so that inference goes on
        return {"deleted": await asyncio.to_thread(hub.delete_checkpoints, project(name), name, body.keep_steps)}

    @router.post("/models/{name}/fork", summary="Copy another model's checkpoint into this (not yet registered) model")
    async def fork(name: str, body: ForkRequest) -> dict[str, int]:
        step = await asyncio.to_thread(
            hub.fork, project=body.project, name=name, from_project=body.from_project, from_name=body.from_model,
            step=body.step, not_after_step=body.not_after_step,
        )
        return {"step": step}

    return router
