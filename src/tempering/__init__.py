"""tempering: reinforcement learning for LLM agents, in your own code, on CPU or GPU.

`import tempering as art` runs code written for OpenPipe ART's client API::

    model = art.TrainableModel(name="agent-001", project="my-task", base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend())
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios))
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
"""

from . import dev, local, rewards, trajectories, utils
from .backends import Backend, LocalBackend, RemoteBackend
from .backends.art_mapping import ArtOptionWarning
from .capture import auto_trajectory, capture_auto_trajectory, capture_client, capturing_http_client
from .errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    DistributedError,
    EngineError,
    MissingDependencyError,
    TemperingError,
    TrajectoryError,
    UnknownModelError,
    UnknownOptionError,
    UnsupportedOptionError,
)
from .gather import gather_trajectories, gather_trajectory_groups
from .model import Model, TrainableModel
from .pipeline_trainer import PipelineResult, PipelineTrainer, make_group_rollout_fn
from .service.export import export_model
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
from .utils import retry

__version__ = "0.1.0"

__all__ = [
    "ArtOptionWarning",
    "Backend",
    "BackendError",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
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
    "UnknownOptionError",
    "UnsupportedOptionError",
    "__version__",
    "auto_trajectory",
    "capture_auto_trajectory",
    "capture_client",
    "capturing_http_client",
    "dev",
    "export_model",
    "gather_trajectories",
    "gather_trajectory_groups",
    "local",
    "make_group_rollout_fn",
    "read_sft_jsonl",
    "retry",
    "rewards",
    "train_sft_from_file",
    "trajectories",
    "utils",
]
