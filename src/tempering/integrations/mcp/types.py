"""The data of MCP•RL, as ART's `art.mcp` names it: tools, resources and generated scenarios.

Plain dataclasses (no MCP SDK needed): `MCPTool.from_mcp(tool)` / `MCPResource.from_mcp(resource)`
convert the SDK's listings, `MCPTool.to_tool_schema()` gives the OpenAI `tools` entry, and
`complete_task_tool` is the tool an agent calls to end its task with a summary.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError

__all__ = ["GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool", "complete_task_tool"]


@dataclass
class MCPTool:
    """A tool an MCP server offers: its name, description and JSON Schema of arguments."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        """From `{"name", "description", "parameters"}` (or the SDK's `input_schema` / `inputSchema`)."""
        params = data.get("parameters") or data.get("input_schema") or data.get("inputSchema")
        return cls(name=data.get("name", ""), description=data.get("description") or "",
                   parameters=params or {"type": "object", "properties": {}})

    @classmethod
    def from_mcp(cls, tool: Any) -> MCPTool:
        """From an `mcp.types.Tool` (as `list_tools()` returns them)."""
        return cls(name=tool.name, description=tool.description or "",
                   parameters=dict(tool.input_schema or {"type": "object", "properties": {}}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_tool_schema(self) -> dict[str, Any]:
        """The OpenAI chat `tools` entry: `{"type": "function", "function": {name, description, parameters}}`."""
        return {"type": "function", "function": self.to_dict()}


@dataclass
class MCPResource:
    """A resource an MCP server offers (a URI the agent or the scenario generator can read about)."""

    uri: str
    name: str
    description: str = ""
    mime_type: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        return cls(uri=str(data.get("uri", "")), name=data.get("name", ""), description=data.get("description") or "",
                   mime_type=data.get("mime_type") or data.get("mimeType"))

    @classmethod
    def from_mcp(cls, resource: Any) -> MCPResource:
        """From an `mcp.types.Resource` (as `list_resources()` returns them)."""
        return cls(uri=str(resource.uri), name=resource.name, description=resource.description or "",
                   mime_type=resource.mime_type)

    def to_dict(self) -> dict[str, Any]:
        data = {"uri": self.uri, "name": self.name, "description": self.description}
        if self.mime_type:
            data["mimeType"] = self.mime_type
        return data


complete_task_tool = MCPTool(
    name="complete_task",
    description="Finish the task: call this once, alone, with a summary of what you did and found.",
    parameters={
        "type": "object",
        "properties": {"summary": {"type": "string", "description": "What was done and the results."}},
        "required": ["summary"],
    },
)


@dataclass
class GeneratedScenario:
    """A task for an agent, with a difficulty from 1 (one tool call) to 5 (long multi-step work).

    Raises:
        ConfigError (a ValueError): for an empty task or a difficulty that is not an int in [1, 5].
    """

    task: str
    difficulty: int

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task.strip():
            raise ConfigError("a scenario's task must be a non-empty string")
        if isinstance(self.difficulty, bool) or not isinstance(self.difficulty, int) or not 1 <= self.difficulty <= 5:
            raise ConfigError(f"a scenario's difficulty must be an integer in [1, 5], got {self.difficulty!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        """From `{"task": str, "difficulty": int}`.

        Raises:
            ConfigError (a ValueError): `data` is not such a dict, or its values are invalid.
        """
        missing = [key for key in ("task", "difficulty") if not isinstance(data, dict) or key not in data]
        if missing:
            found = f"keys {sorted(data)}" if isinstance(data, dict) else f"a {type(data).__name__}"
            raise ConfigError(f"a scenario needs {' and '.join(repr(k) for k in missing)}, found {found}; "
                              'expected {"task": str, "difficulty": int from 1 to 5}')
        return cls(task=data["task"], difficulty=data["difficulty"])

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}

    def preview(self, max_length: int = 120) -> str:
        return self.task if len(self.task) <= max_length else self.task[:max_length].rstrip() + "…"


class GeneratedScenarioCollection:
    """Scenarios with the helpers ART's collection has: split, shuffle, filter, JSON round trip."""

    def __init__(self, scenarios: list[GeneratedScenario]) -> None:
        self.scenarios = list(scenarios)

    @classmethod
    def from_dicts(cls, data: list[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, text: str) -> GeneratedScenarioCollection:
        """From `{"scenarios": [...]}` (what `to_json` writes) or a bare list of scenarios.

        Raises:
            json.JSONDecodeError (a ValueError): `text` is not JSON.
            ConfigError (a ValueError): the JSON has another shape (an object without "scenarios",
                say), or a scenario lacks "task" or "difficulty"; the message says what was found.
        """
        data = json.loads(text)
        if isinstance(data, dict):
            if "scenarios" not in data:
                raise ConfigError(f'scenario JSON has no "scenarios" key (found keys {sorted(data)}); expected '
                                  '{"scenarios": [{"task": str, "difficulty": int}, ...]} or a bare list of scenarios')
            data = data["scenarios"]
        if not isinstance(data, list):
            raise ConfigError(f"scenario JSON holds a {type(data).__name__} where a list of scenarios belongs; expected "
                              '{"scenarios": [{"task": str, "difficulty": int}, ...]} or a bare list of scenarios')
        return cls.from_dicts(data)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.scenarios]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"scenarios": self.to_dicts()}, indent=indent)

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    def __getitem__(self, index: Any) -> Any:
        return self.scenarios[index]

    def shuffle(self, seed: int | None = None) -> GeneratedScenarioCollection:
        """A shuffled copy."""
        scenarios = self.scenarios.copy()
        random.Random(seed).shuffle(scenarios)
        return GeneratedScenarioCollection(scenarios)

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection, GeneratedScenarioCollection]:
        """(first `train_size` scenarios, the rest).

        Raises:
            ConfigError (a ValueError): if `train_size` exceeds the number of scenarios.
        """
        if not 0 <= train_size <= len(self.scenarios):
            raise ConfigError(f"train_size ({train_size}) must be in [0, {len(self.scenarios)}]")
        return (GeneratedScenarioCollection(self.scenarios[:train_size]),
                GeneratedScenarioCollection(self.scenarios[train_size:]))

    def filter_by_difficulty(self, min_difficulty: int = 1, max_difficulty: int = 5) -> GeneratedScenarioCollection:
        return GeneratedScenarioCollection([s for s in self.scenarios if min_difficulty <= s.difficulty <= max_difficulty])

    def get_difficulty_distribution(self) -> Counter[int]:
        return Counter(s.difficulty for s in self.scenarios)

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        """Print the first `n` scenarios."""
        for i, scenario in enumerate(self.scenarios[:n], start=1):
            print(f"   {i}. {scenario.preview(max_task_length)}  (difficulty {scenario.difficulty}/5)")

    def print_difficulty_distribution(self) -> None:
        counts = self.get_difficulty_distribution()
        print("Difficulty distribution:")
        for d in range(1, 6):
            print(f"   {d}/5: {counts.get(d, 0):3d}  {'█' * min(counts.get(d, 0), 30)}")

    def get_summary(self) -> dict[str, Any]:
        n = len(self.scenarios)
        return {
            "total_scenarios": n,
            "difficulty_distribution": dict(self.get_difficulty_distribution()),
            "avg_difficulty": sum(s.difficulty for s in self.scenarios) / n if n else 0,
            "avg_task_length": sum(len(s.task) for s in self.scenarios) / n if n else 0,
        }
