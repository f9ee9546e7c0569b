"""A small MCP server for the tests: a unit converter (stdio by default, `http PORT` for streamable HTTP).

Tools: `convert(value, from_unit, to_unit)` for lengths and masses, `list_units(kind)`,
`save_conversion` / `get_conversion(conversion_id)` (ids are 8 random hex digits, so a made-up id is
always rejected), `wait(seconds)` (a slow tool), and `shutdown`, which ends the process at once (a
server that dies mid-rollout). With `--no-hazards` the server leaves out `wait` and `shutdown`, so
a model free to call any tool (tool_choice="required", sampled) cannot stall or kill it.
Resource: `units://table`, every unit with its factor.

Every tool's schema says `additionalProperties: false` and bounds its strings, so a call forced by
`tool_choice` (held to the schema by a tempering server) is short and complete.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool
from pydantic import Field

UNITS = {  # unit -> (kind, factor to the kind's base unit)
    "mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
    "in": ("length", 0.0254), "ft": ("length", 0.3048), "mi": ("length", 1609.344),
    "g": ("mass", 0.001), "kg": ("mass", 1.0), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
}
SAVED: dict[str, str] = {}
Unit = Literal["mm", "cm", "m", "km", "in", "ft", "mi", "g", "kg", "lb", "oz"]


def convert(value: float, from_unit: Unit, to_unit: Unit) -> str:
    """Convert a value between two units of the same kind (length or mass)."""
    if from_unit not in UNITS or to_unit not in UNITS:
        raise ToolError(f"unknown unit; known units: {', '.join(UNITS)}")
    (kind, a), (other, b) = UNITS[from_unit], UNITS[to_unit]
    if kind != other:
        raise ToolError(f"cannot convert {kind} ({from_unit}) to {other} ({to_unit})")
    return f"{value:g} {from_unit} = {value * a / b:.6g} {to_unit}"


def list_units(kind: Literal["length", "mass"]) -> str:
    """List the units of one kind: "length" or "mass"."""
    units = [u for u, (k, _) in UNITS.items() if k == kind]
    if not units:
        raise ToolError('kind must be "length" or "mass"')
    return ", ".join(units)


def save_conversion(text: Annotated[str, Field(max_length=200)]) -> str:
    """Save a conversion's text; returns its id."""
    conversion_id = secrets.token_hex(4)
    SAVED[conversion_id] = text
    return conversion_id


def get_conversion(conversion_id: Annotated[str, Field(min_length=8, max_length=8)]) -> str:
    """Read a saved conversion by the id save_conversion returned."""
    if conversion_id not in SAVED:
        raise ToolError(f"no saved conversion has id {conversion_id!r}")
    return SAVED[conversion_id]


def wait(seconds: Annotated[float, Field(ge=0, le=30)]) -> str:
    """Do nothing for a while (a slow tool)."""
    time.sleep(seconds)
    return f"waited {seconds:g} s"


def shutdown() -> str:
    """Stop the server."""
    print("shutting down on request", file=sys.stderr, flush=True)
    os._exit(3)


def strict(fn) -> Tool:
    tool = Tool.from_function(fn)
    tool.parameters["additionalProperties"] = False
    return tool


server = MCPServer("unit-converter", instructions="Converts lengths and masses.", log_level="WARNING",
                   tools=[strict(f) for f in (convert, list_units, save_conversion, get_conversion)
                          + ((wait, shutdown) if "--no-hazards" not in sys.argv else ())])


@server.resource("units://table")
def table() -> str:
    """Every unit, its kind and its factor to the base unit (m, kg)."""
    return "\n".join(f"{u}: {k} x{f:g}" for u, (k, f) in UNITS.items())


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:  # http PORT
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
