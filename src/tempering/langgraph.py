"""ART's module path `art.langgraph`: LangGraph agents as rollouts (see tempering.integrations.langgraph)."""

from .integrations.langgraph import init_chat_model, wrap_rollout

__all__ = ["init_chat_model", "wrap_rollout"]
