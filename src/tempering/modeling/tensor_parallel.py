"""Tensor parallelism for the Llama family, Megatron-style, over torch.distributed.

Each rank of a tensor-parallel (TP) group of size P holds 1/P of every large matrix of a decoder
layer, and the engine and the trainer of that rank share that one shard (as they share the whole
weights on one GPU):

- column-parallel (output rows split): q_proj, k_proj, v_proj (whole heads: rank r holds query
  heads [r Hq/P, (r+1) Hq/P) and KV heads [r Hkv/P, (r+1) Hkv/P), so every query head finds its
  KV head on its own rank; Hkv % P == 0 is required), gate_proj and up_proj;
- row-parallel (input columns split): o_proj and down_proj. Their outputs are partial sums,
  all-reduced once per attention block and once per MLP block.

The embedding, the norms and the LM head stay replicated (simplest; the LM head then computes the
full logits on every rank: at 72B that is 2 x 2.5 GB per GPU, against 34 GB of sharded layers at P=4).

LoRA on a sharded projection is sharded the same way: a column-parallel layer's A [r, in] is
replicated and its B [out/P, r] holds the rank's rows; a row-parallel layer's A [r, in/P] holds the
rank's input columns and its B [out, r] is replicated. PEFT builds exactly these shapes when it
wraps the sharded nn.Linear modules (their in_features/out_features are the shard's).

A row-parallel layer rounds as one process does: x A^T is summed over the ranks (a small
all-reduce, [tokens, r] float32) before round(s · x A^T), the delta is added to the leader's
partial output alone, and the partial outputs x_r W_r^T (+ delta) are summed in float32 and then
rounded once (engine/lora.row_parallel_delta, training/decoder.lora_linear). The engine's decode
step (the spare rows' path, engine/lora.linear_with_lora) sums x_r W_r^T and x_r A_r^T in one
all-reduce of the GEMM's whole float32 output, and every rank adds the delta after the sum, as
one process adds it to its whole product. In bfloat16 on the CPU
this makes the sharded forward bitwise the one-process forward; rounding each rank's partial
output first changed 4 elements in 10 of a projection's output.

The gradient of a replicated part is a partial sum on each rank (a column layer's A sees only the
rank's output rows; a row layer's B is the leader's alone), so it is summed over the group
(`all_reduce_replicated_grads`) before the identical optimizer step on every rank.

Collectives: the engine's forward calls `all_reduce` (capturable in a CUDA graph): NCCL, or on GPUs
a two-shot all-reduce through PyTorch's symmetric memory (`use_symmetric_memory`), whose NVLink
loads and stores beat NCCL's ring at a decode step's sizes (a [256, 5184] float32 sum in a decode
step of a 32B model on two H200s: 23 µs against NCCL's 40 µs, `benchmarks/RESULTS.md`). The
trainer's forward calls `copy_to` before a column-parallel layer (identity; backward: all-reduce
of the input gradient) and `reduce_from` after a row-parallel one
(all-reduce; backward: identity), Megatron's f and g operators (Shoeybi et al. 2019,
arXiv 1909.08053, section 3), written as autograd Functions over `torch.distributed.all_reduce`.
`torch.distributed.nn.functional.all_reduce` is not used: its backward all-reduces the gradient,
which counts it P times when, as here, every rank computes the same loss.

The trainer is sequence parallel when a row's T tokens divide by P (Korthikanti et al. 2022,
arXiv 2205.05198): between the sharded layers each rank holds T/P consecutive rows (norms and
residual adds run on them), a column-parallel layer all-gathers its input rows (backward:
reduce-scatter of the input gradient) and a row-parallel layer reduce-scatters its float32
partial output, rounding this rank's rows once (backward: all-gather of the gradient). The sums
and the one rounding are those of the all-reduce; the same bytes cross the links, and a
recomputed layer keeps 1/P of its input. The engine keeps the all-reduces.

The engine and the trainer of a rank run in different threads, so each gets its own process group
(its own communicator): two threads issuing collectives on one group could interleave them in a
different order on different ranks.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError

__all__ = ["COLUMN_PARALLEL", "ROW_PARALLEL", "TensorParallel", "all_gather_rows", "init_row_parallel_lora_A_",
           "lora_shard_dim", "reduce_scatter_rows", "shard_llama_", "sharded_weight_bytes"]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")

# the engine's follower waits for the leader's next step as long as the leader is idle
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# "0": the engine's all-reduces stay on NCCL (`TensorParallel.use_symmetric_memory`)
SYMMETRIC_MEMORY_ENV = "TEMPERING_SYMMETRIC_MEMORY"
# symmetric-memory rendezvous this process has made (`TensorParallel.use_symmetric_memory`)
_rendezvous_made = 0

log = logging.getLogger(__name__)


class TensorParallel:
    """This rank's place in a tensor-parallel group.

    Every process of the run must construct it with the same `ranks` at the same point (it creates
    process groups, which is collective over the whole world, as `dist.new_group`); `split` makes
    the groups of a run of several replicas.

    Args:
        ranks: the global ranks of the group, in TP-rank order (default: every rank).
        timeout_s: how long a training collective may wait for another rank.
        groups: (trainer, engine, engine headers) process groups already made over `ranks` (by `split`).

    Attributes:
        rank: this process's rank within the group (0: the leader, which schedules and samples).
        size: P, the number of ranks.
        leader: the global rank of TP rank 0 (the `src` of the engine's step broadcasts).
        group: the trainer's process group; engine_group: the engine's (no timeout while idle);
            host_group: the engine's step headers (gloo, host memory).

    Raises:
        ConfigError: if torch.distributed is not initialized or this process is not in `ranks`.
    """

    def __init__(self, ranks: Sequence[int] | None = None, *, timeout_s: float = 600.0,
                 groups: tuple[Any, Any, Any] | None = None) -> None:
        if not dist.is_initialized():
            raise ConfigError("tensor parallelism needs torch.distributed initialized (parallel/launch.py, or "
                              "init_process_group) with one process per GPU")
        ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        self.group, self.engine_group, self.host_group = groups or _new_groups(ranks, timeout_s)
        if dist.get_rank() not in ranks:
            raise ConfigError(f"rank {dist.get_rank()} is not in the tensor-parallel group {ranks}")
        self.ranks = ranks
        self.rank = ranks.index(dist.get_rank())
        self.size = len(ranks)
        self.leader = ranks[0]
        self._symmetric: torch.Tensor | None = None  # the engine's all-reduce buffer (use_symmetric_memory)

    @classmethod
    def split(cls, size: int, *, timeout_s: float = 600.0) -> tuple[TensorParallel, dist.ProcessGroup | None]:
        """Split the whole run into replicas of `size` consecutive ranks, each replica one model split
        `size` ways (collective: every rank calls it at the same point).

        Returns:
            (this rank's TensorParallel, the process group of the ranks that hold the same shards in
            every replica, for data parallelism: ranks {r, r + size, r + 2 size, ...}; None with one replica).

        Raises:
            ConfigError: if the number of ranks is not a multiple of `size`.
        """
        world, me = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ConfigError(f"{world} processes (GPUs) do not split into replicas of tensor_parallel_size {size}: "
                              f"use a number of GPUs that is a multiple of {size}")
        mine = None
        for start in range(0, world, size):  # every rank creates every group, in the same order
            ranks = list(range(start, start + size))
            groups = _new_groups(ranks, timeout_s)
            if me in ranks:
                mine = cls(ranks, groups=groups)
        data_group = None
        if world > size:
            for offset in range(size):
                ranks = list(range(offset, world, size))
                group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
                if me in ranks:
                    data_group = group
        return mine, data_group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, ranks={self.ranks})"

    # ---- the engine's collective --------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the engine's group (a row-parallel layer's partial output), the same
        on every rank; capturable in a CUDA graph.

        A float32 CUDA tensor that fits the buffer of `use_symmetric_memory` is copied there and
        summed by PyTorch's two-shot all-reduce (each rank sums 1/P of the values from every rank's
        buffer and writes the sums to all of them, in float32): the result is a view of that buffer,
        valid until the engine's next `all_reduce`, and x is left as it was. Otherwise NCCL sums x
        (made contiguous) in place, and the result is x.
        """
        out = self.all_reduce_buffer(x.shape) if x.dtype == torch.float32 and x.is_cuda else None
        if out is not None:
            if x.data_ptr() != out.data_ptr():  # not written there already (`all_reduce_buffer`)
                out.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(out, "sum", self.engine_group.group_name)
            return out
        x = x.contiguous()
        dist.all_reduce(x, group=self.engine_group)
        return x

    def all_reduce_buffer(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Where a float32 tensor of `shape` that `all_reduce` will sum can be written directly (the
        symmetric-memory buffer, saving `all_reduce` its copy), or None (write it anywhere). Valid
        until the engine's next `all_reduce`."""
        buffer, numel = self._symmetric, math.prod(shape)
        return buffer[:numel].view(shape) if buffer is not None and numel <= buffer.numel() else None

    def use_symmetric_memory(self, device: torch.device, numel: int) -> bool:
        """Give the engine's float32 all-reduces of up to `numel` values a buffer in PyTorch's symmetric
        memory (`torch.distributed._symmetric_memory`: each rank maps every rank's buffer, over
        NVLink), so that `all_reduce` sums them with a two-shot all-reduce instead of NCCL.

        Collective over the engine's group (every rank calls it at the same point). Returns whether
        every rank now uses it: not on a CPU, not where this torch build lacks it or a rank could
        not map the buffer (those all-reduces stay on NCCL, with a warning), not when a rank made
        rendezvous in an earlier run (`rendezvous_counts_agree`), nor when the environment variable
        TEMPERING_SYMMETRIC_MEMORY is "0". Its two-shot kernel loads and stores peers' memory
        directly: it needs no NVLink multicast (NVLS).
        """
        global _rendezvous_made
        if device.type != "cuda":
            return False
        buffer, ok = None, os.environ.get(SYMMETRIC_MEMORY_ENV, "1") != "0"
        counts_agree = self.rendezvous_counts_agree(device)  # collective: every rank calls it, whatever `ok`
        if ok and not counts_agree:
            log.info("the engine's all-reduces stay on NCCL: a rank of this group used symmetric memory in an "
                     "earlier run of its process (a backend closed and another opened), and torch numbers a "
                     "process's rendezvous from its first, so the ranks' rendezvous would never meet")
            ok = False
        if ok:
            try:
                import torch.distributed._symmetric_memory as symm_mem

                buffer = symm_mem.empty(numel, dtype=torch.float32, device=device)
                _rendezvous_made += 1
                symm_mem.rendezvous(buffer, self.engine_group.group_name)
                ok = hasattr(torch.ops.symm_mem, "two_shot_all_reduce_")
            except Exception as exc:  # an older torch, or no peer access between these GPUs
                log.warning("the engine's all-reduces stay on NCCL: symmetric memory is not available (%r)", exc)
                ok = False
        agreed = torch.tensor([int(ok)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.engine_group)  # every rank or none
        self._symmetric = buffer if bool(agreed.item()) else None
        if self._symmetric is not None:
            log.info("the engine's all-reduces of up to %d float32 values use symmetric memory", numel)
        return self._symmetric is not None

    def rendezvous_counts_agree(self, device: torch.device) -> bool:
        """Whether every rank of the engine's group has made as many symmetric-memory rendezvous
        in its process as this one (collective over the engine's group; `device`: where its
        backend communicates).

        torch keys the store exchange of a rendezvous with a sequence number of its own, counted
        per process from its first rendezvous (CUDASymmetricMemory's `store_comm_seq_id`, torch
        2.11). A driver process that served a tensor-parallel model in an earlier run (a backend
        closed, then another opened: a resume in the same process) is ahead of its new, fresh
        workers, and their rendezvous waited for each other's keys forever, on every rank (a 72B
        resume on four H200s). Counting the rendezvous made here tells such a group apart.
        """
        counts = torch.tensor([_rendezvous_made, -_rendezvous_made], device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.engine_group)
        return int(counts[0]) == -int(counts[1])

    # ---- the trainer's collectives (autograd-aware) ---------------------------------------------

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's f: x itself in the forward; in the backward the input gradient summed over the
        group (each rank's column-parallel layer contributes its rows' part of it)."""
        return _CopyToGroup.apply(x, self.group)

    def reduce_from(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's g: x summed over the group (a row-parallel layer's partial output, in place);
        the gradient passes through unchanged (every rank computes the same loss from the sum)."""
        return _ReduceFromGroup.apply(x, self.group)

    # ---- sequence parallelism: the trainer's tokens split over the group between the sharded layers

    def shard_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of T / P consecutive rows of a [T, ...] tensor every rank holds whole
        (the embedding's output); no gradient passes back to the other rows' blocks."""
        n = x.shape[0] // self.size
        return x.narrow(0, self.rank * n, n)

    def gather_tokens(self, x: torch.Tensor, *, replicated_grad: bool = False) -> torch.Tensor:
        """[T / P, ...] on each rank → [T, ...], the ranks' blocks in rank order (all-gather).

        The backward sums the ranks' gradients and keeps this rank's block (reduce-scatter): each
        rank's gradient is a partial sum (a column-parallel layer's rows). With `replicated_grad`
        (every rank computes the same loss from the gathered tensor, so holds the whole gradient)
        it keeps this rank's block alone, which a sum would count P times."""
        return _GatherTokens.apply(x, self.group, replicated_grad)

    def scatter_tokens(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A row-parallel layer's partial output [T, ...] (float32) summed over the group, this rank's
        block of T / P rows kept and rounded to `dtype` once (reduce-scatter); the backward gathers
        the blocks' gradients."""
        return _ScatterTokens.apply(partial, self.group, dtype)

    # ---- LoRA gradients and state --------------------------------------------------------------

    def all_reduce_replicated_grads(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Sum the `.grad` of every replicated LoRA tensor over the group (one all-reduce per dtype)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for name, p in named_params:
            if lora_shard_dim(name) is None and p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def grad_norm(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The 2-norm of the whole (unsharded) adapter's gradient, the same float32 scalar on every rank:
        replicated tensors counted once, sharded ones summed over the group."""
        device = named_params[0][1].device
        replicated = torch.zeros((), dtype=torch.float32, device=device)
        sharded = torch.zeros((), dtype=torch.float32, device=device)
        for name, p in named_params:
            if p.grad is None:
                continue
            sq = p.grad.float().pow(2).sum()
            if lora_shard_dim(name) is None:
                replicated += sq
            else:
                sharded += sq
        dist.all_reduce(sharded, group=self.group)
        return (replicated + sharded).sqrt()

    def gather(self, t: torch.Tensor, dim: int | None) -> torch.Tensor:
        """The full tensor of which each rank holds the `dim` slice `t` (None: replicated, t itself)."""
        if dim is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def slice(self, full: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's `dim` slice of a full tensor (None: replicated, the tensor itself).

        Raises:
            ConfigError: if the size along `dim` is not a multiple of the group size.
        """
        if dim is None:
            return full
        n = _divide(full.shape[dim], self.size, f"dimension {dim} of a tensor of shape {tuple(full.shape)}")
        return full.narrow(dim, self.rank * n, n)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # autograd may hand the same gradient to other branches
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# torch >= 2.13 names them all_gather_single / reduce_scatter_single (the older names are deprecated there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(x: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """[n, ...] on each of the P ranks of `group` → [P n, ...], rank r's rows at [r n, (r + 1) n).

    Returns the tensor, or (tensor, work) with `async_op` (the tensor is ready once `work.wait()`
    returns: on NCCL the current stream waits, the host does not)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    work = _all_gather_single(out, x, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[P n, ...] on each rank → [n, ...]: the sum over the ranks of rows [r n, (r + 1) n) on rank r
    (in x's dtype: a float32 partial output is summed in float32)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, replicated_grad):
        ctx.group, ctx.replicated_grad = group, replicated_grad
        return all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.replicated_grad:
            n = grad.shape[0] // dist.get_world_size(ctx.group)
            return grad.narrow(0, dist.get_rank(ctx.group) * n, n), None, None
        return reduce_scatter_rows(grad, ctx.group), None, None


class _ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group, dtype):
        ctx.group = group
        return reduce_scatter_rows(partial, group).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_rows(grad, ctx.group), None, None


def _new_groups(ranks: list[int], timeout_s: float) -> tuple[Any, Any, Any]:
    """The trainer's, the engine's and the engine headers' (gloo) process groups over `ranks`."""
    return (dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s)),
            dist.new_group(ranks, timeout=_IDLE_TIMEOUT),
            # the engine's step headers: host integers, on gloo, so that an idle follower waits in its
            # thread and not in a device kernel (an NCCL receive would spin on the GPU while it trains)
            dist.new_group(ranks, timeout=_IDLE_TIMEOUT, backend="gloo"))


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ConfigError(f"{what} is {size}, not divisible by tensor_parallel_size {parts}: use a "
                          f"tensor_parallel_size that divides {size}")
    return size // parts


def lora_shard_dim(name: str) -> int | None:
    """How a PEFT LoRA tensor is laid out under tensor parallelism, from its parameter name
    (`...layers.3.self_attn.q_proj.lora_B.default.weight`, or the saved `...q_proj.lora_B.weight`).

    Returns:
        the dim along which each rank holds a slice (0: a column-parallel B's output rows; 1: a
        row-parallel A's input columns), or None for a replicated tensor.

    Raises:
        ConfigError: for LoRA on a module that tensor parallelism does not shard (lm_head, ...).
    """
    module = name.split(".lora_")[0].rsplit(".", 1)[-1]
    is_A = ".lora_A." in name
    if module in COLUMN_PARALLEL:
        return None if is_A else 0
    if module in ROW_PARALLEL:
        return 1 if is_A else None
    raise ConfigError(f"tensor parallelism shards LoRA on {COLUMN_PARALLEL + ROW_PARALLEL}, not on {module!r} "
                      f"({name}): remove it from LoRAConfig.target_modules")


def _check_config(config: Any, size: int) -> None:
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    _divide(num_heads, size, "num_attention_heads")
    _divide(num_kv_heads, size, "num_key_value_heads (KV heads are split, never replicated)")
    _divide(config.intermediate_size, size, "intermediate_size")


def shard_llama_(hf_model: Any, tp: TensorParallel, *,
                 init: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> None:
    """Replace the q/k/v, o, gate/up and down weights of a Llama-family HF model by this rank's shards, in place.

    The modules' `in_features`/`out_features` become the shard's, so PEFT wraps them with sharded
    LoRA (module docstring). A full weight is freed as soon as its module holds the shard (when
    nothing else refers to it). Call it before the engine, the trainer or PEFT see the model.

    Args:
        hf_model: a `*ForCausalLM` of the Llama family (LlamaForCausalLM, Qwen2, Qwen3, Mistral).
        tp: this rank's group.
        init: for a model built on the meta device (random weights for a benchmark of a model
            larger than one device): called as `init(shape, dtype)` to create each shard, so no full
            matrix ever exists. Other (replicated) meta tensors are left to the caller.

    Raises:
        ConfigError: if heads, KV heads or the intermediate size do not divide by `tp.size`, if
            o_proj or down_proj has a bias (it would be added P times), or the model is already
            wrapped by PEFT or already sharded.
    """
    config = hf_model.config
    _check_config(config, tp.size)
    layers = list(hf_model.model.layers)
    if getattr(layers[0].self_attn.q_proj, "base_layer", None) is not None:
        raise ConfigError("shard the model before PEFT wraps it (shard_llama_ before Trainer.new / from_adapter)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if layers[0].self_attn.q_proj.weight.shape[0] != config.num_attention_heads * head_dim:
        raise ConfigError("this model is already sharded (its q_proj holds fewer rows than its heads need)")
    with torch.no_grad():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _shard_linear_(module, 0, tp, init)
            for module in (attn.o_proj, mlp.down_proj):
                if module.bias is not None:
                    raise ConfigError("tensor parallelism does not cover a bias on o_proj or down_proj (a row-parallel "
                                      "layer); run this model with tensor_parallel_size 1")
                _shard_linear_(module, 1, tp, init)


def _shard_linear_(module: nn.Linear, dim: int, tp: TensorParallel, init) -> None:
    def take(t: torch.Tensor, d: int) -> torch.Tensor:
        if t.is_meta:
            if init is None:
                raise ConfigError("the model is on the meta device: pass init= to create its shards")
            shape = list(t.shape)
            shape[d] //= tp.size
            return init(tuple(shape), t.dtype)
        return tp.slice(t, d).clone()  # a copy of the rank's slice, so that the full tensor can be freed

    module.weight = nn.Parameter(take(module.weight, dim), requires_grad=False)
    if module.bias is not None and dim == 0:
        module.bias = nn.Parameter(take(module.bias, 0), requires_grad=False)
    if dim == 0:
        module.out_features = module.weight.shape[0]
    else:
        module.in_features = module.weight.shape[1]


def sharded_weight_bytes(config: Any, tensor_parallel_size: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's weights of a Llama-family model at `tensor_parallel_size` (layers sharded,
    embedding, LM head and norms replicated), from its config alone.

    Raises:
        ConfigError: if the model cannot be split that way (see `shard_llama_`).
    """
    _check_config(config, tensor_parallel_size)
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    D = getattr(config, "head_dim", None) or H // num_heads
    attention = H * (num_heads + 2 * num_kv_heads) * D + num_heads * D * H  # q, k, v, o
    mlp = 3 * H * I
    per_layer = (attention + mlp) // tensor_parallel_size + 2 * H
    embeddings = V * H * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    numel = config.num_hidden_layers * per_layer + embeddings + H
    return numel * torch.empty((), dtype=dtype).element_size()


def init_row_parallel_lora_A_(named_params: Sequence[tuple[str, torch.Tensor]], tp: TensorParallel, seed: int) -> None:
    """Give every row-parallel A (sharded by input columns) this rank's slice of a full A drawn as PEFT
    draws it (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in)) for the full `in`), the same
    full matrix on every rank. Without it each rank's PEFT would draw its slice alone, from a bound
    sqrt(P) too wide and the same values on every rank."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_params:
            if lora_shard_dim(name) != 1:
                continue
            full_in = p.shape[1] * tp.size
            bound = 1.0 / math.sqrt(full_in)
            full = torch.empty(p.shape[0], full_in, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
            p.copy_(tp.slice(full, 1))
