"""A two-turn, tool-using agent: multiply two numbers with a calculator tool, then answer.

Turn 1: the agent must call `calculator(expression)` (tool_choice names it, so the turn starts
with a call; the model still has to write valid arguments). The tool runs the expression.
Turn 2: with the tool's result in the conversation, the agent answers in words.
Reward (in [0, 1]): 0.5 for a well-formed call whose expression evaluates to the right product
(0.25 when the call is malformed JSON but its arguments text still evaluates to it: the tool is
lenient, the reward is not), plus 0.5 for a final answer that contains the product. The untrained
model writes calls like `"arguments": 16 * 44}`; training teaches it the format.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from dataclasses import dataclass

import tempering as art

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SYSTEM = (
    "You are a careful assistant. Use the calculator for arithmetic. Example call:\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    """+ - * / on numbers only (no names, no calls): a safe calculator."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("unsupported expression")

    return walk(ast.parse(expression, mode="eval"))


@dataclass(frozen=True)
class Scenario:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a * self.b


def scenarios(count: int, *, seed: int) -> list[Scenario]:
    rng = random.Random(seed)
    return [Scenario(rng.randint(11, 99), rng.randint(11, 99)) for _ in range(count)]


async def rollout(model: art.Model, scenario: Scenario, *, temperature: float = 1.0) -> art.Trajectory:
    client = model.openai_client()
    traj = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {scenario.a} times {scenario.b}?"},
        ],
        tools=[CALCULATOR],
        metadata={"a": scenario.a, "b": scenario.b},
    )
    first = await client.chat.completions.create(
        model=model.get_inference_name(), messages=traj.messages(), tools=traj.tools, max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "calculator"}}, temperature=temperature,
    )
    choice = first.choices[0]
    traj.messages_and_choices.append(choice)
    calls = choice.message.tool_calls or []
    expression = None
    if calls:
        try:
            expression = str(json.loads(calls[0].function.arguments).get("expression", ""))
        except (json.JSONDecodeError, AttributeError):
            expression = None
    else:  # a malformed call: read what follows "arguments": as the expression
        found = _LOOSE_ARGS.search(choice.message.content or "")
        expression = found.group(1) if found else None
    value = _safe_evaluate(expression)
    result = "error: no expression I can evaluate" if value is None else (str(int(value)) if float(value).is_integer() else str(value))
    correct = value == scenario.answer
    call_reward = (0.5 if calls else 0.25) if correct else 0.0
    if calls:
        traj.messages_and_choices.append({"role": "tool", "tool_call_id": calls[0].id, "content": result})
    else:
        traj.messages_and_choices.append({"role": "user", "content": f"calculator: {result}"})
    second = await client.chat.completions.create(
        model=model.get_inference_name(), messages=traj.messages(), tools=traj.tools, tool_choice="none",
        max_tokens=24, temperature=temperature,
    )
    final = second.choices[0]
    traj.messages_and_choices.append(final)
    answered_right = str(scenario.answer) in re.sub(r"(?<=\d),(?=\d)", "", final.message.content or "")
    traj.reward = call_reward + 0.5 * answered_right
    traj.metrics.update({
        "tool_call_well_formed": float(bool(calls)),
        "tool_call_correct": float(correct),
        "answer_correct": float(answered_right),
    })
    return traj


_LOOSE_ARGS = re.compile(r'"arguments"\s*:\s*\{?\s*(?:"expression"\s*:\s*)?"?([0-9][0-9\s.*/+()-]*[0-9)])')


def _safe_evaluate(expression: str | None) -> float | None:
    if not expression:
        return None
    try:
        return evaluate(expression)
    except (ValueError, SyntaxError, TypeError, ZeroDivisionError):
        return None
