"""AutoRL: train a model from a one-sentence task description; no data, no reward code.

    python examples/autorl/train.py ["Describe the task in plain language."] [--steps 2]

A model writes training and validation inputs for the task (here the policy itself, through the
inputs' JSON schema), the policy answers each input several times, RULER compares the answers
(the judge is the policy again) and the scores train it. Prints RULER's validation reward before
and after, and the policy's answer to each validation input.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import tempering as art
from tempering import autorl


async def main(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    model = art.TrainableModel(name=f"autorl-{int(time.time())}", project="autorl", base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend(path=args.path))
    dataset = await autorl.generate_dataset(
        args.task, num_train_inputs=args.steps * args.groups_per_step, num_val_inputs=args.val_inputs,
        generator_model=model.name, generator_client=model.openai_client(), max_input_chars=200, max_tokens=1500)
    print("training inputs:", dataset.train_inputs)
    print("validation inputs:", dataset.val_inputs)
    result = await autorl.train(
        model, dataset, groups_per_step=args.groups_per_step, rollouts_per_group=args.group_size,
        learning_rate=args.learning_rate, max_tokens=args.max_tokens,
        judge_options={"max_tokens": 400, "max_explanation_chars": 80, "temperature": 1.0},
        on_step=lambda step, m: print(f"step {step}: train/reward {m['train/reward']:.3f}"))
    print(f"val/reward before {result.val_before.get('val/reward', float('nan')):.3f}, "
          f"after {result.val_after.get('val/reward', float('nan')):.3f}")
    for text in dataset.val_inputs:
        answer = await autorl.rollout(model, dataset.system_prompt, text, max_tokens=args.max_tokens, temperature=0)
        print(f"> {text}\n  {answer.messages()[-1]['content']}")
    print(f"{(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("task", nargs="?", default="Given the name of an animal, say in one sentence where it lives.")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--val-inputs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--path", default=".tempering")
    asyncio.run(main(parser.parse_args()))
