"""An MCP agent's rollout: the model calls the server's tools until it calls `complete_task`.

Each turn appends the model's Choice (token ids and logprobs, so it is trained on) and one `tool`
message per call to the Trajectory, explicitly. The reward is left at 0 for a judge to set
(RULER: `gather_trajectory_groups(..., after_each=lambda g: ruler_score_group(g, judge, ...))`).

Bad input, decided so:
- a tool that fails or rejects its arguments (not JSON, not an object, not what its schema asks,
  an unknown tool) is answered with a `tool` message starting "Error:", as agents are usually
  built: the model sees the problem and can correct itself, the server keeps serving, and the
  trajectory counts it in `metrics["num_tool_errors"]`. With `raise_on_tool_error=True` the
  rollout instead raises MCPToolError;
- a server that dies (or stops answering) raises MCPConnectionError.
Either exception fails the rollout, which `gather_trajectory_groups(max_exceptions=...)` counts
and keeps in the group's `exceptions`.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import TemperingError
from ...types import Trajectory
from .connection import MCPConnection, ToolResult, connect
from .types import GeneratedScenario, complete_task_tool

__all__ = ["DEFAULT_SYSTEM_PROMPT", "MCPToolError", "rollout"]

DEFAULT_SYSTEM_PROMPT = """\
You are an agent that completes tasks with the tools of an MCP server. Use the tools to do the work. \
When the task is done, call complete_task once, by itself, with a summary of what you did and found. \
You have at most {max_turns} turns."""


class MCPToolError(TemperingError, RuntimeError):
    """A tool call failed or had invalid arguments, in a rollout run with `raise_on_tool_error=True`."""


async def rollout(
    model: Any,
    scenario: GeneratedScenario | str,
    server: MCPConnection | Any,
    *,
    max_turns: int = 5,
    max_tokens: int = 512,
    temperature: float = 1.0,
    tool_choice: str | dict[str, Any] = "auto",
    system_prompt: str | None = None,
    raise_on_tool_error: bool = False,
    max_tool_result_chars: int = 8000,
) -> Trajectory:
    """Run one episode of `model` on `scenario` against an MCP server.

    Args:
        model: an `art.Model` / `TrainableModel` with an endpoint (registered, or inference_base_url).
        scenario: a GeneratedScenario or the task's text.
        server: an open MCPConnection (shared by concurrent rollouts), or anything `connect()`
            takes, to connect for this rollout only.
        max_turns: model turns at most; then `metrics["ran_out_of_turns"]` is 1.
        tool_choice: sent on every turn; "required" makes every turn a call (a tempering server
            holds the call to the tool's schema), so the episode ends with complete_task or
            at max_turns.
        system_prompt: default DEFAULT_SYSTEM_PROMPT (`{max_turns}` is filled in).
        raise_on_tool_error: raise MCPToolError instead of answering a failed call with "Error: ...".
        max_tool_result_chars: a tool result longer than this is cut (and the cut marked).

    Returns:
        the Trajectory, reward 0, with metrics task_completed, ran_out_of_turns, num_turns,
        num_tool_calls, num_tool_errors, duration and metadata task (and difficulty).

    Raises:
        MCPConnectionError: the server could not be reached, died or timed out.
        MCPToolError: a call failed while `raise_on_tool_error`.
    """
    if not isinstance(server, MCPConnection):
        async with connect(server) as connection:
            return await rollout(model, scenario, connection, max_turns=max_turns, max_tokens=max_tokens,
                                 temperature=temperature, tool_choice=tool_choice, system_prompt=system_prompt,
                                 raise_on_tool_error=raise_on_tool_error, max_tool_result_chars=max_tool_result_chars)
    task = scenario.task if isinstance(scenario, GeneratedScenario) else str(scenario)
    metadata: dict[str, Any] = {"task": task}
    if isinstance(scenario, GeneratedScenario):
        metadata["difficulty"] = scenario.difficulty
    tools = [t.to_tool_schema() for t in await server.list_tools()] + [complete_task_tool.to_tool_schema()]
    prompt = (system_prompt or DEFAULT_SYSTEM_PROMPT).replace("{max_turns}", str(max_turns))
    traj = Trajectory(messages_and_choices=[{"role": "system", "content": prompt}, {"role": "user", "content": task}],
                      tools=tools, metadata=metadata)
    client = model.openai_client()
    num_calls = num_errors = num_turns = 0
    completed = False
    while num_turns < max_turns and not completed:
        num_turns += 1
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=traj.messages(), tools=tools, tool_choice=tool_choice,
            max_tokens=max_tokens, temperature=temperature)
        choice = completion.choices[0]
        traj.messages_and_choices.append(choice)
        calls = choice.message.tool_calls or []
        if not calls:  # the agent answered in words: the episode is over
            break
        for call in calls:
            num_calls += 1
            if call.function.name == complete_task_tool.name:
                completed = True
                result = ToolResult("Task marked complete.", False)
                traj.log(f"complete_task: {call.function.arguments}")
            else:
                result = await _call(server, call.function.name, call.function.arguments)
            if result.is_error:
                num_errors += 1
                traj.log(f"tool {call.function.name!r} failed: {result.text[:300]}")
                if raise_on_tool_error:
                    raise MCPToolError(f"tool {call.function.name!r} called with {call.function.arguments[:200]!r} "
                                       f"failed: {result.text[:500]}")
            text = result.text
            if len(text) > max_tool_result_chars:
                text = text[:max_tool_result_chars] + f"\n[cut: {len(result.text) - max_tool_result_chars} more characters]"
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": text})
    traj.metrics.update({
        "task_completed": float(completed),
        "ran_out_of_turns": float(not completed and num_turns >= max_turns),
        "num_turns": num_turns,
        "num_tool_calls": num_calls,
        "num_tool_errors": num_errors,
    })
    return traj.finish()


async def _call(server: MCPConnection, name: str, arguments: str | None) -> ToolResult:
    """Call a tool with the model's arguments text; arguments that are not a JSON object are a tool error."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return ToolResult(f"Error: the arguments are not valid JSON ({exc}); send a JSON object.", True)
    if not isinstance(parsed, dict):
        return ToolResult("Error: the arguments must be a JSON object.", True)
    return await server.call_tool(name, parsed)
