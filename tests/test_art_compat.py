"""ART's module paths, helpers and options under `import tempering as art` (no model needed here)."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import re
import warnings
from pathlib import Path

import pytest
import torch
from openai.types.chat.chat_completion import Choice

import tempering as art
from tempering.backends import art_options
from tempering.backends.art_mapping import ArtOptionWarning, resolve_internal_config, train_config_from_options
from tempering.errors import ConfigError, TemperingError, UnknownOptionError, UnsupportedOptionError

COMPATIBILITY_PAGE = Path(__file__).parents[1] / "docs" / "guides" / "art-compatibility.md"


@pytest.mark.parametrize("path, name", [
    ("tempering.local", "LocalBackend"), ("tempering.local.backend", "LocalBackend"),
    ("tempering.trajectories", "Trajectory"), ("tempering.trajectories", "TrajectoryGroup"),
    ("tempering.types", "Messages"), ("tempering.types", "TrainConfig"),
    ("tempering.gather", "gather_trajectory_groups"), ("tempering.utils", "iterate_dataset"),
    ("tempering.utils", "limit_concurrency"), ("tempering.utils", "get_trajectory_messages"),
    ("tempering.utils", "retry"), ("tempering.dev", "InternalModelConfig"), ("tempering.dev", "EngineArgs"),
    ("tempering.dev", "InitArgs"), ("tempering.dev", "PeftArgs"), ("tempering.dev", "TrainerArgs"),
    ("tempering.dev", "TrainConfig"), ("tempering", "retry"), ("tempering", "dev"),
])
def test_art_module_paths_resolve_to_tempering_objects(path, name):
    assert getattr(importlib.import_module(path), name) is not None


def test_art_local_backend_is_the_local_backend():
    from tempering.local import LocalBackend as A
    from tempering.local.backend import LocalBackend as B

    assert A is B is art.LocalBackend


# ---- retry -------------------------------------------------------------------------------------


def test_retry_calls_an_async_function_again_until_it_succeeds_with_growing_delays():
    calls, seen = [], []

    @art.retry(max_attempts=4, delay=0.01, backoff_factor=3.0, exceptions=(KeyError,),
               on_retry=lambda exc, attempt: seen.append((type(exc).__name__, attempt)))
    async def flaky(x):
        calls.append(asyncio.get_running_loop().time())
        if len(calls) < 3:
            raise KeyError(x)
        return x * 2

    assert asyncio.run(flaky(21)) == 42
    assert seen == [("KeyError", 1), ("KeyError", 2)]
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.01 and gaps[1] >= 0.03  # delay, then delay * backoff_factor


def test_retry_reraises_after_max_attempts_and_never_retries_other_exceptions():
    attempts = []

    @art.retry(max_attempts=2, delay=0, exceptions=ValueError)  # a bare class, as ART's 2048 notebook passes
    def always(kind):
        attempts.append(kind)
        raise kind("boom")

    with pytest.raises(ValueError, match="boom"):
        always(ValueError)
    assert len(attempts) == 2
    with pytest.raises(TypeError):
        always(TypeError)
    assert len(attempts) == 3


def test_retry_keeps_a_coroutine_function_a_coroutine_function():
    import inspect

    @art.retry(exceptions=(RuntimeError,))
    async def rollout():
        return 1

    assert inspect.iscoroutinefunction(rollout) and rollout.__name__ == "rollout"


# ---- iterate_dataset ---------------------------------------------------------------------------


def test_iterate_dataset_covers_every_item_each_epoch_in_a_per_epoch_order():
    batches = list(art.utils.iterate_dataset(list(range(10)), groups_per_step=4, num_epochs=2, use_tqdm=False))
    assert [b.step for b in batches] == list(range(6))
    assert [(b.epoch, b.epoch_step) for b in batches] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [len(b.items) for b in batches] == [4, 4, 2, 4, 4, 2]
    for epoch in (0, 1):
        assert sorted(x for b in batches if b.epoch == epoch for x in b.items) == list(range(10))
    assert [x for b in batches[:3] for x in b.items] != [x for b in batches[3:] for x in b.items]


def test_art_helpers_take_their_arguments_by_position_as_in_art():
    """ART's signatures allow positional arguments: `iterate_dataset(data, 4)`, `retry(5)`,
    `limit_concurrency(2, key_fn)`."""
    assert [b.items for b in art.utils.iterate_dataset(list(range(4)), 2, 1, 0, False)] == \
        [b.items for b in art.utils.iterate_dataset(list(range(4)), groups_per_step=2, use_tqdm=False)]
    calls = []

    @art.retry(3, 0)
    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ValueError
        return "ok"

    assert flaky() == "ok" and len(calls) == 3
    art.utils.limit_concurrency(2, lambda *a, **k: "key")


def test_engine_config_may_be_a_dict_of_its_fields_and_a_wrong_key_is_named():
    from tempering.backends.art_mapping import as_engine_config
    from tempering.engine import EngineConfig

    assert as_engine_config({"max_num_seqs": 8}, 256) == EngineConfig(max_num_seqs=8)
    assert as_engine_config(None, 64) == EngineConfig(max_num_seqs=64)
    with pytest.raises(art.UnknownOptionError, match="max_seqs"):
        as_engine_config({"max_seqs": 8}, 256)
    with pytest.raises(art.ConfigError, match="EngineConfig"):
        as_engine_config("max_num_seqs=8", 256)


def test_iterate_dataset_resumes_at_initial_step_with_the_same_batches_and_leaves_random_alone():
    import random

    data = [f"s{i}" for i in range(7)]
    full = list(art.utils.iterate_dataset(data, groups_per_step=2, num_epochs=3, use_tqdm=False))
    state = random.getstate()
    resumed = list(art.utils.iterate_dataset(data, groups_per_step=2, num_epochs=3, initial_step=5, use_tqdm=False))
    assert random.getstate() == state
    assert [(b.step, b.items) for b in resumed] == [(b.step, b.items) for b in full[5:]]
    items, epoch, step, epoch_step = resumed[0]  # ART's older tuple form
    assert (items, epoch, step, epoch_step) == (full[5].items, 1, 5, 1)


# ---- limit_concurrency -------------------------------------------------------------------------


def test_limit_concurrency_bounds_concurrent_calls_per_key():
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    @art.utils.limit_concurrency(2, derive_key=lambda host, i: host)
    async def call(host, i):
        running[host] = running.get(host, 0) + 1
        peak[host] = max(peak.get(host, 0), running[host])
        await asyncio.sleep(0.01)
        running[host] -= 1
        return i

    async def main():
        return await asyncio.gather(*(call(h, i) for i in range(6) for h in ("a", "b")))

    assert sorted(asyncio.run(main())) == sorted(list(range(6)) * 2)
    assert peak == {"a": 2, "b": 2}


def test_limit_concurrency_refuses_a_sync_function():
    with pytest.raises(TypeError, match="async"):
        art.utils.limit_concurrency(1)(lambda: None)


# ---- get_trajectory_messages -------------------------------------------------------------------


def test_get_trajectory_messages_turns_choices_into_assistant_text():
    choice = Choice.model_validate({"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "B2"}})
    t = art.Trajectory(messages_and_choices=[{"role": "system", "content": "play"}, choice], reward=0)
    assert art.utils.get_trajectory_messages(t) == [
        {"role": "system", "content": "play"}, {"role": "assistant", "content": "B2"}]


# ---- the table of ART options ------------------------------------------------------------------


def test_internal_config_maps_engine_init_peft_and_trainer_args():
    options = resolve_internal_config(art.dev.InternalModelConfig(
        engine_args=art.dev.EngineArgs(gpu_memory_utilization=0.6, max_num_seqs=8, enable_prefix_caching=False,
                                       enforce_eager=True),
        init_args=art.dev.InitArgs(max_seq_length=512),
        peft_args=art.dev.PeftArgs(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        trainer_args=art.dev.TrainerArgs(max_grad_norm=0.1, weight_decay=0.1),
    ))
    assert options.engine == {"gpu_memory_fraction": 0.6, "max_num_seqs": 8, "enable_prefix_caching": False,
                              "use_cuda_graphs": False}
    assert options.max_seq_len == 512
    assert options.lora == {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    assert options.train == {"max_grad_norm": 0.1, "weight_decay": 0.1}


def test_the_models_dtype_maps_from_vllms_and_unsloths_names_and_auto_keeps_the_default():
    assert resolve_internal_config({"engine_args": {"dtype": "float32"}}).dtype == "float32"
    assert resolve_internal_config({"engine_args": {"dtype": "half"}}).dtype == "float16"
    assert resolve_internal_config({"init_args": {"dtype": torch.bfloat16}}).dtype == "bfloat16"
    assert resolve_internal_config({"engine_args": {"dtype": "auto"}, "init_args": {"dtype": None}}).dtype is None
    # engine_args (vLLM's, which samples) wins over init_args (Unsloth's)
    assert resolve_internal_config({"init_args": {"dtype": "bfloat16"}, "engine_args": {"dtype": "float32"}}).dtype == \
        "float32"
    with pytest.raises(UnsupportedOptionError, match=r"dtype='float64' is not supported; use 'auto', 'bfloat16'"):
        resolve_internal_config({"engine_args": {"dtype": "float64"}})


def test_ignored_options_get_one_warning_that_names_each_of_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_internal_config({"engine_args": {"num_scheduler_steps": 1, "swap_space": 4},
                                 "tinker_args": {"renderer_name": "x"}, "some_future_key": 1})
    messages = [str(w.message) for w in caught if issubclass(w.category, ArtOptionWarning)]
    assert len(messages) == 1
    for name in ("engine_args.num_scheduler_steps", "engine_args.swap_space", "tinker_args", "some_future_key"):
        assert name in messages[0]


def test_a_result_changing_option_is_refused_with_an_error_that_names_it_and_the_fix():
    with pytest.raises(UnsupportedOptionError) as info:
        resolve_internal_config({"peft_args": {"r": 8, "use_rslora": True}})
    assert isinstance(info.value, ValueError) and isinstance(info.value, TemperingError)
    assert "peft_args.use_rslora=True" in str(info.value) and "Leave it out or set it to False" in str(info.value)
    resolve_internal_config({"peft_args": {"use_rslora": False}})  # ART's default is accepted silently


def test_backend_train_options_map_to_train_config():
    config = train_config_from_options({"learning_rate": 1e-5, "scale_rewards": False, "importance_sampling_level":
                                        "sequence", "logprob_calculation_chunk_size": 8, "verbose": True})
    assert (config.learning_rate, config.normalize_advantages, config.loss_fn, config.logprob_chunk_size) == (
        1e-5, False, "gspo", 16)
    masked = train_config_from_options({"loss_fn": "ppo", "epsilon": 0.1, "mask_prob_ratio": True})
    assert masked.importance_ratio_mask == pytest.approx((0.9, 1.1))
    with pytest.raises(UnknownOptionError) as info:
        train_config_from_options({"learning_rte": 1e-5})
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    with pytest.raises(UnsupportedOptionError, match="advantage_balance"):
        train_config_from_options({"advantage_balance": 0.5})


def test_model_train_config_dict_goes_through_the_same_table():
    base = art.TrainConfig(learning_rate=3e-5)
    merged = train_config_from_options({"logprob_calculation_chunk_size": 64}, base=base)
    assert (merged.learning_rate, merged.logprob_chunk_size) == (3e-5, 64)


def test_trainable_model_takes_internal_config_and_art_lora_dicts():
    model = art.TrainableModel(name="m", project="p", base_model="SmolLM2-135M-Instruct",
                               lora_config={"rank": 4, "alpha": 8, "bias": "none"},
                               _internal_config={"engine_args": {"max_num_seqs": 2}})
    assert model._internal_config == {"engine_args": {"max_num_seqs": 2}}
    assert (model.lora_config.rank, model.lora_config.alpha) == (4, 8)
    assert "_internal_config" not in model.model_dump()
    model._internal_config = art.dev.InternalModelConfig(init_args=art.dev.InitArgs(max_seq_length=256))  # 2048 notebook
    assert resolve_internal_config(model._internal_config).max_seq_len == 256
    with pytest.raises(UnsupportedOptionError, match="full_finetuning"):
        art.TrainableModel(name="m", project="p", base_model="b", _internal_config={"init_args": {"full_finetuning": True}})


def test_local_backend_accepts_arts_constructor_options():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = art.LocalBackend(in_process=True, path="unused-dir", gpu_cost_per_hour_usd=3.0)
    assert any("gpu_cost_per_hour_usd" in str(w.message) for w in caught)
    backend._close_sync()


def test_the_docs_compatibility_page_is_generated_from_the_table():
    text = COMPATIBILITY_PAGE.read_text()
    match = re.search(r"<!-- art-options:begin -->\n(.*?)<!-- art-options:end -->", text, re.DOTALL)
    assert match, "docs/guides/art-compatibility.md lacks the <!-- art-options:begin/end --> markers"
    assert match.group(1) == art_options.compatibility_markdown(), (
        "the ART options table of docs/guides/art-compatibility.md is out of date: run `python -c \"from "
        "tempering.backends.art_options import update_readme; update_readme('docs/guides/art-compatibility.md')\"`")


def test_every_table_row_names_a_known_section_and_refused_rows_name_accepted_values():
    for option in art_options.ART_OPTIONS:
        assert option.section in art_options.SECTIONS
        assert (option.status == "refused") == bool(option.accepts), option
        assert (option.to is not None) <= (option.status in ("mapped", "differs")), option
    keys = [(o.section, o.name) for o in art_options.ART_OPTIONS]
    assert len(keys) == len(set(keys))
