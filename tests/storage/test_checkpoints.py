import os

import pytest

from tempering.errors import CheckpointError, ConfigError
from tempering.storage import (
    ModelPaths,
    delete_checkpoints,
    drop_training_state,
    latest_step,
    list_checkpoints,
    recover_checkpoints,
    set_aside,
    verify_checkpoint,
    write_atomically,
)


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


def _write_checkpoint(tag, *, optimizer=b"moments" * 100):
    def write(tmp):
        _write_adapter(tag)(tmp)
        (tmp / "adapter_model.safetensors").write_bytes(tag.encode() * 100)
        (tmp / "optimizer.pt").write_bytes(optimizer)
        (tmp / "rng.pt").write_bytes(b"rng")
    return write


def test_a_truncated_or_corrupted_file_is_named_and_a_dropped_optimizer_state_is_not_missing(tmp_path):
    ckpt = write_atomically(tmp_path / "checkpoints" / "0001", _write_checkpoint("a"))
    verify_checkpoint(ckpt)
    optimizer = ckpt / "optimizer.pt"
    data = optimizer.read_bytes()
    optimizer.write_bytes(data[: len(data) // 2])  # as an interrupted copy leaves it
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is truncated .*350 bytes; 700 were written"):
        verify_checkpoint(ckpt)
    verify_checkpoint(ckpt, training_state=False)  # serving a past step reads the adapter only
    optimizer.write_bytes(data[:-1] + b"X")  # same size, one byte changed
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is corrupted"):
        verify_checkpoint(ckpt)
    optimizer.unlink()  # dropped: only the newest checkpoint keeps it
    verify_checkpoint(ckpt)
    (ckpt / "adapter_config.json").unlink()
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        verify_checkpoint(ckpt)


def test_a_checkpoint_without_a_manifest_gets_its_safetensors_header_checked(tmp_path):
    from safetensors.torch import save_file
    import torch

    ckpt = tmp_path / "0001"
    ckpt.mkdir()
    (ckpt / "adapter_config.json").write_text("{}")
    save_file({"w": torch.ones(64)}, ckpt / "adapter_model.safetensors")
    verify_checkpoint(ckpt)
    weights = ckpt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors cannot be read"):
        verify_checkpoint(ckpt)


def test_only_the_newest_checkpoint_keeps_its_training_state(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        write_atomically(ckpts / f"{step:04d}", _write_checkpoint(str(step)))
    dropped = drop_training_state(ckpts, 3)
    assert sorted(p.relative_to(ckpts).as_posix() for p in dropped) == [
        "0001/optimizer.pt", "0001/rng.pt", "0002/optimizer.pt", "0002/rng.pt"]
    assert (ckpts / "0003" / "optimizer.pt").is_file()
    for step in (1, 2, 3):
        verify_checkpoint(ckpts / f"{step:04d}")


def test_recovery_restores_a_checkpoint_whose_replacement_never_arrived_and_deletes_the_rest(tmp_path):
    ckpts = tmp_path / "checkpoints"
    write_atomically(ckpts / "0001", _write_checkpoint("1"))
    write_atomically(ckpts / "0002", _write_checkpoint("2"))
    # a kill between write_atomically's two renames while replacing 0002, one inside a write of
    # 0003, and one inside delete_checkpoints
    os.rename(ckpts / "0002", ckpts / ".old-0002-aaaa")
    (ckpts / ".tmp-0002-bbbb").mkdir()
    (ckpts / ".tmp-0003-cccc").mkdir()
    (ckpts / ".tmp-0003-cccc" / "adapter_config.json").write_text("{")
    os.rename(ckpts / "0001", ckpts / ".del-0001-dddd")
    done = recover_checkpoints(ckpts)
    assert len(done) == 4 and "restored" in done[1]
    assert sorted(p.name for p in ckpts.iterdir()) == ["0002"]
    verify_checkpoint(ckpts / "0002")
    assert recover_checkpoints(ckpts) == []


def test_a_damaged_checkpoint_is_set_aside_under_a_name_that_is_never_listed(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for _ in range(2):
        write_atomically(ckpts / "0001", _write_checkpoint("1"))
        set_aside(ckpts / "0001")
    assert sorted(p.name for p in ckpts.iterdir()) == ["0001.damaged", "0001.damaged-2"]
    assert list_checkpoints(ckpts) == []


def test_a_write_error_for_want_of_space_says_so_and_names_the_fix(tmp_path):
    def full(tmp):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(CheckpointError, match="is full: free space, or keep fewer checkpoints"):
        write_atomically(tmp_path / "0001", full)
