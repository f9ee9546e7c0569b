"""The agent plays 2048 on a 3x3 board until it reaches 64, gets stuck or makes 60 moves.

Each turn the user message is the board; the agent answers with one move. `guided_choice`
offers only the legal moves (a move that changes nothing is not offered), so every game is
played to its end and what is learned is strategy: which legal move to prefer. Random legal
play reaches 32 about 60% of the time and 64 about 10%; keeping the big tiles in a corner (mostly
down and left, rarely up) reaches 64 about three times as often.

Reward: log2(max tile) / log2(target): 0.67 for 16, 0.83 for 32, 1.0 for 64.
"""

from __future__ import annotations

import math
import random

from game import legal_moves, max_tile, new_board, render, slide, spawn

import tempering as art

SYSTEM = "You play 2048. Reply with one move: up, down, left or right."


async def rollout(model: art.Model, seed: int, *, size: int = 3, target: int = 64, max_moves: int = 60,
                  temperature: float = 1.0) -> art.Trajectory:
    """One game; `seed` drives where the new tiles appear."""
    rng = random.Random(seed)
    board = new_board(size, rng)
    traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}], metadata={"seed": seed})
    counts = dict.fromkeys(("up", "down", "left", "right"), 0)
    num_moves = 0
    while num_moves < max_moves and max_tile(board) < target and (legal := legal_moves(board)):
        traj.messages_and_choices.append({"role": "user", "content": render(board)})
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=traj.messages(), max_tokens=4, temperature=temperature,
            extra_body={"guided_choice": legal})
        choice = completion.choices[0]
        traj.messages_and_choices.append(choice)
        move = (choice.message.content or "").strip()
        if move not in legal:  # the grammar makes this impossible unless the reply was cut short
            raise ValueError(f"not a legal move: {move!r}")
        board = slide(board, move)
        spawn(board, rng)
        counts[move] += 1
        num_moves += 1
    tile = max_tile(board)
    traj.reward = math.log2(tile) / math.log2(target)
    traj.metrics.update({"max_tile": float(tile), "reached_target": float(tile >= target), "num_moves": float(num_moves),
                         **{f"share_{m}": n / max(num_moves, 1) for m, n in counts.items()}})
    return traj
