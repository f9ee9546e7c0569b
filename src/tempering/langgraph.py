"""ART's module path `art.langgraph`: LangGraph agents as rollouts (see tempering.integrations.langgraph)."""

from .integrations.langgraph import *  # the public names are the implementation's __all__
from .integrations.langgraph import __all__  # noqa: F401
