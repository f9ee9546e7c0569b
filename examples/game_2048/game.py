"""2048 on a small square board (3x3 by default), with the usual rules.

A move slides every tile as far as it goes in one direction; two equal tiles that meet merge
into one of twice the value (each tile merges at most once per move). A move that changes
nothing is not legal. After each legal move a 2 (90%) or a 4 (10%) appears on a random empty
cell. The board is a list of rows of ints, 0 for empty.
"""

from __future__ import annotations

import random

MOVES = ("up", "down", "left", "right")


def new_board(size: int, rng: random.Random) -> list[list[int]]:
    board = [[0] * size for _ in range(size)]
    spawn(board, rng)
    spawn(board, rng)
    return board


def spawn(board: list[list[int]], rng: random.Random) -> None:
    empty = [(r, c) for r, row in enumerate(board) for c, tile in enumerate(row) if not tile]
    r, c = rng.choice(empty)
    board[r][c] = 2 if rng.random() < 0.9 else 4


def _slide_left(row: list[int]) -> list[int]:
    tiles = [t for t in row if t]
    out: list[int] = []
    while tiles:
        if len(tiles) > 1 and tiles[0] == tiles[1]:
            out.append(2 * tiles[0])
            tiles = tiles[2:]
        else:
            out.append(tiles.pop(0))
    return out + [0] * (len(row) - len(out))


def slide(board: list[list[int]], move: str) -> list[list[int]]:
    """The board after `move`, before a new tile appears (a new list; `board` is not changed)."""
    transpose = move in ("up", "down")
    reverse = move in ("right", "down")
    rows = [list(col) for col in zip(*board)] if transpose else [row[:] for row in board]
    rows = [_slide_left(row[::-1])[::-1] if reverse else _slide_left(row) for row in rows]
    return [list(col) for col in zip(*rows)] if transpose else rows


def legal_moves(board: list[list[int]]) -> list[str]:
    return [m for m in MOVES if slide(board, m) != board]


def max_tile(board: list[list[int]]) -> int:
    return max(max(row) for row in board)


def render(board: list[list[int]]) -> str:
    return "\n".join(" ".join(str(t) if t else "." for t in row) for row in board)
