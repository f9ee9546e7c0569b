"""How a scheduled batch reaches the model and comes back as sampled tokens.

`run()` flattens the batch (decode rows first, then prefill chunks) into token ids, positions
and cache slots, runs the decoder, computes logits only at the rows that sample (each decode
row and each prefill chunk that reaches the end of its prompt), and samples. The one
device→host transfer per step is the sampled ids and logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import EngineConfig
from .context import PrefillSpan, StepContext
from .layers.attention import paged_decode_attention
from .lora import AdapterWeights, LoRASegment
from .models import LlamaFamilyModel
from .sampler import sample, sampling_tensors
from .scheduler import ScheduledBatch
from .sequence import Sequence

__all__ = ["ModelRunner", "SampledToken"]

HAS_TRITON = paged_decode_attention is not None
try:
    from .layers.triton_attention import HAS_VARLEN
except ImportError:  # no Triton (CPU builds of torch)
    HAS_VARLEN = False


@dataclass(slots=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class ModelRunner:
    """Owns the KV cache and runs steps.

    Args:
        model: the engine's decoder.
        config: engine settings (cache size).
        adapter_weights: adapter name → its LoRA tensors (None for the base weights).
    """

    def __init__(
        self,
        model: LlamaFamilyModel,
        config: EngineConfig,
        adapter_weights: Callable[[str], AdapterWeights],
        max_seq_len: int = 8192,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.device = model.device
        self.is_cuda = self.device.type == "cuda"
        self.adapter_weights = adapter_weights
        self.num_blocks = config.num_kv_blocks or self._num_blocks_from_memory()
        shape = (model.num_layers, 2, self.num_blocks, self.block_size, model.num_kv_heads, model.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.use_varlen = self.is_cuda and HAS_VARLEN
        self.graphs = None
        if self.is_cuda and config.use_cuda_graphs and HAS_TRITON:
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                model, self.kv_cache,
                max_batch_size=min(config.max_graph_batch_size, config.max_num_seqs),
                max_blocks_per_seq=-(-max_seq_len // self.block_size),
            )

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host list on the device; on CUDA through pinned memory, without blocking."""
        if not self.is_cuda:
            return torch.tensor(values, dtype=dtype)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    @property
    def block_bytes(self) -> int:
        m = self.model
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * m.embed.element_size()

    def _num_blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.gpu_memory_fraction
        else:
            budget = self.config.cpu_kv_cache_bytes
        return max(2, int(budget // self.block_bytes))

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SampledToken]:
        """Compute one step; returns the token sampled by each sequence that samples this step."""
        input_ids, positions, slots = [], [], []
        samplers: list[tuple[Sequence, int]] = []  # (sequence, flat row of its last token)
        for seq in batch.decode:
            pos = len(seq) - 1
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(self._slot(seq, pos))
            samplers.append((seq, len(input_ids) - 1))
        spans, key_slots, cu_q, cu_k = [], [], [0], [0]
        for seq, n in batch.prefill:
            start = seq.num_computed_tokens
            table = None if self.use_varlen else self._tensor(seq.block_table)
            spans.append(PrefillSpan(len(input_ids), n, start + n, table))
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            new_slots = [self._slot(seq, p) for p in range(start + n)]
            slots += new_slots[start:]
            if self.use_varlen:
                key_slots += new_slots
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + start + n)
            if start + n == len(seq):
                samplers.append((seq, len(input_ids) - 1))

        ctx = StepContext(slot_mapping=self._tensor(slots), num_decode=len(batch.decode), prefill=spans)
        if self.use_varlen and spans:
            ctx.prefill_key_slots = self._tensor(key_slots)
            ctx.cu_q, ctx.cu_k = self._tensor(cu_q, torch.int32), self._tensor(cu_k, torch.int32)
            ctx.max_q, ctx.max_k = max(s.num_new for s in spans), max(s.context_len for s in spans)
        if batch.decode:
            width = max(len(s.block_table) for s in batch.decode)
            tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.decode]
            ctx.decode_block_tables = self._tensor(tables)
            ctx.decode_context_lens = self._tensor([len(s) for s in batch.decode])

        input_ids_t, positions_t = self._tensor(input_ids), self._tensor(positions)
        lora = self._lora_segments(batch)
        if self._graphable(batch, lora):
            hidden = self.graphs.run(
                input_ids_t, positions_t, ctx.slot_mapping, ctx.decode_block_tables, ctx.decode_context_lens,
                lora[0].adapter if lora else None,
            )
        else:
            hidden = self.model.forward(input_ids_t, positions_t, ctx, self.kv_cache, lora)
        if not samplers:
            return []
        rows = self._tensor([r for _, r in samplers])
        logits = self.model.logits(hidden[rows])  # [S, V]
        seqs = [s for s, _ in samplers]
        options = sampling_tensors(
            [s.request.params for s in seqs], [s.seed for s in seqs], [s.num_completion_tokens for s in seqs],
            to_device=self._tensor,
        )
        out = sample(logits, options)
        ids, lps = out.token_ids.tolist(), out.logprobs.tolist()
        tops = [[] for _ in seqs]
        if out.top_ids is not None:
            top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
            for j, s in enumerate(seqs):
                k = s.request.params.num_top_logprobs
                tops[j] = list(zip(top_ids[j][:k], top_lps[j][:k]))
        return [SampledToken(s, ids[j], lps[j], tops[j]) for j, s in enumerate(seqs)]

    def _graphable(self, batch: ScheduledBatch, lora: list[LoRASegment]) -> bool:
        """A decode-only batch that fits a graph bucket, with one adapter (or none) for all rows."""
        if self.graphs is None or batch.prefill or not batch.decode:
            return False
        if len(batch.decode) > self.graphs.max_batch_size:
            return False
        return not lora or (len(lora) == 1 and lora[0].start == 0 and lora[0].end == len(batch.decode))

    def forget_adapter(self, adapter: AdapterWeights) -> None:
        if self.graphs is not None:
            self.graphs.forget(adapter)

    def _lora_segments(self, batch: ScheduledBatch) -> list[LoRASegment]:
        """Contiguous row ranges of the flat batch that share an adapter."""
        segments: list[LoRASegment] = []
        row = 0
        for seq, n in batch.items():
            name = seq.request.policy.adapter_name
            if segments and segments[-1].end == row and segments[-1].adapter_name == name:
                segments[-1].end += n
            else:
                segments.append(_Segment(row, row + n, name))
            row += n
        out = [LoRASegment(s.start, s.end, self.adapter_weights(s.adapter_name)) for s in segments if s.adapter_name]
        return out


@dataclass(slots=True)
class _Segment:
    start: int
    end: int
    adapter_name: str | None
