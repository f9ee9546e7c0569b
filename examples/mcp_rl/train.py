"""MCP•RL: train SmolLM2-135M-Instruct to use an MCP server's tools, with no data and no reward code.

    python examples/mcp_rl/train.py [--steps 2] [--server-url http://127.0.0.1:8000/mcp]

1. connect to the MCP server (unit_server.py over stdio unless --server-url) and list its tools;
2. have a model write scenarios for them (generate_scenarios; here the policy itself, through the
   scenarios' JSON schema);
3. roll out: the policy calls the server's tools until it calls complete_task;
4. RULER scores each group (the judge is the policy again), and the scores train the policy.
Prints RULER's validation reward before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import tempering as art
from tempering.mcp import connect, generate_scenarios, rollout
from tempering.rewards import ruler_score_group
from tempering.utils import iterate_dataset

HERE = Path(__file__).parent


async def main(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    model = art.TrainableModel(name=f"mcp-{int(time.time())}", project="mcp-rl", base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend(path=args.path))
    server = args.server_url or [sys.executable, str(HERE / "unit_server.py")]

    async def judge(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        # a small judge answers through the scores' schema; bounded explanations keep its answer whole
        return await ruler_score_group(group, model.name, client=model.openai_client(), swallow_exceptions=True,
                                       max_tokens=400, max_explanation_chars=80, temperature=1.0)

    async with connect(server) as mcp_server:
        tools, resources = await mcp_server.list_tools(), await mcp_server.list_resources()
        print(f"{server}: tools {[t.name for t in tools]}, resources {[r.uri for r in resources]}")
        scenarios = await generate_scenarios(
            tools, resources, num_scenarios=args.train_scenarios + args.val_scenarios,
            generator_model=model.name, generator_client=model.openai_client(), max_task_chars=120, max_tokens=1500)
        train, val = scenarios.split(args.train_scenarios)

        async def gather(items, desc: str) -> list[art.TrajectoryGroup]:
            return await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, s, mcp_server, max_turns=args.max_turns, max_tokens=96,
                                             tool_choice="required") for _ in range(args.group_size)) for s in items),
                pbar_desc=desc, after_each=judge, max_exceptions=0.25)

        before = await model.log(await gather(val, "validate"), split="val")
        for batch in iterate_dataset(list(train), groups_per_step=args.groups_per_step, num_epochs=args.epochs,
                                     initial_step=await model.get_step(), use_tqdm=False):
            if batch.step >= args.steps:
                break
            groups = [g for g in await gather(batch.items, f"step {batch.step + 1}") if len(g)]
            if groups:
                result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
                print(f"step {result.step}: train/reward {result.metrics['train/reward']:.3f}  "
                      f"tool errors {result.metrics.get('train/num_tool_errors', 0):.2f}  "
                      f"completed {result.metrics.get('train/task_completed', 0):.2f}")
        after = await model.log(await gather(val, "validate"), split="val")
    for name, metrics in (("before", before), ("after", after)):
        print(f"{name}: val/reward {metrics.get('val/reward', float('nan')):.3f}  "
              f"task completed {metrics.get('val/task_completed', float('nan')):.2f}  "
              f"tool errors {metrics.get('val/num_tool_errors', float('nan')):.2f}")
    print(f"{(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--train-scenarios", type=int, default=4)
    parser.add_argument("--val-scenarios", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--server-url", default=None, help="a streamable HTTP MCP server (default: unit_server.py over stdio)")
    parser.add_argument("--path", default=".tempering")
    asyncio.run(main(parser.parse_args()))
