"""examples/game_2048: the game rules, and one training step of the recipe on the default model."""

from __future__ import annotations

import random

from conftest import history, load_module, run_recipe

game = load_module("game_2048/game.py", "game_2048_rules")


def test_slide_merges_each_tile_once_toward_the_move():
    board = [[2, 2, 4], [0, 4, 4], [8, 0, 8]]
    assert game.slide(board, "left") == [[4, 4, 0], [8, 0, 0], [16, 0, 0]]
    assert game.slide(board, "right") == [[0, 4, 4], [0, 0, 8], [0, 0, 16]]
    assert game.slide(board, "up") == [[2, 2, 8], [8, 4, 8], [0, 0, 0]]
    assert game.slide(board, "down") == [[0, 0, 0], [2, 2, 8], [8, 4, 8]]
    assert game.slide([[2, 2, 2, 2]] * 4, "left")[0] == [4, 4, 0, 0]
    assert board == [[2, 2, 4], [0, 4, 4], [8, 0, 8]]  # not changed in place


def test_legal_moves_are_those_that_change_the_board():
    assert game.legal_moves([[2, 4, 8], [4, 8, 2], [8, 2, 4]]) == []
    assert game.legal_moves([[2, 0, 0], [0, 0, 0], [0, 0, 0]]) == ["down", "right"]


def test_new_board_has_two_tiles_and_spawn_fills_an_empty_cell():
    board = game.new_board(3, random.Random(0))
    assert sum(t > 0 for row in board for t in row) == 2
    game.spawn(board, random.Random(1))
    assert sum(t in (2, 4) for row in board for t in row) == 3
    assert game.render([[2, 0, 4], [0, 0, 0], [16, 0, 0]]) == "2 . 4\n. . .\n16 . ."


def test_recipe_trains_one_step(tmp_path):
    out = run_recipe("game_2048", tmp_path, "--steps", "1", "--groups-per-step", "1", "--group-size", "2",
                     "--num-val", "1", "--max-moves", "4", "--name", "smoke", "--path", str(tmp_path / "runs"))
    assert "average max tile" in out
    rows = history(tmp_path / "runs", "game-2048", "smoke")
    (train,) = [r for r in rows if "train/reward" in r]  # logged at the step of the policy that played
    assert train["step"] == 0 and train["train/num_trajectories"] == 2
    assert 0 <= train["train/num_moves"] <= 4 and 0 <= train["train/illegal"] <= 1
    val = [r for r in rows if "val/max_tile" in r]
    assert [r["step"] for r in val] == [0, 1] and all(4 <= r["val/max_tile"] <= 16 for r in val)
    assert (tmp_path / "runs/game-2048/models/smoke/checkpoints/0001/adapter_model.safetensors").is_file()
