"""An MCP server for the example: a unit converter for lengths and masses.

    python unit_server.py                 # stdio (what train.py starts by default)
    python unit_server.py http 8000       # streamable HTTP at http://127.0.0.1:8000/mcp

Each tool's arguments schema lists the accepted units and forbids extra keys, so a model served by
tempering with tool_choice "required" writes calls the server accepts (a tight schema is good tool
design for any agent).
"""

from __future__ import annotations

import sys
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool

UNITS = {  # unit -> (kind, factor to the kind's base unit: m or kg)
    "mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
    "in": ("length", 0.0254), "ft": ("length", 0.3048), "mi": ("length", 1609.344),
    "g": ("mass", 0.001), "kg": ("mass", 1.0), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
}
Unit = Literal["mm", "cm", "m", "km", "in", "ft", "mi", "g", "kg", "lb", "oz"]


def convert(value: float, from_unit: Unit, to_unit: Unit) -> str:
    """Convert a value between two units of the same kind (length or mass)."""
    (kind, a), (other, b) = UNITS[from_unit], UNITS[to_unit]
    if kind != other:
        raise ToolError(f"cannot convert {kind} ({from_unit}) to {other} ({to_unit})")
    return f"{value:g} {from_unit} = {value * a / b:.6g} {to_unit}"


def list_units(kind: Literal["length", "mass"]) -> str:
    """List the units of one kind."""
    return ", ".join(u for u, (k, _) in UNITS.items() if k == kind)


def strict(fn) -> Tool:
    tool = Tool.from_function(fn)
    tool.parameters["additionalProperties"] = False
    return tool


server = MCPServer("unit-converter", instructions="Converts lengths and masses.", log_level="WARNING",
                   tools=[strict(convert), strict(list_units)])


@server.resource("units://table")
def table() -> str:
    """Every unit, its kind and its factor to the base unit (m, kg)."""
    return "\n".join(f"{u}: {k} x{f:g}" for u, (k, f) in UNITS.items())


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
