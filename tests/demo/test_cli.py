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
