"""Engine settings."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, fields

from ..errors import ConfigError

__all__ = ["EngineConfig"]

# each field's annotation -> the types its value may have (bool is an int in Python: not for int fields)
_TYPES = {"int": (numbers.Integral,), "int | None": (numbers.Integral, type(None)), "float": (numbers.Real,),
          "bool": (bool,), "str": (str,)}


@dataclass(slots=True)
class EngineConfig:
    """How the engine batches and how much KV cache it keeps.

    Attributes:
        max_num_seqs: most sequences in one step (prefill and decode together).
        max_num_batched_tokens: token budget of one step; longer prompts are prefilled in chunks.
        block_size: tokens per KV-cache block; None: 16 on a GPU (the decode kernel's pages), 4 on
            a CPU, where a block costs no kernel tile: an RL group's rollouts send the same short
            prompt, and each recomputes the prompt's last partial block, at most 3 tokens instead
            of 15 (`tempering demo`: 115 s against 130 s, benchmarks/RESULTS.md).
        num_kv_blocks: cache size in blocks; None sizes it from memory (below), at most 2**20 blocks.
        gpu_memory_fraction: on GPU, the share of the memory free after loading the weights that
            the KV cache takes (the rest is left to the trainer and activations).
        cpu_kv_cache_bytes: on CPU, the KV cache size.
        enable_prefix_caching: share the KV blocks of identical prompt prefixes.
        scheduling_policy: the order waiting requests start in: "fcfs", first come first served
            (vLLM's default); "lpm" (longest prefix match, SGLang's name): those whose prompt's
            prefix is cached first, e.g. an agent's next turn, which re-sends the conversation its
            last turn left in the cache (scheduler.py). Without a host tier, "lpm" saves prefill
            when conversations outgrow the KV cache and come back at once; with one, "fcfs" keeps
            more conversations running (benchmarks/RESULTS.md, agent RL).
        kv_offloading_size: host memory (GiB) for KV blocks evicted from the device cache, found
            again by prefix lookups and copied back instead of recomputed (block_manager.py,
            kv_offload.py); vLLM's name. 0: none. Agent workloads, whose conversations outgrow the
            device cache while their tools run, gain most. Pinned when the engine starts.
        cascade_attention: (CUDA) when every decode row of a step starts with the same cached
            blocks, at least 256 keys of them and 8 rows (vLLM's thresholds; an
            agent's system prompt and tool schemas, shared through the prefix cache), attention
            reads those keys once per tile of rows instead of once per row, then merges
            (layers/triton_attention.py); vLLM's and FlashInfer's name. Same attention, another
            order of the sums. Not in batch-invariant mode, nor for sliding-window layers.
        use_cuda_graphs: capture decode steps in CUDA graphs (GPU only).
        max_graph_batch_size: largest decode batch captured in a graph.
        batch_invariant: compute every token the same way whatever shares its batch and whether it
            is decoded, prefilled or scored afterwards (CUDA; the Llama family, Gemma 3, Qwen3-MoE): one tiling for every
            matrix product (layers/triton_matmul.py), attention of every query in one pass over its
            keys in fixed tiles, the LoRA kernels' tiles fixed, no spare-rows path. The trainer then
            takes its logprobs' values from the engine (`Engine.score`), equal bit for bit to the
            sampled ones: exact on-policy RL ("batch-invariant inference"). Slower decoding.
        tensor_parallel_size: ranks (GPUs) that one model is split over (modeling/tensor_parallel.py), the
            name vLLM and SGLang use; 1: the whole model on one device. The engine checks it
            against the model's shards.
        load_format: "auto": the base model's weights from its checkpoint; "dummy" (vLLM's name):
            random weights drawn on each device from the model's config alone (normal, std 0.02,
            norms 1; the same draws for the same layout and seed), for measuring a model shape
            whose checkpoint you do not have. A model trained on them learns nothing useful.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_fraction: float = 0.5
    cpu_kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    kv_offloading_size: float = 0.0
    cascade_attention: bool = False
    use_cuda_graphs: bool = True
    max_graph_batch_size: int = 256
    batch_invariant: bool = False
    tensor_parallel_size: int = 1
    load_format: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):  # e.g. from JSON (`serve --engine-config`): "no" would be a true bool
            value, allowed = getattr(self, f.name), _TYPES[f.type]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ConfigError(f"{f.name} must be {f.type.replace(' | None', ' or None')}, got {value!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be 'auto' (the checkpoint's weights) or 'dummy' (random weights), "
                              f"got {self.load_format!r}")
        if self.scheduling_policy not in ("lpm", "fcfs"):
            raise ConfigError(f"scheduling_policy must be 'lpm' (longest cached prefix first) or 'fcfs' (first come "
                              f"first served), got {self.scheduling_policy!r}")
        if self.kv_offloading_size < 0:
            raise ConfigError(f"kv_offloading_size must be >= 0 (GiB of host memory), got {self.kv_offloading_size}")
        if self.kv_offloading_size > 0 and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size needs enable_prefix_caching=True (blocks are found again by their "
                              "prefix hash): turn prefix caching on or set kv_offloading_size=0")
        if self.kv_offloading_size > 0 and self.tensor_parallel_size > 1:
            raise ConfigError("kv_offloading_size (the host tier of the KV cache) runs on one GPU per model: set "
                              "tensor_parallel_size=1 or kv_offloading_size=0")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.batch_invariant:
            raise ConfigError("batch_invariant (exact on-policy) runs on one GPU per model: set tensor_parallel_size=1 "
                              "or batch_invariant=False")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks must be >= 2 (block 0 is a scratch block)")
        if not 0.0 < self.gpu_memory_fraction < 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in (0, 1), got {self.gpu_memory_fraction}")

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with its device-dependent defaults filled in (`block_size`)."""
        if self.block_size is not None:
            return self
        return dataclasses.replace(self, block_size=4 if device_type == "cpu" else 16)
