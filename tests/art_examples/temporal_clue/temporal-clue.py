# Copied from OpenPipe/ART (https://github.com/OpenPipe/ART), examples/temporal_clue/temporal-clue.py at
# commit 3b3de61445eea6bff1be70baa936b046fd570ec2. ART is licensed under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0). Changed for tempering's test suite: the import lines, the
# base model, the step count, the group size and max_tokens, each marked "# tempering: was ...".
# ../data/temporal-clue/puzzles.json is a small stand-in made for the test (ART's puzzle file is not
# copied); see its README.
import asyncio
import json
import os
import random
import re
from typing import TypedDict

from dotenv import load_dotenv

import tempering as art  # tempering: was `import art`
from tempering.local import LocalBackend  # tempering: was `from art.local import LocalBackend`

load_dotenv()


class TemporalCluePuzzle(TypedDict):
    num_clues: int
    prompt: str
    solution: dict[str, str]


# download the puzzles from the github repo
puzzles_path = os.path.join(
    os.path.dirname(__file__), "..", "data", "temporal-clue", "puzzles.json"
)

puzzles: list[TemporalCluePuzzle] = json.loads(open(puzzles_path).read())
val_puzzles = puzzles[:64]
test_puzzles = puzzles[64:128]
train_puzzles = puzzles[128:]
random.seed(42)
random.shuffle(train_puzzles)


async def rollout(model: art.Model, puzzle: TemporalCluePuzzle) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": puzzle["prompt"]}]
    client = model.openai_client()
    chat_completion = await client.chat.completions.create(
        messages=messages, model=model.name, max_tokens=12  # tempering: was no max_tokens
    )
    choice = chat_completion.choices[0]
    content = choice.message.content
    assert isinstance(content, str)
    num_correct = 0
    for key, value in puzzle["solution"].items():
        if matches := re.findall(rf"{key}\. ([A-Za-z \.:-]+)", content):
            match = matches[-1]
            if match.strip().lower() == value.lower():
                num_correct += 1
    reward = acc = num_correct / len(puzzle["solution"])
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=reward, metrics={"acc": acc}
    )


async def main():
    model = art.TrainableModel(
        name="001",
        project="temporal-clue",
        base_model="SmolLM2-135M-Instruct",  # tempering: was "Qwen/Qwen2.5-7B-Instruct"
        _internal_config={"init_args": {"gpu_memory_utilization": 0.775}},
    )
    with LocalBackend() as backend:
        if "BACKUP_BUCKET" in os.environ:
            await backend._experimental_pull_from_s3(
                model,
                s3_bucket=os.environ["BACKUP_BUCKET"],
                verbose=True,
            )
        else:
            print("BACKUP_BUCKET not found in environment variables")
        await model.register(backend)

        stride = 4
        for i in range(await model.get_step(), 1):  # tempering: was 1_000
            val_groups, train_groups = await asyncio.gather(
                art.gather_trajectory_groups(
                    (
                        art.TrajectoryGroup(rollout(model, puzzle) for _ in range(2))
                        for puzzle in val_puzzles
                    ),
                    pbar_desc="val",
                ),
                art.gather_trajectory_groups(
                    (
                        art.TrajectoryGroup(rollout(model, puzzle) for _ in range(4))  # tempering: was range(50)
                        for puzzle in train_puzzles[i * stride : (i + 1) * stride]
                    ),
                    pbar_desc="train",
                ),
            )
            await model.log(val_groups)
            await model.delete_checkpoints()
            if "BACKUP_BUCKET" in os.environ:
                await backend._experimental_push_to_s3(
                    model,
                    s3_bucket=os.environ["BACKUP_BUCKET"],
                    verbose=True,
                )
            result = await backend.train(model, train_groups, learning_rate=5e-5)
            await model.log(
                train_groups, metrics=result.metrics, step=result.step, split="train"
            )


if __name__ == "__main__":
    asyncio.run(main())
