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
from .sampler import SamplingTensors, sample, sampling_flags
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
        ints, floats = _Pack(), _Pack()  # every host array of the step goes over in two transfers
        input_ids, positions, slots = [], [], []
        samplers: list[tuple[Sequence, int]] = []  # (sequence, flat row of its last token)
        for seq in batch.decode:
            pos = len(seq) - 1
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(self._slot(seq, pos))
            samplers.append((seq, len(input_ids) - 1))
        spans, key_slots, cu_q, cu_k, tables = [], [], [0], [0], []
        for seq, n in batch.prefill:
            start = seq.num_computed_tokens
            if not self.use_varlen:
                tables.append(ints.add(seq.block_table))
            spans.append(PrefillSpan(len(input_ids), n, start + n, None))
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
        seqs = [s for s, _ in samplers]
        params = [s.request.params for s in seqs]

        f_ids, f_pos, f_slots = ints.add(input_ids), ints.add(positions), ints.add(slots)
        f_rows = ints.add([r for _, r in samplers])
        f_seeds, f_counters = ints.add([s.seed for s in seqs]), ints.add([s.num_completion_tokens for s in seqs])
        f_top_k = ints.add([max(p.top_k, 0) for p in params])
        f_temp, f_top_p = floats.add([p.temperature for p in params]), floats.add([p.top_p for p in params])
        if batch.decode:
            width = max(len(s.block_table) for s in batch.decode)
            f_tables = ints.add([b for s in batch.decode for b in s.block_table + [0] * (width - len(s.block_table))])
            f_lens = ints.add([len(s) for s in batch.decode])
        if self.use_varlen and spans:
            f_keys, f_cu = ints.add(key_slots), ints.add(cu_q + cu_k)
        i = ints.send(torch.long, self.device, self.is_cuda)
        f = floats.send(torch.float32, self.device, self.is_cuda)

        ctx = StepContext(slot_mapping=i(f_slots), num_decode=len(batch.decode), prefill=spans)
        for span, t in zip(spans, tables):
            span.block_table = i(t)
        if batch.decode:
            ctx.decode_block_tables = i(f_tables).view(len(batch.decode), width)
            ctx.decode_context_lens = i(f_lens)
        if self.use_varlen and spans:
            ctx.prefill_key_slots = i(f_keys)
            cu = i(f_cu).to(torch.int32)
            ctx.cu_q, ctx.cu_k = cu[: len(cu_q)], cu[len(cu_q):]
            ctx.max_q, ctx.max_k = max(s.num_new for s in spans), max(s.context_len for s in spans)

        lora = self._lora_segments(batch)
        if self._graphable(batch, lora):
            hidden = self.graphs.run(
                i(f_ids), i(f_pos), ctx.slot_mapping, ctx.decode_block_tables, ctx.decode_context_lens,
                lora[0].adapter if lora else None,
            )
        else:
            hidden = self.model.forward(i(f_ids), i(f_pos), ctx, self.kv_cache, lora)
        if not samplers:
            return []
        logits = self.model.logits(hidden[i(f_rows)])  # [S, V]
        options = SamplingTensors(
            temperature=f(f_temp), top_k=i(f_top_k), top_p=f(f_top_p), seeds=i(f_seeds), counters=i(f_counters),
            **sampling_flags(params),
        )
        out = sample(logits, options)
        ids, lps = out.token_ids.tolist(), out.logprobs.tolist()  # the step's one device→host sync
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


class _Pack:
    """Host lists concatenated into one buffer, sent to the device in one (pinned, async) copy."""

    def __init__(self) -> None:
        self.values: list = []

    def add(self, values: list) -> tuple[int, int]:
        start = len(self.values)
        self.values.extend(values)
        return start, len(values)

    def send(self, dtype: torch.dtype, device: torch.device, pinned: bool):
        """Copy to `device`; returns a function from an `add` handle to its device slice."""
        buffer = torch.tensor(self.values, dtype=dtype, pin_memory=pinned)
        if pinned:
            buffer = buffer.to(device, non_blocking=True)
        return lambda handle: buffer[handle[0]:handle[0] + handle[1]]
