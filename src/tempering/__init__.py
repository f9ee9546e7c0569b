"""tempering: reinforcement learning for LLM agents, in your own code, on CPU or GPU.

`import tempering as art` runs code written for OpenPipe ART's client API::

    model = art.TrainableModel(name="agent-001", project="my-task", base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend())
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios))
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
"""

from . import rewards
from .backends import Backend, LocalBackend, RemoteBackend
from .errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    EngineError,
    MissingDependencyError,
    TemperingError,
    TrajectoryError,
    UnknownModelError,
)
from .gather import gather_trajectories, gather_trajectory_groups
from .model import Model, TrainableModel
from .pipeline_trainer import PipelineResult, PipelineTrainer, make_group_rollout_fn
from .sft import read_sft_jsonl, train_sft_from_file
from .types import (
    History,
    LoRAConfig,
    Messages,
    MessagesAndChoices,
    PydanticException,
    Tools,
    TrainConfig,
    TrainResult,
    TrainSFTConfig,
    Trajectory,
    TrajectoryGroup,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "CheckpointError",
    "ConfigError",
    "EngineError",
    "History",
    "LoRAConfig",
    "LocalBackend",
    "Messages",
    "MessagesAndChoices",
    "MissingDependencyError",
    "Model",
    "PipelineResult",
    "PipelineTrainer",
    "PydanticException",
    "RemoteBackend",
    "TemperingError",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryGroup",
    "UnknownModelError",
    "__version__",
    "gather_trajectories",
    "gather_trajectory_groups",
    "make_group_rollout_fn",
    "read_sft_jsonl",
    "rewards",
    "train_sft_from_file",
]
