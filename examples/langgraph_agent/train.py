"""Train a LangGraph ReAct agent (two tools) with RL on CPU: SmolLM2-135M-Instruct learns which calls answer
"what is the weather in the capital of <country>?".

    pip install "tempering[langgraph]"
    python examples/langgraph_agent/train.py [--steps 4]

The agent is `langgraph.prebuilt.create_react_agent` on `tempering.langgraph.init_chat_model()`;
`wrap_rollout` captures every LLM call of the graph, with its tokens, into the trajectory that
trains. Prints the validation reward before and after training.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Literal

from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

import tempering as art
from tempering.integrations.tracing import trace_rollout
from tempering.langgraph import init_chat_model, wrap_rollout

CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Peru": "Lima", "Kenya": "Nairobi"}
WEATHER = {"Paris": "rainy", "Rome": "sunny", "Madrid": "hot", "Tokyo": "humid", "Lima": "foggy", "Nairobi": "mild"}
Country = Literal["France", "Italy", "Spain", "Japan", "Peru", "Kenya"]
City = Literal["Paris", "Rome", "Madrid", "Tokyo", "Lima", "Nairobi"]


@tool
def capital_of(country: Country) -> str:
    """The capital city of a country."""
    return CAPITALS[country]


@tool
def weather_in(city: City) -> str:
    """Today's weather in a city."""
    return WEATHER[city]


TOOLS = [capital_of, weather_in]


def agent(max_tokens: int):
    """A ReAct agent that must call a tool on its first two turns (a 135M model rarely calls one unasked), then answers."""
    chat = init_chat_model(max_tokens=max_tokens)

    def model_for(state, runtime):
        num_tool_results = sum(isinstance(m, ToolMessage) for m in state["messages"])
        return chat.bind_tools(TOOLS, tool_choice="required" if num_tool_results < 2 else "none", strict=True)

    return create_react_agent(model_for, TOOLS)


@trace_rollout  # a trace per rollout in Weave / Langfuse when the program set one up; untraced otherwise
async def rollout(model: art.TrainableModel, country: str) -> art.Trajectory:
    capital = CAPITALS[country]
    state = await agent(max_tokens=40).ainvoke(
        {"messages": [("system", "Answer questions with the tools."),
                      ("user", f"What is the weather in the capital of {country}?")]},
        {"recursion_limit": 8})
    calls = [c for m in state["messages"] for c in getattr(m, "tool_calls", None) or []]
    looked_up = any(c["name"] == "capital_of" and c["args"].get("country") == country for c in calls)
    checked = any(c["name"] == "weather_in" and c["args"].get("city") == capital for c in calls)
    answered = WEATHER[capital] in state["messages"][-1].content.lower()
    return art.Trajectory(
        messages_and_choices=[],  # filled by wrap_rollout with every captured LLM call
        reward=0.25 * looked_up + 0.5 * checked + 0.25 * answered,
        metrics={"looked_up_capital": looked_up, "checked_weather": checked, "answered": answered},
        metadata={"country": country},
    )


async def validate(model: art.TrainableModel) -> dict[str, float]:
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(wrap_rollout(model, rollout)(model, c) for _ in range(2)) for c in CAPITALS),
        pbar_desc="validate")
    return await model.log(groups, split="val")


async def main(steps: int, group_size: int, learning_rate: float, path: str) -> None:
    start = time.perf_counter()
    model = art.TrainableModel(name=f"weather-agent-{int(time.time())}", project="langgraph-agent",
                               base_model="SmolLM2-135M-Instruct")
    backend = art.LocalBackend(path=path)
    await model.register(backend)
    print(f"before: val/reward {(await validate(model))['val/reward']:.3f}")
    rng = random.Random(0)
    for step in range(await model.get_step(), steps):
        countries = rng.sample(sorted(CAPITALS), 3)
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(wrap_rollout(model, rollout)(model, c) for _ in range(group_size)) for c in countries),
            pbar_desc=f"step {step + 1}/{steps}", max_exceptions=0.25)  # a crashed agent costs its rollout, not the step
        result = await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate))
        print(f"step {step + 1}: train/reward {result.metrics['train/reward']:.3f}")
    print(f"after:  val/reward {(await validate(model))['val/reward']:.3f}")
    print(f"{(time.perf_counter() - start) / 60:.1f} min")
    await backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--path", default=".tempering")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.group_size, args.learning_rate, args.path))
