"""Integrations with agent and tracing libraries, each behind its own pip extra (client layer).

- `langgraph`: LangGraph/LangChain agents as rollouts (`tempering.langgraph`, ART's `art.langgraph`).
- `tracing`: rollouts traced in Weave and Langfuse.

Modules here import their optional packages at import time and raise `MissingDependencyError`
naming the extra when one is missing; `import tempering` imports none of them.
"""
