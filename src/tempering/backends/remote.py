"""RemoteBackend: the same interface as LocalBackend, talking to a `tempering serve` process.

The agent code runs anywhere (a laptop, production); inference and training run on the server.
`model.openai_client()` points at the server's OpenAI routes. Requests are retried with
exponential backoff on transient failures (connection errors, 502/503/504); a request that is not
safe to repeat (a log row, a fork, a checkpoint deletion) only when it never reached the server.
A train call starts a job with a request id (a retry never trains twice) and follows its progress
events, reconnecting where it left off when the connection drops or the client's read timeout passes.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
import warnings
from typing import Any

import httpx

from ..errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    TemperingError,
    TrajectoryError,
    UnknownModelError,
    UnknownOptionError,
    UnsupportedOptionError,
)
from ..types import TrainConfig, TrainResult, TrainSFTConfig, TrajectoryGroup
from .art_mapping import (
    ArtOptionWarning,
    ModelOptions,
    apply_train_defaults,
    merge_lora,
    resolve_internal_config,
    train_config_from_options,
)
from .base import ModelClients, ModelRef, TrainableModelRef, check_awaited, report_nothing_learned

__all__ = ["RemoteBackend"]

_RETRY_STATUS = {502, 503, 504}
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the request never left the client
_ERRORS = {
    "TrajectoryError": TrajectoryError,
    "ConfigError": ConfigError,
    "UnknownModelError": UnknownModelError,
    "UnknownOptionError": UnknownOptionError,
    "UnsupportedOptionError": UnsupportedOptionError,
    "CheckpointError": CheckpointError,
    "ValidationError": ConfigError,
}


class RemoteBackend:
    """A backend on another machine, reached over HTTP.

    Args:
        base_url: the server's address, e.g. "http://gpu-box:8000".
        api_key: the server's key (`tempering serve --api-key`).
        timeout_s: read timeout of one HTTP request; a train call outlives it by reconnecting.
        max_retries: attempts after the first for a request that failed transiently.
        transport: an httpx transport (tests use `httpx.ASGITransport(app)` to call an app in-process).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.max_retries = max_retries
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
        )
        self._closed = False
        self._model_options: dict[str, ModelOptions] = {}
        self._clients = ModelClients()

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool and the models' OpenAI clients (the server and its models keep running)."""
        if not self._closed:
            self._closed = True
            await self._clients.close_all(self)
            await self._client.aclose()

    # ---- HTTP with retries --------------------------------------------------------------------

    async def _request(self, method: str, path: str, *, idempotent: bool | None = None, **kwargs: Any) -> Any:
        """Send a request, retrying transient failures; return the JSON body.

        `idempotent` (default: only for GET) says the request may be repeated. One that may not (a
        log row, a fork, a deletion) is retried only when it cannot have reached the server (the
        connection was never made); after that it fails rather than risk applying it twice.

        Raises:
            BackendError: the server stays unreachable, or a non-idempotent request failed after
                it may have been applied; other errors as `_decode`.
        """
        if self._closed:
            raise BackendError("this RemoteBackend is closed; create a new one")
        if idempotent is None:
            idempotent = method == "GET"
        for attempt in range(self.max_retries + 1):
            try:
                response = await self._client.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if not idempotent and not isinstance(exc, _NOT_SENT):
                    raise BackendError(
                        f"{method} {path} failed after it may have reached the tempering server at {self.base_url} "
                        f"({exc!r}); it is not retried since repeating it could apply it twice: check the model "
                        "(its history or checkpoints) before sending it again") from exc
                if attempt == self.max_retries:
                    raise BackendError(f"cannot reach the tempering server at {self.base_url}: {exc!r}") from exc
            else:
                if not idempotent or response.status_code not in _RETRY_STATUS or attempt == self.max_retries:
                    return _decode(response)
            await asyncio.sleep(min(0.5 * 2**attempt, 10.0) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    # ---- the Backend interface ----------------------------------------------------------------

    async def register(self, model: ModelRef) -> None:
        """Register `model` on the server (which loads it, or resumes it from its checkpoints).

        Of a model's ART `_internal_config`, the LoRA settings (`peft_args`), the step defaults
        (`trainer_args`) and dedicated mode (`trainer_gpu_ids`/`inference_gpu_ids`, checked
        against the server's GPUs) apply; engine settings are the server's (`tempering serve`),
        so `engine_args`/`init_args` options are ignored here with a warning.
        """
        trainable = getattr(model, "trainable", False)
        options = resolve_internal_config(getattr(model, "_internal_config", None))
        if options.engine or options.max_seq_len is not None or options.dtype is not None:
            warnings.warn("RemoteBackend: the server's engine settings apply; the engine_args/init_args of "
                          f"{model.name!r} (engine {sorted(options.engine)}, max_seq_len {options.max_seq_len}, "
                          f"dtype {options.dtype}) are ignored", ArtOptionWarning, stacklevel=2)
        self._model_options[model.name] = options
        lora = merge_lora(getattr(model, "lora_config", None), options)
        await self._request("POST", "/v1/register", idempotent=True, json={
            "name": model.name,
            "project": model.project,
            "base_model": model.base_model if trainable else None,
            "lora_config": lora.model_dump() if lora is not None else None,
            "model_json": model.model_dump(mode="json", exclude={"inference_api_key"}),
            **({"dedicated_gpus": options.num_gpus} if options.dedicated else {}),
        })
        self._clients.add(model)

    async def _prepare_backend_for_training(self, model: TrainableModelRef, config: Any = None) -> tuple[str, str]:
        return f"{self.base_url}/v1", self._api_key

    def _model_inference_name(self, model: ModelRef, step: int | None = None) -> str:
        return model.name if step is None else f"{model.name}@{step}"

    async def _get_step(self, model: TrainableModelRef) -> int:
        return int((await self._request("GET", f"/v1/models/{model.name}/step"))["step"])

    async def train(self, model: TrainableModelRef, trajectory_groups: list[TrajectoryGroup], **options: Any) -> TrainResult:
        """One RL step on the server, ART >= 0.5.18 style (options as LocalBackend.train; as ART's, it
        does not log the step: the caller's `model.log(groups, metrics=result.metrics,
        step=result.step, split="train")` does)."""
        result = await self._train_model(model, trajectory_groups, train_config_from_options(options), log_step=False)
        report_nothing_learned(result)
        return result

    async def _train_model(self, model: TrainableModelRef, trajectory_groups: list[TrajectoryGroup], config: TrainConfig,
                           on_event=None, log_step: bool = True) -> TrainResult:
        config = apply_train_defaults(config, self._model_options.get(model.name, ModelOptions()).train)
        groups = list(trajectory_groups)
        check_awaited(groups)
        job = await self._request("POST", f"/v1/models/{model.name}/train", idempotent=True, json={
            "request_id": uuid.uuid4().hex,
            "groups": [g.model_dump(mode="json") for g in groups],
            "config": config.model_dump(mode="json", exclude_unset=True),  # an explicit None (no clipping) is kept
            "log": log_step,
        })
        return await self._follow(job["job_id"], on_event)

    async def _train_sft(self, model: TrainableModelRef, trajectories: list, config: TrainSFTConfig, on_event=None) -> TrainResult:
        job = await self._request("POST", f"/v1/models/{model.name}/train_sft", idempotent=True, json={
            "request_id": uuid.uuid4().hex,
            "trajectories": [t.model_dump(mode="json") for t in trajectories],
            "config": config.model_dump(mode="json"),
        })
        return await self._follow(job["job_id"], on_event)

    async def _follow(self, job_id: str, on_event=None) -> TrainResult:
        """Read the job's events until it ends, reconnecting after the last event seen."""
        seen, failures = 0, 0
        while True:
            try:
                async with self._client.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": seen}) as response:
                    if response.status_code != 200:
                        _decode(response, body=await response.aread())
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        if event.get("type") == "heartbeat":
                            continue
                        seen = event["seq"] + 1
                        failures = 0
                        if on_event is not None and event["type"] not in ("finished", "failed"):
                            on_event(event)
                        if event["type"] == "finished":
                            return TrainResult.model_validate(event["result"])
                        if event["type"] == "failed":
                            error = event["error"]
                            raise _ERRORS.get(error["type"], TemperingError)(error["message"])
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                self._check_server()
                failures += 1
                if failures > self.max_retries:
                    raise BackendError(f"lost the training job {job_id} at {self.base_url}: {exc!r}") from exc
                await asyncio.sleep(min(0.5 * 2**failures, 10.0))

    def _check_server(self) -> None:
        """Raise BackendError when the server is known to be gone for good (no retry can help); here never."""

    async def _log(self, model: ModelRef, *, split: str, step: int, metrics: dict[str, float], groups: list[TrajectoryGroup]) -> None:
        await self._request("POST", f"/v1/models/{model.name}/log", json={
            "split": split, "step": step, "metrics": metrics, "groups": [g.model_dump(mode="json") for g in groups],
        })

    async def _read_history(self, model: ModelRef) -> list[dict[str, Any]]:
        return (await self._request("GET", f"/v1/models/{model.name}/history"))["rows"]

    async def _delete_checkpoint_files(self, model: TrainableModelRef, steps_to_keep: list[int]) -> list[int]:
        response = await self._request("POST", f"/v1/models/{model.name}/checkpoints/delete", json={"keep_steps": list(steps_to_keep)})
        return response["deleted"]

    async def list_checkpoints(self, model: ModelRef) -> list[dict[str, Any]]:
        """Saved steps of `model` with the metrics logged for them."""
        return (await self._request("GET", f"/v1/models/{model.name}/checkpoints"))["checkpoints"]

    async def fork_checkpoint(self, model: ModelRef, *, from_project: str, from_model: str, step: int | None = None,
                              not_after_step: int | None = None) -> int:
        """Copy a checkpoint of another model into `model` (before registering it); returns the step.

        `step` None: the latest one, at or before `not_after_step` if given."""
        response = await self._request("POST", f"/v1/models/{model.name}/fork", json={
            "project": model.project, "from_project": from_project, "from_model": from_model, "step": step,
            "not_after_step": not_after_step,
        })
        return int(response["step"])

    async def _experimental_fork_checkpoint(self, model: ModelRef, from_model: str, from_project: str | None = None,
                                            not_after_step: int | None = None, verbose: bool = False) -> int:
        """ART's name: fork the latest checkpoint of `from_model` (at or before `not_after_step`)."""
        return await self.fork_checkpoint(model, from_project=from_project or model.project, from_model=from_model,
                                          not_after_step=not_after_step)


def _decode(response: httpx.Response, body: bytes | None = None) -> Any:
    """The JSON body of a 2xx response; otherwise the matching tempering error with the server's message."""
    raw = body if body is not None else response.content
    try:
        data = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        data = {"error": {"message": raw.decode(errors="replace")[:500]}}
    if response.status_code < 300:
        return data
    message = (data.get("error") or {}).get("message") or str(data)
    status = response.status_code
    if status == 401:
        raise BackendError(f"the tempering server refused the API key: {message}")
    if status == 404:
        raise UnknownModelError(message)
    if status == 409:
        raise BackendError(f"HTTP 409: {message}")
    if status in (400, 413, 422):
        error = TrajectoryError if "trajector" in message.lower() else ConfigError
        raise error(f"HTTP {status}: {message}")
    raise BackendError(f"the tempering server answered HTTP {status}: {message}")
