import pytest

from tempering.errors import CheckpointError, ConfigError
from tempering.storage import ModelPaths, delete_checkpoints, latest_step, list_checkpoints, write_atomically


def _write_adapter(tag):
    def write(tmp):
        (tmp / "adapter_config.json").write_text("{}")
        (tmp / "adapter_model.safetensors").write_bytes(b"")
        (tmp / "tag").write_text(tag)
    return write


def test_atomic_write_replaces_and_a_failed_write_leaves_the_old_checkpoint(tmp_path):
    final = tmp_path / "checkpoints" / "0001"
    write_atomically(final, _write_adapter("a"))
    assert (final / "tag").read_text() == "a"

    def broken(tmp):
        (tmp / "adapter_config.json").write_text("{")
        raise RuntimeError("disk full")

    with pytest.raises(CheckpointError, match="disk full"):
        write_atomically(final, broken)
    assert (final / "tag").read_text() == "a"
    assert [p.name for p in final.parent.iterdir()] == ["0001"]  # no temporary directory left


def test_latest_step_ignores_incomplete_and_foreign_directories(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 3):
        write_atomically(ckpts / f"{step:04d}", _write_adapter(str(step)))
    (ckpts / "0007").mkdir()  # no adapter inside: not a checkpoint
    (ckpts / "0008").mkdir()
    (ckpts / "0008" / "adapter_config.json").write_text("{}")  # a config without weights: neither
    (ckpts / ".tmp-0009-abcd").mkdir()
    assert [c.step for c in list_checkpoints(ckpts)] == [1, 3]
    assert latest_step(ckpts) == 3
    assert latest_step(tmp_path / "missing") == 0


def test_delete_keeps_the_requested_steps(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        write_atomically(ckpts / f"{step:04d}", _write_adapter(str(step)))
    assert delete_checkpoints(ckpts, [2, 4]) == [1, 3]
    assert [c.step for c in list_checkpoints(ckpts)] == [2, 4]
    # the highest saved step always stays (a live step 5 trained with save_checkpoint=False has none)
    assert delete_checkpoints(ckpts, [5]) == [2]
    assert [c.step for c in list_checkpoints(ckpts)] == [4]


@pytest.mark.parametrize("name", ["../evil", "a/b", "", ".hidden", "x" * 200, "name@3"])
def test_names_that_could_escape_the_root_are_rejected(tmp_path, name):
    with pytest.raises(ConfigError, match="not a valid name"):
        ModelPaths(tmp_path, "project", name)
