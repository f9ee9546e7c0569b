import gzip
import os

from tempering.storage import ModelPaths, compact_trajectories, read_trajectories, write_trajectories
from tempering.types import Trajectory


def _group(reward):
    return [Trajectory(messages_and_choices=[{"role": "user", "content": "hi " * 50}], reward=reward)]


def test_older_step_files_are_gzipped_and_read_back_whole(tmp_path):
    paths = ModelPaths(tmp_path, "p", "m")
    for step in range(3):
        write_trajectories(paths.trajectories("train", step), [_group(step)])
    split = paths.trajectories_dir / "train"
    assert sorted(p.name for p in split.iterdir()) == ["0000.jsonl.gz", "0001.jsonl.gz", "0002.jsonl"]
    for step in range(3):
        [record] = read_trajectories(paths.trajectories("train", step))
        assert record["reward"] == step and record["group"] == 0
    assert os.path.getsize(split / "0000.jsonl.gz") < os.path.getsize(split / "0002.jsonl") / 2
    # a step logged again after its compaction keeps both files, and both are read
    write_trajectories(paths.trajectories("train", 0), [_group(7)])
    assert [r["reward"] for r in read_trajectories(paths.trajectories("train", 0))] == [0, 7]


def test_a_compaction_killed_before_its_unlink_is_finished_and_read_once(tmp_path):
    split = tmp_path / "train"
    split.mkdir()
    (split / "0000.jsonl").write_text('{"reward": 1}\n')
    with gzip.open(split / "0000.jsonl.gz", "wb") as f:  # the rename happened, the unlink did not
        f.write(b'{"reward": 1}\n')
    assert [r["reward"] for r in read_trajectories(split / "0000.jsonl")] == [1]
    compact_trajectories(split, before_step=1)
    assert sorted(p.name for p in split.iterdir()) == ["0000.jsonl.gz"]
