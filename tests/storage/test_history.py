import math

from tempering.storage import append_history, plot_history, read_history


def test_history_rows_round_trip_and_nan_becomes_null(tmp_path):
    path = tmp_path / "history.jsonl"
    append_history(path, {"step": 0, "train/reward": 0.5})
    append_history(path, {"step": 1, "train/reward": math.nan})
    with open(path, "a") as f:
        f.write('{"step": 2, "torn')  # a crash mid-write
    rows = read_history(path)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["train/reward"] is None
    assert "recorded_at" in rows[0]


def test_plot_writes_a_png(tmp_path):
    rows = [{"step": s, "train/reward": s / 10} for s in range(5)] + [{"step": 4, "val/reward": 0.6}]
    out = plot_history({"m": rows}, tmp_path / "plots" / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resume_before_logged_steps_leaves_their_rows_out_of_what_is_read(tmp_path):
    from tempering.storage import mark_resume

    path = tmp_path / "history.jsonl"
    for step, reward in [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)]:  # steps 2 and 3 were never saved
        append_history(path, {"step": step, "train/reward": reward})
    assert not mark_resume(path, 3)  # nothing logged after step 3: no marker
    assert mark_resume(path, 1)  # registered again, the model resumes at its last checkpoint, step 1
    append_history(path, {"step": 2, "train/reward": 0.9})  # step 2 trained again
    assert [(r["step"], r["train/reward"]) for r in read_history(path)] == [(0, 0.1), (1, 0.2), (2, 0.9)]
    assert len(path.read_text().splitlines()) == 6  # nothing removed from the file
    assert not mark_resume(path, 2)
