import pytest
import torch

from tempering.errors import OutOfMemoryError
from tempering.training.memory_errors import is_out_of_memory, memory_knob_named
from tempering.types import TrainConfig


def test_allocation_failures_are_recognized_and_nothing_else():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 37281792 bytes. Error code 12 (Cannot allocate memory)")
    assert is_out_of_memory(cpu) and is_out_of_memory(MemoryError()) and is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("no"))


def test_the_error_names_the_micro_batch_knob_and_the_others_that_apply():
    config = TrainConfig(micro_batch_tokens=4096, gradient_checkpointing=False)
    with pytest.raises(OutOfMemoryError) as raised:
        with memory_knob_named(config, longest_tokens=3000, device=torch.device("cpu")):
            raise MemoryError
    message = str(raised.value)
    assert "out of host memory" in message and "micro_batch_tokens=4096" in message
    assert "micro_batch_tokens=2048 about halves" in message
    assert "gradient_checkpointing back on" in message and "the longest has 3000 tokens" in message
    assert raised.value.__cause__ is None  # the failed step's frames are not kept alive through it
    with pytest.raises(ValueError):  # anything else passes through
        with memory_knob_named(config, longest_tokens=1, device=torch.device("cpu")):
            raise ValueError("no")


def test_at_the_smallest_micro_batch_the_error_does_not_ask_for_a_smaller_one():
    config = TrainConfig(micro_batch_tokens=64)
    with pytest.raises(OutOfMemoryError) as raised:
        with memory_knob_named(config, longest_tokens=32, device=torch.device("cuda", 0)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(raised.value)
    assert "out of cuda:0 memory (OutOfMemoryError: CUDA out of memory." in message
    assert "lower TrainConfig" not in message and "free memory on the device" in message
