"""`tempering demo`'s options are checked before anything loads."""

from __future__ import annotations

from typer.testing import CliRunner

from tempering.cli import app


def test_dedicated_without_several_gpus_and_zero_gpus_are_refused_with_the_fix(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--dedicated", "--path", str(tmp_path)])
    assert result.exit_code == 2 and "--gpus 2" in result.output
    result = runner.invoke(app, ["demo", "--gpus", "0", "--path", str(tmp_path)])
    assert result.exit_code == 2 and "--gpus" in result.output
    assert not any(tmp_path.iterdir())  # nothing was started


def test_an_unknown_task_is_refused_and_a_pretrained_built_in_model_gets_the_task_it_can_learn(tmp_path):
    from tempering.demo.run import default_task

    result = CliRunner().invoke(app, ["demo", "--task", "algebra", "--path", str(tmp_path)])
    assert result.exit_code == 2 and "addition" in result.output and "repeat-word" in result.output
    assert not any(tmp_path.iterdir())
    # `tempering demo --base-model gemma-3-270m` alone: the pretrained model cannot follow the addition prompt
    assert default_task("gemma-3-270m") == default_task("google/gemma-3-270m") == "repeat-word"
    assert default_task("SmolLM2-135M-Instruct") == default_task(str(tmp_path)) == "addition"
