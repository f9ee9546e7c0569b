"""The demo's verifiable tasks.

`AdditionTask`: addition of two integers, which the default model solves about a third of the
time. SmolLM2-135M-Instruct answers "What is 12+13? Answer with just the number." with text such
as "12 + 13 = 25" or "The answer is 25". Sampled at temperature 0.7 it is right about 35% of the
time (greedy: about 45-60%), which leaves RL room to learn: the reward is 1 for a correct sum and
0 otherwise.

`RepeatWordTask`: a simpler task for a pretrained (not instruction-tuned) model such as Gemma 3
270M, which cannot follow the addition prompt: asked in its chat format it mostly repeats the
question and rambles (right 0-6% of the time), and asked 'Say the word "river".' it echoes the
request. The user's message is one word, and the reply should start with it: the reward is
1 / (1 + i) for the word at index i of the reply's words, 0 when it is missing. Sampled at
temperature 0.7, Gemma 3 270M starts 28% of its replies with the word (mean reward 0.31, every
group of 8 with spread; 12 words × 8 samples).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..model import Model
from ..types import Trajectory

__all__ = ["AdditionTask", "RepeatWordTask", "Scenario", "WordScenario", "extract_answer"]

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

    @property
    def metadata(self) -> dict[str, int]:
        return {"a": self.a, "b": self.b}


def extract_answer(text: str) -> int | None:
    """The integer a reply gives as its answer: the first one after the last '=', else the first one."""
    tail = text.rsplit("=", 1)[1] if "=" in text else text
    found = _INT.search(tail)
    return int(found.group()) if found else None


class _AskTask:
    """One question, one reply, a reward: the rollout shared by the tasks (they set the fields it reads)."""

    __slots__ = ()

    async def rollout(self, model: Model, scenario, *, step: int | None = None) -> Trajectory:
        """One episode: ask the question, score the reply. `step` pins an older policy (`name@step`)."""
        trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": scenario.prompt}],
                                metadata=scenario.metadata)
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


@dataclass(slots=True)
class AdditionTask(_AskTask):
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


WORDS = tuple("""
apple river green tiger candle window orange garden silver rabbit pencil castle yellow button guitar
dragon forest purple hammer jacket kettle lemon mirror needle ocean pepper rocket saddle tomato violin
wagon bridge carpet dinner engine feather ginger helmet island jungle kitten ladder magnet nickel
oyster parrot quartz ribbon shadow tunnel umbrella valley walnut anchor basket cherry desert eagle
falcon glacier harbor igloo jasmine koala lantern meadow noodle otter pillow quiver raven salmon
turtle velvet walrus yogurt zebra acorn bamboo cactus dolphin ember fossil goblet hazel iris
journal kayak lagoon marble nectar orchid pebble quill rhubarb sparrow thistle tulip vessel willow
bottle cookie ferry garlic honey ivory jelly lizard mango nutmeg olive peanut quilt radish spinach
thimble unicorn vanilla waffle badger canyon donkey elbow flute goose hornet insect jaguar lobster
monkey nephew onion pickle puzzle rooster sponge teapot summit breeze copper
""".split())


@dataclass(frozen=True, slots=True)
class WordScenario:
    word: str

    @property
    def prompt(self) -> str:
        return self.word

    @property
    def metadata(self) -> dict[str, str]:
        return {"word": self.word}


@dataclass(slots=True)
class RepeatWordTask(_AskTask):
    """Scenarios, rollout and reward of the repeat-a-word task (see the module docstring).

    Args:
        temperature: sampling temperature of rollouts and validation.
        max_tokens: the most tokens a reply may have.
    """

    temperature: float = 0.7
    max_tokens: int = 8

    def scenarios(self, count: int, *, seed: int, exclude: set[WordScenario] | None = None) -> list[WordScenario]:
        """`count` distinct words, none of them in `exclude` (so validation stays held out)."""
        pool = [WordScenario(w) for w in WORDS if WordScenario(w) not in (exclude or set())]
        if count > len(pool):
            raise ValueError(f"only {len(pool)} distinct scenarios are left; ask for fewer")
        return random.Random(seed).sample(pool, count)

    def reward(self, text: str, scenario: WordScenario) -> float:
        words = re.findall(r"[a-z]+", text.lower())
        return 1.0 / (1 + words.index(scenario.word)) if scenario.word in words else 0.0
