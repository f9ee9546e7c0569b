"""The agent plays X against a random opponent, one move per turn, in one growing conversation.

Each turn the user message is the board (empty cells show their number); the agent answers
`<move>N</move>`. A grammar (`guided_regex`) fixes that format, so what is left to learn is the
move itself: first a cell that is still empty (an occupied cell ends the game as invalid), then
a cell that wins. The untrained model picks an occupied cell in about 70% of its games.

Reward: win 1, draw 0.5, loss 0; an invalid move ends the game with -1 + 0.2 per valid move made
before it (partial credit for staying in the game).
"""

from __future__ import annotations

import random
import re

from game import blocking_move, free_cells, new_board, random_move, render, winner

import tempering as art

SYSTEM = "You are X in tic-tac-toe. Empty cells show their number. Reply <move>N</move> with an empty cell's number."
MOVE_REGEX = r"<move>[1-9]</move>"
_MOVE = re.compile(r"<move>([1-9])</move>")
OPPONENTS = {"random": random_move, "blocking": blocking_move}


async def rollout(model: art.Model, seed: int, *, opponent: str = "random", temperature: float = 1.0) -> art.Trajectory:
    """One game; `seed` drives the opponent's random choices."""
    rng = random.Random(seed)
    board = new_board()
    traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}], metadata={"seed": seed})
    num_valid_moves, result = 0, None
    while result is None:
        traj.messages_and_choices.append({"role": "user", "content": render(board)})
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=traj.messages(), max_tokens=10, temperature=temperature,
            extra_body={"guided_regex": MOVE_REGEX})
        choice = completion.choices[0]
        traj.messages_and_choices.append(choice)
        found = _MOVE.fullmatch((choice.message.content or "").strip())
        cell = int(found.group(1)) if found else 0
        if cell not in free_cells(board):
            result = "invalid"
            break
        board[cell - 1] = "X"
        num_valid_moves += 1
        result = winner(board)
        if result is None:
            board[OPPONENTS[opponent](board, rng) - 1] = "O"
            result = winner(board)
    traj.reward = {"X": 1.0, "draw": 0.5, "O": 0.0, "invalid": -1.0 + 0.2 * num_valid_moves}[result]
    traj.metrics.update({
        "win": float(result == "X"), "draw": float(result == "draw"), "loss": float(result == "O"),
        "invalid": float(result == "invalid"), "win_or_draw": float(result in ("X", "draw")),
        "num_valid_moves": float(num_valid_moves),
    })
    return traj
