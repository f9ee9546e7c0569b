"""`EngineArgs`: ART's vLLM engine options (docs/guides/art-compatibility.md, "ART options", says what each key does)."""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["EngineArgs"]


class EngineArgs(TypedDict, total=False):
    """vLLM engine options as ART passes them; tempering maps the scheduling and cache keys to
    `EngineConfig` and ignores vLLM-only performance knobs with a warning."""

    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enable_prefix_caching: bool | None
    block_size: int | None
    num_gpu_blocks_override: int | None
    enforce_eager: bool | None
    max_model_len: int | None
    gpu_memory_utilization: float
    num_scheduler_steps: int
    enable_chunked_prefill: bool | None
    preemption_mode: str | None
    swap_space: float
    kv_offloading_size: float
    disable_cascade_attn: bool
    cpu_offload_gb: float
    disable_log_stats: bool
    disable_log_requests: bool
    enable_log_requests: bool
    enable_sleep_mode: bool
    enable_lora: bool
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dtype: str
    seed: int
    rope_scaling: dict[str, Any] | None
    quantization: str | None
