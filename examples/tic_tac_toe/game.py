"""Tic-tac-toe on a 3x3 board whose cells are numbered 1-9, row by row.

The board is a list of 9 strings: "X", "O" or "" (empty). Rendered for the model, an empty
cell shows its number, so the moves still open are visible on the board itself:

    X | 2 | 3
    4 | O | 6
    7 | 8 | 9
"""

from __future__ import annotations

import random

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def new_board() -> list[str]:
    return [""] * 9


def render(board: list[str]) -> str:
    cells = [mark or str(i + 1) for i, mark in enumerate(board)]
    return "\n".join(" | ".join(cells[r * 3:r * 3 + 3]) for r in range(3))


def free_cells(board: list[str]) -> list[int]:
    """The numbers (1-9) of the empty cells."""
    return [i + 1 for i, mark in enumerate(board) if not mark]


def winner(board: list[str]) -> str | None:
    """"X" or "O" if that player has three in a row, "draw" on a full board, else None."""
    for a, b, c in LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return "draw" if all(board) else None


def random_move(board: list[str], rng: random.Random) -> int:
    return rng.choice(free_cells(board))


def blocking_move(board: list[str], rng: random.Random, *, me: str = "O", them: str = "X") -> int:
    """Win if one move wins, else block the opponent's two in a row, else play at random."""
    for player in (me, them):
        for a, b, c in LINES:
            line = [board[a], board[b], board[c]]
            if line.count(player) == 2 and line.count("") == 1:
                return (a, b, c)[line.index("")] + 1
    return random_move(board, rng)
