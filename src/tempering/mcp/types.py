"""`tempering.mcp.types`, where ART has `art.mcp.types`."""

from ..integrations.mcp.types import (
    GeneratedScenario,
    GeneratedScenarioCollection,
    MCPResource,
    MCPTool,
    complete_task_tool,
)

__all__ = ["GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool", "complete_task_tool"]
