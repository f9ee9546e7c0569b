"""`tempering.autorl`: train on a task described in plain language (the code is in integrations/autorl.py)."""

from .integrations.autorl import (
    AutoRLDataset,
    AutoRLResult,
    GenerationError,
    default_system_prompt,
    generate_dataset,
    generate_inputs,
    rollout,
    train,
)

__all__ = ["AutoRLDataset", "AutoRLResult", "GenerationError", "default_system_prompt", "generate_dataset",
           "generate_inputs", "rollout", "train"]
