"""The agent plays 2048 on a 3x3 board until it reaches 64, makes an illegal move, gets stuck or makes 60 moves.

Each turn the user message is the board and the legal moves (those that change the board); the
agent answers with one of the four moves (`guided_choice` fixes that format). An illegal move
ends the game, so there are two things to learn: to pick a move from the legal list (the
untrained model often does not), then which legal move to prefer (keeping the big tiles in one
corner reaches 64 about three times as often as random legal moves).

Reward: log2(max tile) / log2(target) (0.5 for 8, 0.67 for 16, 0.83 for 32, 1.0 for 64), plus
0.01 per legal move. The second term breaks ties: early on most games of a group end with the same
tile, and a group whose rewards are all equal teaches nothing; the longer game is the better one.
"""

from __future__ import annotations

import math
import random

from game import MOVES, legal_moves, max_tile, new_board, render, slide, spawn

import tempering as art

SYSTEM = "You play 2048. Reply with one of the legal moves."


async def rollout(model: art.Model, seed: int, *, size: int = 3, target: int = 64, max_moves: int = 60,
                  temperature: float = 1.0) -> art.Trajectory:
    """One game; `seed` drives where the new tiles appear."""
    rng = random.Random(seed)
    board = new_board(size, rng)
    traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}], metadata={"seed": seed})
    counts = dict.fromkeys(MOVES, 0)
    num_moves, is_illegal = 0, False
    while num_moves < max_moves and max_tile(board) < target and (legal := legal_moves(board)):
        traj.messages_and_choices.append({"role": "user", "content": f"{render(board)}\nlegal moves: {', '.join(legal)}"})
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=traj.messages(), max_tokens=4, temperature=temperature,
            extra_body={"guided_choice": list(MOVES)})
        choice = completion.choices[0]
        traj.messages_and_choices.append(choice)
        move = (choice.message.content or "").strip()
        if move not in legal:
            is_illegal = True
            break
        board = slide(board, move)
        spawn(board, rng)
        counts[move] += 1
        num_moves += 1
    tile = max_tile(board)
    traj.reward = math.log2(tile) / math.log2(target) + 0.01 * num_moves
    traj.metrics.update({"max_tile": float(tile), "reached_target": float(tile >= target), "illegal": float(is_illegal),
                         "num_moves": float(num_moves), **{f"share_{m}": n / max(num_moves, 1) for m, n in counts.items()}})
    return traj
