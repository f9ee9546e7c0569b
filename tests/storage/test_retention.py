from tempering.storage import retained_steps


def test_the_newest_k_and_the_best_scored_saved_step_are_kept():
    history = [{"step": 2, "val/reward": 0.9}, {"step": 4, "val/reward": 0.5}, {"step": 6, "train/reward": 1.0},
               {"step": 1, "val/reward": 0.95}]  # step 1 has no checkpoint any more
    saved = [2, 3, 4, 5, 6, 7]
    assert retained_steps(saved, history, keep_last=3, best_metric="val/reward") == {2, 5, 6, 7}
    assert retained_steps(saved, history, keep_last=3, best_metric=None) == {5, 6, 7}
    assert retained_steps(saved, history, keep_last=3, best_metric="no/such") == {5, 6, 7}
    assert retained_steps(saved, [], keep_last=10, best_metric="val/reward") == set(saved)


def test_a_tie_goes_to_the_later_step_and_non_numbers_never_win():
    history = [{"step": 1, "val/reward": 0.5}, {"step": 3, "val/reward": 0.5}, {"step": 2, "val/reward": True},
               {"step": 4, "val/reward": None}]
    assert retained_steps([1, 2, 3, 4, 5], history, keep_last=1, best_metric="val/reward") == {3, 5}
