"""The one exception tree of tempering (a leaf module: it imports nothing else of tempering).

Every error subclasses `TemperingError` and the standard-library error it stands for, so
`except ValueError` keeps working for callers who do not know tempering::

    TemperingError
    ├── ConfigError(ValueError)            bad option or combination of options
    │   ├── UnknownModelError(LookupError) a base model or served model name that does not exist
    │   ├── UnknownOptionError(TypeError)  an option name that neither tempering nor ART has
    │   └── UnsupportedOptionError         an ART option whose value tempering cannot honour
    ├── TrajectoryError(ValueError)        trajectories that cannot be trained on
    ├── CheckpointError(OSError)           a checkpoint that cannot be written or read
    ├── OutOfMemoryError(MemoryError)      a training step ran out of memory (undone; names the knob)
    ├── EngineError(RuntimeError)          the rollout engine failed or was closed
    ├── BackendError(RuntimeError)         a backend that is closed, unregistered or unreachable
    │   └── DistributedError               a worker process (another GPU's rank) died, timed out or failed
    ├── RequestTimeout(TimeoutError)       a generator's or judge's request got no answer in time
    └── MissingDependencyError(ImportError) an optional package is not installed

Messages name the problem and the fix.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
    "EngineError",
    "MissingDependencyError",
    "OutOfMemoryError",
    "RequestAborted",
    "RequestTimeout",
    "TemperingError",
    "TrajectoryError",
    "UnknownModelError",
    "UnknownOptionError",
    "UnsupportedOptionError",
]


class TemperingError(Exception):
    """Base class of every error raised by tempering."""


class ConfigError(TemperingError, ValueError):
    """An option, or a combination of options, that cannot work."""


class UnknownModelError(ConfigError, LookupError):
    """A base model, or a served model name, that does not exist."""


class UnknownOptionError(ConfigError, TypeError):
    """An option name that neither tempering nor ART knows (a misspelling, or an option of another tool)."""


class UnsupportedOptionError(ConfigError):
    """An ART option that tempering cannot honour with the given value; ignoring it would change results."""


class TrajectoryError(TemperingError, ValueError):
    """Trajectories that cannot be trained on (no sampled tokens, bad reward, nothing to train)."""


class CheckpointError(TemperingError, OSError):
    """A checkpoint that cannot be written or read."""


class OutOfMemoryError(TemperingError, MemoryError):
    """A training step ran out of device (or host) memory; it was undone, and the message names the
    setting that bounds its memory (`TrainConfig.micro_batch_tokens`)."""


class EngineError(TemperingError, RuntimeError):
    """The rollout engine failed, or was used after it was closed."""


class RequestAborted(EngineError):
    """A generation request was stopped before it finished (`Engine.abort`: its client went away)."""


class BackendError(TemperingError, RuntimeError):
    """A backend that is closed, not registered with a model, or unreachable."""


class DistributedError(BackendError):
    """A worker process of a multi-GPU run (another rank) died, timed out, or failed its part of a step."""


class RequestTimeout(TemperingError, TimeoutError):
    """A request to a generator or judge model (generate_scenarios, AutoRL, RULER) got no answer
    within its client's timeout; the message names the request and the argument to change."""


class MissingDependencyError(TemperingError, ImportError):
    """An optional dependency is missing; the message names the pip command that installs it."""
