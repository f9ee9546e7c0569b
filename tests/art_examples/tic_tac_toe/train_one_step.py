"""One training step of ART's tic-tac-toe example on tempering (tempering's driver, not ART's code).

ART's examples/tic_tac_toe/train.py plays against o4-mini (it needs OPENAI_API_KEY) and pushes
checkpoints to S3, so this script runs the loop of its LocalBackend variant
(examples/tic_tac_toe/tic-tac-toe-local.py) with ART's rollout.py and utils.py as copied here:
`python train_one_step.py`. Writes under ./.tempering and prints the TrainResult as JSON.
"""

import asyncio
import random

from rollout import TicTacToeScenario, rollout

import tempering as art
from tempering.local.backend import LocalBackend

random.seed(42)

STEP = 1


async def main():
    backend = LocalBackend()
    model = art.TrainableModel(name="tic-tac-toe-001", project="tic-tac-toe", base_model="SmolLM2-135M-Instruct")
    await model.register(backend)
    result = None
    for i in range(await model.get_step(), STEP):
        train_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, TicTacToeScenario(step=i)) for _ in range(4)) for _ in range(1)),
            pbar_desc="gather",
            max_exceptions=2,
        )
        await model.delete_checkpoints()
        result = await model.train(train_groups, config=art.TrainConfig(learning_rate=1e-4))
    await backend.close()
    if result is not None:
        print("RESULT", result.model_dump_json(), "is_adapter_unchanged", result.is_adapter_unchanged)


if __name__ == "__main__":
    asyncio.run(main())
