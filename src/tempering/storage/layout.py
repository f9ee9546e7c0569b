"""Where a model's files live: `<root>/<project>/models/<name>/...` (see DESIGN.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["ModelPaths", "check_name"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def check_name(value: str, *, what: str) -> str:
    """Return `value` if it is safe as one path component; raise ConfigError otherwise.

    Names are 1-128 characters of letters, digits, '.', '_' and '-', not starting with '.' or
    '-', so a name can never point outside the storage root. '@' is reserved for `name@step`.
    """
    if not isinstance(value, str) or not _NAME.match(value) or value in {".", ".."}:
        raise ConfigError(
            f"{what} {value!r} is not a valid name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True, slots=True)
class ModelPaths:
    """Paths of one model's state under a storage root."""

    root: Path
    project: str
    name: str

    def __post_init__(self) -> None:
        check_name(self.project, what="project")
        check_name(self.name, what="model name")

    @property
    def model_dir(self) -> Path:
        return Path(self.root) / self.project / "models" / self.name

    @property
    def model_json(self) -> Path:
        return self.model_dir / "model.json"

    @property
    def history(self) -> Path:
        return self.model_dir / "history.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.model_dir / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / f"{step:04d}"

    @property
    def trajectories_dir(self) -> Path:
        return self.model_dir / "trajectories"

    def trajectories(self, split: str, step: int) -> Path:
        return self.trajectories_dir / check_name(split, what="split") / f"{step:04d}.jsonl"

    @property
    def plots_dir(self) -> Path:
        return self.model_dir / "plots"
