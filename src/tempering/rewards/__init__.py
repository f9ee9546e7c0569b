"""Reward helpers used from the client side (they speak only to the OpenAI API)."""

from .ruler import DEFAULT_RUBRIC, RulerError, TrajectoryScore, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "RulerError", "TrajectoryScore", "ruler", "ruler_score_group"]
