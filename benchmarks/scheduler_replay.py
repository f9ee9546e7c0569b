"""The engine's scheduler and block manager under an agent gather's token counts, on the CPU (one JSON line).

`Scheduler` and `BlockManager` (the engine's own, unchanged) are driven step by step as the engine
drives them, with no model: each step's prefill chunks and decode rows are "computed" and every
decode row samples a token. The workload is `agent_rl.py`'s default on a GPU: 128 conversations
share a 1,700-token system prompt and tools, each of 6 turns samples 64/192/384 tokens (seeded)
and is followed by a tool message of 200-800 tokens, and the next turn re-sends the whole
conversation `--tool-delay-s` after the last one ended. Token ids are random, so only the shared
prompt and each conversation's own history hit the prefix cache, as with the real workload.

A step's time is modelled, not measured: `--step-s` (the weights read once) + `--prefill-us` per
prefilled token + the KV cache the step's rows attend over read at `--hbm-gb-s` + the host tier's
copies at `--pcie-gb-s`; with `--cascade`, runs are added in which the decode rows' shared prefix
(EngineConfig.cascade_attention: the leading blocks every row holds, `shared_prefix_len`) is read
once per 16 rows, as if the L2 cache served none of the repeats otherwise (the most it can gain).
Calibration: at the 8B shape, first come first served without a host tier
prefills 1.12M tokens with 27 preemptions here; the H100 run of `agent_rl.py` prefilled 1.14M with
26 (RESULTS.md, agent RL). The prefill and the copies counted are exact for this scheduler; the
time is a model for comparing policies, not a figure for the engine.

    python benchmarks/scheduler_replay.py                               # 8B: fcfs / lpm, no tier / 48 GiB
    python benchmarks/scheduler_replay.py --model 30b-a3b --host-gib 0,48 --tool-delay-s 1
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time

import numpy as np

from tempering.engine.block_manager import BlockManager
from tempering.engine.config import EngineConfig
from tempering.engine.model_runner import shared_prefix_len
from tempering.engine.request import BasePolicy, GenerationRequest
from tempering.engine.sampling_params import SamplingParams
from tempering.engine.scheduler import Scheduler
from tempering.engine.sequence import Sequence

# per model shape: KV bytes a token, KV cache tokens on an H100 (EngineConfig's default sizing),
# a decode step's fixed cost (the weights read once, s), prefill cost a token (s)
SHAPES = {
    "8b": dict(kv_bytes=147_456, kv_tokens=227_360, step_s=0.0065, prefill_s=30e-6),
    "30b-a3b": dict(kv_bytes=98_304, kv_tokens=116_400, step_s=0.020, prefill_s=15e-6),
}


def replay(shape: dict, *, policy: str, host_gib: float, conversations: int, turns: int, system_tokens: int,
           tool_delay_s: float, hbm_gb_s: float, pcie_gb_s: float, seed: int, cascade: bool = False) -> dict:
    rng = random.Random(seed)
    block_size = 16
    num_blocks = shape["kv_tokens"] // block_size
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=4096, block_size=block_size,
                          num_kv_blocks=num_blocks, scheduling_policy=policy)
    blocks = BlockManager(num_blocks, block_size,
                          num_host_blocks=int(host_gib * 2**30 // (shape["kv_bytes"] * block_size)))
    scheduler = Scheduler(config, blocks)
    system = [rng.randrange(50_000) for _ in range(system_tokens)]
    convs = [dict(prompt=system + [rng.randrange(50_000) for _ in range(40)], turn=0,
                  lengths=[rng.choice((64, 192, 384)) for _ in range(turns)],
                  tools=[rng.randint(200, 800) for _ in range(turns)]) for _ in range(conversations)]

    def submit(c: int) -> None:
        conv = convs[c]
        request = GenerationRequest(list(conv["prompt"]), SamplingParams(), 1, BasePolicy())
        scheduler.add(Sequence.from_request(request, c, 0, conv["lengths"][conv["turn"]]))

    for c in range(conversations):
        submit(c)
    now, done, steps, prefilled, copied, shared_read = 0.0, 0, 0, 0, 0, 0
    sent = sum(len(c["prompt"]) for c in convs)
    arrivals: list[tuple[float, int]] = []
    while done < conversations:
        while arrivals and arrivals[0][0] <= now:
            submit(heapq.heappop(arrivals)[1])
        batch = scheduler.schedule()
        transfers = len(blocks.take_transfers())
        if not batch:
            now = max(now, arrivals[0][0])
            continue
        steps += 1
        copied += transfers
        tokens = sum(n for _, n in batch.prefill)
        context = sum(len(s) for s, _ in batch.items())
        if cascade and batch.decode:  # the shared prefix read once per tile of 16 rows
            width = max(len(s.block_table) for s in batch.decode)
            tables = np.array([s.block_table + [0] * (width - len(s.block_table)) for s in batch.decode])
            shared = shared_prefix_len(tables, [len(s) for s in batch.decode], block_size)
            context -= (len(batch.decode) - -(-len(batch.decode) // 16)) * shared
            shared_read += shared * len(batch.decode)
        now += (shape["step_s"] + tokens * shape["prefill_s"] + context * shape["kv_bytes"] / (hbm_gb_s * 1e9)
                + transfers * block_size * shape["kv_bytes"] / (pcie_gb_s * 1e9))
        prefilled += tokens
        for seq, n in batch.items():
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):
                seq.token_ids.append(rng.randrange(50_000))
                if seq.num_completion_tokens >= seq.max_tokens:
                    scheduler.finish(seq)
                    conv = convs[seq.sample_index]
                    conv["turn"] += 1
                    if conv["turn"] == turns:
                        done += 1
                        continue
                    conv["prompt"] = seq.token_ids + [rng.randrange(50_000) for _ in range(conv["tools"][conv["turn"] - 1])]
                    sent += len(conv["prompt"])
                    heapq.heappush(arrivals, (now + tool_delay_s, seq.sample_index))
    return dict(policy=policy, host_gib=host_gib, cascade=cascade, modelled_gather_s=round(now, 1), steps=steps,
                prompt_tokens_sent=sent, prefilled_tokens=prefilled,
                offloaded_tokens=blocks.num_offloaded_blocks * block_size,
                restored_tokens=blocks.num_restored_blocks * block_size,
                copied_gb=round(copied * block_size * shape["kv_bytes"] / 1e9, 1),
                preemptions=scheduler.num_preemptions, decode_keys_in_shared_prefixes=shared_read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--policies", default="fcfs,lpm")
    parser.add_argument("--host-gib", default="0,48", help="host tier sizes (GiB), comma-separated")
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1700)
    parser.add_argument("--tool-delay-s", type=float, default=0.01, help="from a turn's end to the next request")
    parser.add_argument("--hbm-gb-s", type=float, default=3000.0)
    parser.add_argument("--pcie-gb-s", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cascade", action="store_true", help="add runs with cascade attention's shared prefix")
    args = parser.parse_args()
    shape = SHAPES[args.model]
    start = time.perf_counter()
    runs = [replay(shape, policy=policy, host_gib=float(gib), conversations=args.conversations, turns=args.turns,
                   system_tokens=args.system_tokens, tool_delay_s=args.tool_delay_s, hbm_gb_s=args.hbm_gb_s,
                   pcie_gb_s=args.pcie_gb_s, seed=args.seed, cascade=cascade)
            for cascade in ((False, True) if args.cascade else (False,))
            for gib in args.host_gib.split(",") for policy in args.policies.split(",")]
    baseline = runs[0]
    for run in runs:
        run["prefilled_vs_first"] = round(run["prefilled_tokens"] / max(1, baseline["prefilled_tokens"]), 3)
    print(json.dumps({"benchmark": "scheduler_replay", "model": args.model, "kv_cache_tokens": shape["kv_tokens"],
                      "tool_delay_s": args.tool_delay_s, "runs": runs,
                      "wall_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
