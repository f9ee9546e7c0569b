"""examples/email_agent: the inbox and its search, and one training step of the recipe on the default model."""

from __future__ import annotations

from conftest import history, load_module, run_recipe

inbox = load_module("email_agent/inbox.py", "email_inbox")


def test_each_answer_appears_in_exactly_its_own_email():
    db, questions = inbox.build_inbox(seed=0)
    assert db.execute("SELECT count(*) FROM emails").fetchone()[0] == 300
    assert len({q.question for q in questions}) == len(questions) == 60
    for q in questions:
        holders = db.execute("SELECT id FROM emails WHERE instr(body, ?) > 0", (q.answer,)).fetchall()
        assert holders == [(q.email_id,)], q


def test_search_ranks_the_right_email_first_for_the_questions_words():
    db, questions = inbox.build_inbox(seed=0)
    for q in questions:
        results = inbox.search(db, q.question)
        assert results[0]["id"] == q.email_id and q.answer in results[0]["snippet"]
    assert inbox.search(db, "  !!  ") == [] and inbox.search(db, "zzzqqq") == []
    assert inbox.read(db, questions[0].email_id)["body"].count(questions[0].answer) == 1
    assert inbox.read(db, 10_000) is None


def test_recipe_trains_one_step(tmp_path):
    out = run_recipe("email_agent", tmp_path, "--steps", "1", "--groups-per-step", "1", "--group-size", "2",
                     "--num-val", "1", "--val-samples", "1", "--max-turns", "2", "--name", "smoke", "--path", str(tmp_path / "runs"))
    assert "accuracy" in out and "->" in out
    rows = history(tmp_path / "runs", "email-agent", "smoke")
    (train,) = [r for r in rows if "train/reward" in r]  # logged at the step of the policy that played
    assert train["step"] == 0 and train["train/num_trajectories"] == 2
    assert train["train/answered"] == 1.0  # the last turn is a forced return_final_answer call
    assert [r["step"] for r in rows if "val/correct" in r] == [0, 1]
    assert (tmp_path / "runs/email-agent/models/smoke/checkpoints/0001/adapter_model.safetensors").is_file()
