"""Routes that add and remove the adapters an inference-only server serves (`tempering serve --adapter`).

They take vLLM's paths and bodies (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), so a client written for a
vLLM server with runtime LoRA updating works unchanged:

- `POST /v1/load_lora_adapter` `{"lora_name": "demo", "lora_path": "/path/to/adapter"}`: serve the
  adapter at `lora_path` (an exported adapter, a checkpoint, or a run directory's latest) as `lora_name`;
- `POST /v1/unload_lora_adapter` `{"lora_name": "demo"}`: stop serving it.

Like every route of the server they need its key. A path is read on the server's machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from .adapter_server import AdapterServer

__all__ = ["build_adapter_router"]


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)


def build_adapter_router(server: AdapterServer) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["adapters"])

    @router.post("/load_lora_adapter", summary="Serve a LoRA adapter under a name")
    async def load(body: LoadAdapterRequest) -> dict[str, Any]:
        loaded = await asyncio.to_thread(server.add_adapter, body.lora_name, body.lora_path)
        return {"object": "adapter", "name": loaded.name, "path": str(loaded.saved.adapter_dir),
                "step": loaded.saved.step}

    @router.post("/unload_lora_adapter", summary="Stop serving a LoRA adapter")
    async def unload(body: UnloadAdapterRequest) -> dict[str, Any]:
        await asyncio.to_thread(server.remove_adapter, body.lora_name)
        return {"object": "adapter", "name": body.lora_name, "deleted": True}

    @router.get("/adapters", summary="The served adapters: name, directory, step")
    async def adapters() -> dict[str, Any]:
        return {"object": "list", "data": server.adapters()}

    return router
