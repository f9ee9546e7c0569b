"""examples/tic_tac_toe: the game rules, and one training step of the recipe on the default model."""

from __future__ import annotations

import random

from conftest import history, load_module, run_recipe

game = load_module("tic_tac_toe/game.py", "ttt_game")


def test_winner_finds_rows_columns_diagonals_and_draws():
    board = game.new_board()
    assert game.winner(board) is None
    for cells, mark in [((0, 1, 2), "X"), ((2, 5, 8), "O"), ((2, 4, 6), "X")]:
        board = game.new_board()
        for c in cells:
            board[c] = mark
        assert game.winner(board) == mark
    assert game.winner(list("XOXXOOOXX")) == "draw"


def test_render_numbers_the_empty_cells_and_free_cells_agrees():
    board = game.new_board()
    board[0], board[4] = "X", "O"
    assert game.render(board) == "X | 2 | 3\n4 | O | 6\n7 | 8 | 9"
    assert game.free_cells(board) == [2, 3, 4, 6, 7, 8, 9]


def test_blocking_opponent_wins_first_then_blocks():
    rng = random.Random(0)
    board = ["X", "X", "", "O", "O", "", "", "", ""]
    assert game.blocking_move(board, rng) == 6  # its own win beats blocking X at 3
    board = ["X", "X", "", "O", "", "", "", "", ""]
    assert game.blocking_move(board, rng) == 3


def test_recipe_trains_one_step(tmp_path):
    out = run_recipe("tic_tac_toe", tmp_path, "--steps", "1", "--groups-per-step", "1", "--group-size", "2",
                     "--num-val", "1", "--name", "smoke", "--path", str(tmp_path / "runs"))
    assert "win+draw" in out and "->" in out
    rows = history(tmp_path / "runs", "tic-tac-toe", "smoke")
    (train,) = [r for r in rows if "train/reward" in r]  # logged at the step of the policy that played
    assert train["step"] == 0 and train["train/num_trajectories"] == 2
    assert [r["step"] for r in rows if "val/win_or_draw" in r] == [0, 1]
    assert (tmp_path / "runs/tic-tac-toe/models/smoke/checkpoints/0001/adapter_model.safetensors").is_file()
