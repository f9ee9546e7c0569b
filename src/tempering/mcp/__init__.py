"""`tempering.mcp`, where ART has `art.mcp`: MCP•RL (the code is in tempering/integrations/mcp/).

Needs the MCP SDK 2.x (`pip install "tempering[mcp]"`); without it, importing this module raises
MissingDependencyError naming that command.
"""

from ..integrations.mcp import (
    DEFAULT_SYSTEM_PROMPT,
    GeneratedScenario,
    GeneratedScenarioCollection,
    MCPConnection,
    MCPConnectionError,
    MCPResource,
    MCPTool,
    MCPToolError,
    ToolResult,
    complete_task_tool,
    connect,
    generate_scenarios,
    rollout,
)

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
