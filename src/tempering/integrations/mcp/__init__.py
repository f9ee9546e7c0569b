"""MCP•RL: train an agent to use an MCP server's tools (ART's `art.mcp`; import it as `tempering.mcp`).

    async with tempering.mcp.connect(["python", "server.py"]) as server:      # stdio; or a URL
        scenarios = await tempering.mcp.generate_scenarios(await server.list_tools(), ...)
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(tempering.mcp.rollout(model, s, server) for _ in range(4)) for s in scenarios),
            after_each=lambda g: ruler_score_group(g, judge, client=...))
        await model.train(groups)

Needs the MCP SDK 2.x: `pip install "tempering[mcp]"`.
"""

from __future__ import annotations

from importlib import metadata

from ...errors import MissingDependencyError

_INSTALL = 'pip install "tempering[mcp]"'


def _check_sdk() -> None:
    try:
        version = metadata.version("mcp")
    except metadata.PackageNotFoundError:
        version = None
    try:
        import mcp  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(f"tempering.mcp needs the MCP Python SDK: {_INSTALL}") from exc
    if version is not None and int(version.split(".")[0]) < 2:
        raise MissingDependencyError(f"tempering.mcp needs the MCP Python SDK 2.x, found mcp {version}: {_INSTALL}")


_check_sdk()

from .connection import MCPConnection, MCPConnectionError, ToolResult, connect
from .rollout import DEFAULT_SYSTEM_PROMPT, MCPToolError, rollout
from .scenarios import generate_scenarios
from .types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool, complete_task_tool

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "GeneratedScenario",
    "GeneratedScenarioCollection",
    "MCPConnection",
    "MCPConnectionError",
    "MCPResource",
    "MCPTool",
    "MCPToolError",
    "ToolResult",
    "complete_task_tool",
    "connect",
    "generate_scenarios",
    "rollout",
]
