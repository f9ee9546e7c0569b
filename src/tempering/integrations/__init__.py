"""Integrations with agent and tracing libraries, each behind its own pip extra (client layer).

- `langgraph`: LangGraph/LangChain agents as rollouts (`tempering.langgraph`, ART's `art.langgraph`).
- `tracing`: rollouts traced in Weave and Langfuse.
- `mcp`: MCP•RL, agents trained on an MCP server's tools (`tempering.mcp`, ART's `art.mcp`).
- `autorl`: training from a task description alone (`tempering.autorl`); needs no extra.
- `generation`: asking a model for a JSON list through its schema (shared by the two above).

Modules here import their optional packages at import time and raise `MissingDependencyError`
naming the extra when one is missing; `import tempering` imports none of them.
"""
