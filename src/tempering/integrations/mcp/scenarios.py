"""`generate_scenarios`: tasks for an agent, written by a model from an MCP server's tools and resources.

Same name, positional arguments and defaults as ART's `art.mcp.generate_scenarios`; the generator is
any OpenAI-compatible endpoint (OpenRouter by default, as in ART, or `generator_client=`, e.g. a
tempering model's `model.openai_client()`, or its `inference_base_url` and `inference_api_key`).
The answer's JSON schema is sent as `response_format` (integrations/generation.py says when), so a
model served by tempering, however small, returns exactly `num_scenarios` well-formed scenarios,
each task at most `TEMPERING_TASK_CHARS` characters unless `max_task_chars` says otherwise. The
prompt is ours.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError
from ..generation import generate_items, make_client, resolve_budget
from .types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

__all__ = ["TEMPERING_TASK_CHARS", "generate_scenarios"]

TEMPERING_TASK_CHARS = 200
"""Each task's length bound when a tempering server writes the scenarios and `max_task_chars` is
not given: a task of two or three sentences. With it the default model on a shared 2-core CPU
wrote 4 scenarios in 9-17 s (three runs) and ART's default 24 in 66 s; with no bound and ART's
8,000 tokens, it once wrote inside one task's string for 13 minutes."""

_PROMPT = """\
You write test tasks for an AI agent that works through the tools of an MCP (Model Context Protocol) server.

Tools:
{tools}

Resources:
{resources}

Write {n} different, realistic tasks that a user could ask this agent to do with these tools. Vary them: \
some need one tool call, some need several steps. Do not name the tools in the task.{bound} Rate each task's \
difficulty from 1 (one tool call) to 5 (long, multi-step work).

Answer with a JSON object {{"scenarios": [{{"task": "...", "difficulty": 1}}, ...]}} with exactly {n} entries."""


def _tool_info(tool: Any) -> dict[str, Any]:
    if isinstance(tool, MCPTool):
        return tool.to_dict()
    if isinstance(tool, dict):
        return MCPTool.from_dict(tool).to_dict()
    return MCPTool.from_mcp(tool).to_dict()  # an mcp.types.Tool


def _resource_info(resource: Any) -> dict[str, Any]:
    if isinstance(resource, MCPResource):
        return resource.to_dict()
    if isinstance(resource, dict):
        return MCPResource.from_dict(resource).to_dict()
    return MCPResource.from_mcp(resource).to_dict()  # an mcp.types.Resource


async def generate_scenarios(
    tools: Sequence[Any] | Any,
    resources: Sequence[Any] | Any = (),
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str = "openai/gpt-4.1-mini",
    generator_api_key: str | None = None,
    generator_base_url: str = "https://openrouter.ai/api/v1",
    *,
    generator_client: Any = None,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    structured: bool | None = None,
    max_task_chars: int | None = None,
    max_attempts: int = 3,
) -> GeneratedScenarioCollection:
    """Have a model write `num_scenarios` tasks that exercise an MCP server's tools.

    Args:
        tools: `MCPTool`s, dicts (`name`, `description`, `parameters`), `mcp.types.Tool`s, or a
            `ListToolsResult` (what `list_tools()` returns).
        resources: likewise `MCPResource`s, dicts, `mcp.types.Resource`s or a `ListResourcesResult`.
        generator_model: the model name at the endpoint.
        generator_api_key: the endpoint's key; default the `OPENROUTER_API_KEY` environment variable.
        generator_client: an `openai.AsyncOpenAI` to use instead of `generator_base_url` / key,
            e.g. `model.openai_client()` of a tempering model (then `generator_model=model.name`).
        max_tokens: the answer's token budget per request. None: 8000 (ART's) for an external
            API; for a tempering server, room for `num_scenarios` tasks of `max_task_chars`.
        structured: send the answer's JSON schema as `response_format` (True), never (False), or
            unless the endpoint is a tempering server without structured outputs (None).
        max_task_chars: bound each task's length in the schema. None: unbounded for an external
            API, `TEMPERING_TASK_CHARS` (200) for a tempering server.
        max_attempts: requests made at most, each asking for the scenarios still missing.

    Returns:
        exactly `num_scenarios` scenarios.

    Raises:
        ConfigError (a ValueError): with neither tools nor resources, or no client and no API key.
        GenerationError (a ValueError): if `max_attempts` answers held too few valid scenarios.
        RequestTimeout (a TimeoutError): a request got no answer within the client's timeout
            (openai's default: 600 s); the message names the request and the arguments to change.
    """
    tools = list(getattr(tools, "tools", tools) or [])
    resources = list(getattr(resources, "resources", resources) or [])
    if not tools and not resources:
        raise ConfigError("generate_scenarios needs at least one tool or resource to write tasks about")
    start = time.perf_counter()
    client = make_client(generator_client, generator_base_url, generator_api_key or os.environ.get("OPENROUTER_API_KEY"),
                         who="generate_scenarios")
    tools_text = json.dumps([_tool_info(t) for t in tools], indent=1)
    resources_text = json.dumps([_resource_info(r) for r in resources], indent=1) if resources else "(none)"
    extra = f"\n\nAlso follow these instructions:\n{custom_instructions}" if custom_instructions else ""

    budget = await resolve_budget(client, num_items=num_scenarios, max_tokens=max_tokens, max_item_chars=max_task_chars,
                                  structured=structured, tempering_item_chars=TEMPERING_TASK_CHARS)
    bound = f" Keep each task under {budget.max_item_chars} characters." if budget.max_item_chars is not None else ""

    def prompt(n: int) -> str:
        return _PROMPT.format(tools=tools_text, resources=resources_text, n=n, bound=bound) + extra

    task: dict[str, Any] = {"type": "string", "minLength": 1}
    if budget.max_item_chars is not None:
        task["maxLength"] = budget.max_item_chars
    item_schema = {"type": "object", "properties": {"task": task, "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["task", "difficulty"], "additionalProperties": False}
    scenarios = await generate_items(
        client=budget.client, model=generator_model, prompt=prompt, key="scenarios", item_schema=item_schema,
        num_items=num_scenarios, check_item=lambda raw: GeneratedScenario.from_dict(raw), max_tokens=budget.max_tokens,
        temperature=temperature, structured=budget.structured, max_attempts=max_attempts, schema_name="scenario_list",
        who="generate_scenarios", fix="pass a smaller max_tokens or max_task_chars (each task's length), or fewer "
                                    "num_scenarios; or a generator_client with a longer timeout")
    collection = GeneratedScenarioCollection(scenarios)
    if show_preview:
        print(f"Generated {len(collection)} scenarios with {generator_model} in {time.perf_counter() - start:.1f} s")
        collection.print_difficulty_distribution()
        collection.preview(n=min(5, len(collection)))
    return collection
