"""Pipelined RL: rollouts keep running while the model trains, within a staleness bound (ART's names)."""

from .trainer import PipelineResult, PipelineTrainer, make_group_rollout_fn

__all__ = ["PipelineResult", "PipelineTrainer", "make_group_rollout_fn"]
