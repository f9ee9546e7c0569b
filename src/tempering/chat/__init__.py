"""Rendering chat messages and tools to token ids, parsing tool calls (a leaf package)."""

from .renderer import ChatRenderer
from .tools import ToolCall, parse_tool_calls
from .turns import TurnCache

__all__ = ["ChatRenderer", "ToolCall", "TurnCache", "parse_tool_calls"]
