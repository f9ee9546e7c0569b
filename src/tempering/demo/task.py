"""Addition of two integers: a verifiable task the default model solves about a third of the time.

SmolLM2-135M-Instruct answers "What is 12+13? Answer with just the number." with text such as
"12 + 13 = 25" or "The answer is 25". Sampled at temperature 0.7 it is right about 35% of the
time (greedy: about 45-60%), which leaves RL room to learn: the reward is 1 for a correct sum and
0 otherwise.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..model import Model
from ..types import Trajectory

__all__ = ["AdditionTask", "Scenario", "extract_answer"]

_INT = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class Scenario:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a}+{self.b}? Answer with just the number."

    @property
    def answer(self) -> int:
        return self.a + self.b


def extract_answer(text: str) -> int | None:
    """The integer a reply gives as its answer: the first one after the last '=', else the first one."""
    tail = text.rsplit("=", 1)[1] if "=" in text else text
    found = _INT.search(tail)
    return int(found.group()) if found else None


@dataclass(slots=True)
class AdditionTask:
    """Scenarios, rollout and reward of the demo.

    Args:
        max_operand: operands are drawn from [0, max_operand].
        temperature: sampling temperature of rollouts and validation.
        max_tokens: the most tokens a reply may have.
    """

    max_operand: int = 20
    temperature: float = 0.7
    max_tokens: int = 20

    def scenarios(self, count: int, *, seed: int, exclude: set[Scenario] | None = None) -> list[Scenario]:
        """`count` distinct scenarios, none of them in `exclude` (so validation stays held out)."""
        rng = random.Random(seed)
        out: list[Scenario] = []
        seen = set(exclude or ())
        capacity = (self.max_operand + 1) ** 2 - len(seen)
        if count > capacity:
            raise ValueError(f"only {capacity} distinct scenarios are left; ask for fewer")
        while len(out) < count:
            s = Scenario(rng.randint(0, self.max_operand), rng.randint(0, self.max_operand))
            if s not in seen:
                seen.add(s)
                out.append(s)
        return out

    def reward(self, text: str, scenario: Scenario) -> float:
        return 1.0 if extract_answer(text) == scenario.answer else 0.0

    async def rollout(self, model: Model, scenario: Scenario, *, step: int | None = None) -> Trajectory:
        """One episode: ask the question, score the reply. `step` pins an older policy (`name@step`)."""
        trajectory = Trajectory(
            messages_and_choices=[{"role": "user", "content": scenario.prompt}],
            metadata={"a": scenario.a, "b": scenario.b},
        )
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(step),
            messages=trajectory.messages(),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        trajectory.reward = self.reward(choice.message.content or "", scenario)
        trajectory.metrics["completion_tokens"] = len(getattr(choice, "token_ids", None) or [])
        return trajectory
