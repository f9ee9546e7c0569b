"""The demo's tasks: scenarios stay held out, rewards are what the docstrings say."""

from __future__ import annotations

from tempering.demo.task import AdditionTask, RepeatWordTask, WordScenario


def test_repeat_word_rewards_one_over_one_plus_the_words_index_and_zero_when_missing():
    task, river = RepeatWordTask(), WordScenario("river")
    assert river.prompt == "river"
    assert task.reward("River.", river) == 1.0
    assert task.reward('Say the word "river".', river) == 0.25  # the echo of an instruction
    assert task.reward("rivers flow", river) == 0.0  # whole words only


def test_training_scenarios_never_include_held_out_ones():
    for task in (AdditionTask(), RepeatWordTask()):
        held_out = set(task.scenarios(64, seed=1))
        assert len(held_out) == 64
        for step in range(12):
            assert not held_out & set(task.scenarios(4, seed=step, exclude=held_out))
