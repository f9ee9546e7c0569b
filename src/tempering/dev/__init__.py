"""ART's `art.dev` option dicts, accepted by tempering and mapped to its own settings.

`TrainableModel(_internal_config=art.dev.InternalModelConfig(engine_args=art.dev.EngineArgs(...),
init_args=art.dev.InitArgs(...), peft_args=art.dev.PeftArgs(...), trainer_args=...))` and
`model.train(..., _config=art.dev.TrainConfig(...))` run unchanged. These are TypedDicts: plain
dicts at run time, whose keys ART documents for its vLLM/Unsloth/TRL internals. What tempering
does with each key (mapped, ignored with a warning, or refused with an error naming the fix) is
the table `tempering.backends.art_options.ART_OPTIONS`, rendered in docs/guides/art-compatibility.md.
`model.register(backend, _openai_client_config=art.dev.OpenAIServerConfig(...))` configures ART's
own vLLM server; tempering's server has its settings from the backend, so every key given there is
ignored with one warning naming them.
"""

from .engine import EngineArgs
from .model import (
    InitArgs,
    InternalModelConfig,
    LoRAConfig,
    PeftArgs,
    TinkerArgs,
    TinkerNativeArgs,
    TinkerTrainingClientArgs,
    TrainerArgs,
)
from .openai_server import OpenAIServerConfig, ServerArgs
from .train import TrainConfig, TrainSFTConfig

__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "LoRAConfig",
    "OpenAIServerConfig",
    "PeftArgs",
    "ServerArgs",
    "TinkerArgs",
    "TinkerNativeArgs",
    "TinkerTrainingClientArgs",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainerArgs",
]
