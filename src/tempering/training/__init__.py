"""Training: trajectories → tokens → advantages → policy-gradient step on a LoRA adapter."""

from .advantages import group_advantages
from .losses import policy_loss
from .tokenize import TokenizedSequence, tokenize_trajectory
from .trainer import Trainer

__all__ = ["TokenizedSequence", "Trainer", "group_advantages", "policy_loss", "tokenize_trajectory"]
