"""How a scheduled batch reaches the model and comes back as sampled tokens.

`prepare()` flattens the batch (decode rows first, then prefill chunks) into token ids,
positions and cache slots and sends them over; `launch()` runs the decoder, computes
logits only at the rows that sample (each decode row and each prefill chunk that reaches the end
of its prompt), samples, and starts copying the sampled ids and logprobs to the host. Neither
waits: on a GPU the engine schedules and prepares the next step while this one runs (one step of
lookahead, as vLLM's asynchronous scheduler and SGLang's overlap scheduler do). A decode row
whose previous token is still on its way reads it straight from the previous step's sampled ids
on the device (`last_tokens`, which every step's sampling writes). A decode-only step whose rows
all sample with the fused sampler runs its logits and sampling inside its CUDA graph too
(cuda_graphs.py). `collect()` waits for a launched step and returns its tokens: the step's one
device→host synchronization.

Structured outputs: when a sampling row follows a grammar, `launch()` stops after the logits and
`sample_deferred()` samples later with the grammar bitmasks, which the engine fills once the
matchers consumed the previous step's tokens, while the device runs the forward. A decode-only
step that ran from a CUDA graph is sampled by a second graph (logits and masked sampling), and
the next step is staged (`stage()`: its inputs copied into its graph's buffers) before that
sampling, so that its launch right after it is one graph replay.

Each running sequence owns a row of a host block table that grows as the block manager hands
it blocks, so a step copies its rows with one numpy gather instead of rebuilding Python lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError
from .config import EngineConfig
from .context import PrefillSpan, StepContext
from .grammar import GrammarMask, PendingMasks, ReadyMasks
from .kv_offload import HostKVCache
from .layers.attention import paged_decode_attention
from .lora import EngineAdapter, LoRASegment
from .memory import available_host_bytes, cuda_free_bytes
from .models import LlamaFamilyModel
from .sampler import SamplingTensors, sample, sampling_flags
from .scheduler import ScheduledBatch
from .sequence import Sequence
from .tensor_parallel import CAPTURE, StepLink, StepMessage

if TYPE_CHECKING:  # cuda_graphs is imported on GPUs only
    from .cuda_graphs import StagedDecode

__all__ = ["LaunchedStep", "ModelRunner", "PreparedStep", "SampledTokens"]

log = logging.getLogger(__name__)

HAS_TRITON = paged_decode_attention is not None
# 16M token slots at the default block size: more than any batch of rollouts holds, and a small
# model's cache on a large GPU would otherwise count tens of millions of blocks (the block manager
# keeps an object per block: seconds per million to create)
MAX_KV_BLOCKS = 1 << 20
try:
    from .layers.triton_attention import HAS_VARLEN
except ImportError:  # no Triton (CPU builds of torch)
    HAS_VARLEN = False


@dataclass(slots=True)
class SampledTokens:
    """A collected step: row j's token `token_ids[j]` fills `seqs[j].token_ids[indices[j]]`."""

    seqs: list[Sequence]
    indices: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None  # per row, when some row asked for top logprobs
    forced: list[bool] | None = None  # per row, when some row follows a grammar: it allowed only this token
    versions: list[int] | None = None  # per row, the policy version of the weights that sampled it


@dataclass(slots=True)
class LaunchedStep:
    """A step whose sampled tokens are on their way to the host.

    Attributes:
        seqs: the sequences that sample, in row order.
        indices: where each one's token goes in its `token_ids` (set by the engine).
        token_ids: [S] int64 sampled ids on the device: a view of the runner's `last_tokens`,
            valid until the next step samples (the next step's decode inputs read it).
        rows: seq_id → row of `token_ids`.
        host_ids, host_logprobs: [S] pinned host copies being filled.
        host_top_ids, host_top_logprobs: [S, K] when some row asked for top logprobs.
        done: recorded after the copies (None on CPU, where they are already done).
        deferred: (logits [S, V], options, False) while a step with grammar rows waits to be sampled;
            (hidden [S, H], options, True) when a CUDA graph will compute its logits and sample.
        grammar_mask: the step's grammar bitmasks, when some row follows a grammar.
        versions: per row, the policy version of the weights the step read (set at launch).
    """

    seqs: list[Sequence]
    indices: list[int]
    token_ids: torch.Tensor | None
    rows: dict[int, int]
    host_ids: torch.Tensor | None = None
    host_logprobs: torch.Tensor | None = None
    host_top_ids: torch.Tensor | None = None
    host_top_logprobs: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    deferred: tuple[torch.Tensor, SamplingTensors, bool] | None = None
    grammar_mask: GrammarMask | None = None
    versions: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PreparedStep:
    """A step's inputs, built and sent to the device by `ModelRunner.prepare`, before the forward.

    Attributes:
        batch: the scheduled batch.
        seqs: the rows that sample, in row order.
        ids: [T] int64 input token ids (0 where a decode row's token is still being sampled).
        sources: [D] int64: for each decode row, its row in the previous step's sampled ids, or
            -1 when its newest token is known; None when no row waits for one.
        positions: [T] int64 positions.
        ctx: the attention metadata.
        sample_rows: [S] int64 rows of the flat batch whose logits are sampled.
        options: the sampling rows' options.
    """

    batch: ScheduledBatch
    seqs: list[Sequence]
    ids: torch.Tensor
    sources: torch.Tensor | None
    positions: torch.Tensor
    ctx: StepContext
    sample_rows: torch.Tensor
    options: SamplingTensors
    lora: list[LoRASegment] | None = None  # set by `ModelRunner.stage`, as are the two flags below
    has_grammar: bool = False  # some sampling row follows a grammar
    fused: bool = False  # every sampling row can be drawn by the fused Gumbel-max sampler
    staged: StagedDecode | None = None  # a decode step whose inputs are in its CUDA graph's buffers


CASCADE_MIN_TOKENS, CASCADE_MIN_ROWS = 256, 8  # a shared prefix shorter, or fewer rows: each row reads its own


def shared_prefix_len(tables: np.ndarray, lens: list[int], block_size: int) -> int:
    """Cascade attention's shared prefix of a decode batch: the keys of the leading blocks that every
    row's table holds, whole blocks before each row's newest key, or 0 when shorter than
    CASCADE_MIN_TOKENS or the batch has fewer than CASCADE_MIN_ROWS rows.

    Args:
        tables: [B, >= max blocks] the rows' block tables (any int dtype).
        lens: [B] each row's keys, its newest token included.

    Returns:
        tokens, a multiple of `block_size`.
    """
    if len(lens) < CASCADE_MIN_ROWS:
        return 0
    full = min(lens) // block_size  # blocks whose every key each row reads
    if full * block_size < CASCADE_MIN_TOKENS:
        return 0
    leading = tables[:, :full]
    same = (leading == leading[0]).all(axis=0)
    shared = full if same.all() else int(same.argmin())
    return shared * block_size if shared * block_size >= CASCADE_MIN_TOKENS else 0


class ModelRunner:
    """Owns the KV cache and runs steps.

    Args:
        model: the engine's decoder.
        config: engine settings (cache size).
        adapter_weights: adapter name → its LoRA tensors.
        max_seq_len: longest sequence (sizes the block tables).
        link: under tensor parallelism (`model.tp`), the step messages of the group
            (tensor_parallel.py): the leader sends every forward's inputs before running it, a
            follower runs the forwards it receives (`follow`). Every rank's cache gets the
            smallest rank's number of blocks.
    """

    def __init__(
        self,
        model: LlamaFamilyModel,
        config: EngineConfig,
        adapter_weights: Callable[[str], EngineAdapter],
        max_seq_len: int = 8192,
        link: StepLink | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.device = model.device
        self.is_cuda = self.device.type == "cuda"
        self.adapter_weights = adapter_weights
        self.link = link
        self.is_follower = link is not None and not link.tp.is_leader
        self.num_blocks = config.num_kv_blocks or self._num_blocks_from_memory()
        if link is not None:  # the leader's block ids must exist in every rank's cache
            count = torch.tensor([self.num_blocks], dtype=torch.long, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=link.tp.engine_group)
            self.num_blocks = int(count.item())
            # a decode step's partial outputs summed through symmetric memory (prefills' larger ones: NCCL)
            width = getattr(model, "partial_width", None)
            if width is not None:
                link.tp.use_symmetric_memory(self.device, max(config.max_num_seqs, config.max_graph_batch_size) * width)
        shape = (model.num_layers, 2, self.num_blocks, self.block_size, model.num_kv_heads, model.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        # a mixture of experts records each cached token's experts beside its K/V (routing.py)
        allocate_routing = getattr(model, "allocate_routing", None)
        self.routing = allocate_routing(self.num_blocks * self.block_size) if allocate_routing is not None else None
        self.host_cache = None  # the host tier (KV offloading), in blocks of the same size
        if config.kv_offloading_size > 0:
            available = available_host_bytes()
            if available is not None and config.kv_offloading_size * 2**30 > 0.9 * available:
                raise ConfigError(
                    f"kv_offloading_size is {config.kv_offloading_size:g} GiB but this host has "
                    f"{available / 2**30:.1f} GiB of memory available: the host tier is pinned (locked in RAM) "
                    f"when the engine starts, so set kv_offloading_size to at most {0.9 * available / 2**30:.0f} "
                    f"GiB (or 0 for none)")
            num_slots = int(config.kv_offloading_size * 2**30 // self.block_bytes)
            if num_slots:
                self.host_cache = HostKVCache(self.kv_cache, self.routing.ids if self.routing is not None else None,
                                              num_slots)
        log.info("KV cache: %d tokens (%.1f GiB)%s", (self.num_blocks - 1) * self.block_size,
                 self.num_blocks * self.block_bytes / 2**30,
                 f"; host tier: {self.host_cache.num_slots * self.block_size} tokens" if self.host_cache else "")
        if self.is_cuda:  # before any graph is captured
            # the caching allocator's unused blocks go back to the driver (cuda_free_bytes did so
            # already when it sized the cache; a num_kv_blocks from the config skips it): a graph's
            # private pool cannot reuse them and a capture cannot free them (on 4x H100 a 72B leader
            # holding 28.6 GiB of them ran a decode bucket eagerly)
            torch.cuda.empty_cache()
        # FlashAttention takes half precision; a float32 model's prefill runs SDPA over its block tables
        self.use_varlen = self.is_cuda and HAS_VARLEN and model.dtype in (torch.bfloat16, torch.float16)
        self.batch_invariant = config.batch_invariant and self.is_cuda  # prefill queries run the decode kernel
        self.cascade = config.cascade_attention and self.is_cuda and HAS_TRITON and not self.batch_invariant
        self.max_blocks_per_seq = -(-max_seq_len // self.block_size)
        self.tables = np.zeros((64, self.max_blocks_per_seq), dtype=np.int32)  # row per live sequence
        self.free_rows = list(range(63, -1, -1))
        # the newest step's sampled ids: decode rows whose token is still pending read it here
        self.last_tokens = torch.zeros(max(config.max_num_seqs, config.max_graph_batch_size), dtype=torch.long,
                                       device=self.device)
        self._host_ring = _HostRing(self.last_tokens.shape[0]) if self.is_cuda else None
        self._staging = (_Staging(torch.long), _Staging(torch.float32)) if self.is_cuda else (None, None)
        self.graphs = None
        if self.is_cuda and config.use_cuda_graphs and HAS_TRITON:
            from .cuda_graphs import DecodeGraphs

            on_capture = None
            if link is not None and not self.is_follower:  # the followers capture the same graph in step
                on_capture = lambda bucket, adapter, sample: link.send_capture(  # noqa: E731
                    bucket, sample, [(0, bucket, adapter.name)] if adapter is not None else [])
            self.graphs = DecodeGraphs(
                model, self.kv_cache,
                max_batch_size=min(config.max_graph_batch_size, config.max_num_seqs),
                max_blocks_per_seq=self.max_blocks_per_seq, last_tokens=self.last_tokens,
                forward_only=self.is_follower, on_capture=on_capture, cascade=self.cascade,
            )

    @property
    def block_bytes(self) -> int:
        m = self.model
        kv = m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * m.embed.element_size()
        return kv + self.block_size * getattr(m, "routing_bytes_per_token", 0)

    def _num_blocks_from_memory(self) -> int:
        """The KV cache's blocks in its memory budget, at most MAX_KV_BLOCKS."""
        if self.device.type == "cuda":
            free, _ = cuda_free_bytes(self.device)
            budget = free * self.config.gpu_memory_fraction
        else:
            budget = self.config.cpu_kv_cache_bytes
        return max(2, min(MAX_KV_BLOCKS, int(budget // self.block_bytes)))

    def close(self) -> None:
        """Free the CUDA graphs (the engine's worker has stopped): see `DecodeGraphs.release`."""
        if self.graphs is not None:
            graphs, self.graphs = self.graphs, None
            try:
                graphs.release()
            except Exception as exc:  # a device in an error state: closing goes on
                log.warning("freeing the engine's CUDA graphs failed: %r", exc)

    # ---- block tables ---------------------------------------------------------------------------

    def _table_row(self, seq: Sequence) -> int:
        """seq's row of the host block table, holding its current block_table."""
        if seq.table_row < 0:
            if not self.free_rows:
                old = self.tables.shape[0]
                self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
                self.free_rows = list(range(2 * old - 1, old - 1, -1))
            seq.table_row, seq.num_table_synced = self.free_rows.pop(), 0
        n = len(seq.block_table)
        if seq.num_table_synced != n:
            self.tables[seq.table_row, seq.num_table_synced:n] = seq.block_table[seq.num_table_synced:]
            seq.num_table_synced = n
        return seq.table_row

    def release(self, seq: Sequence) -> None:
        """Give a finished sequence's table row back."""
        if seq.table_row >= 0:
            self.free_rows.append(seq.table_row)
            seq.table_row = -1

    # ---- one step -------------------------------------------------------------------------------

    def transfer(self, transfers: list[tuple[bool, int, int]]) -> None:
        """Queue the copies of KV blocks to and from the host tier (`BlockManager.take_transfers`)
        on the device's stream, before the next step's forward."""
        self.host_cache.run(transfers)

    @torch.inference_mode()
    def prepare(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> PreparedStep:
        """The first half of a step: flatten `batch` into ids, positions, cache slots and sampling
        options, and start copying them to the device (two transfers). Reads no weights and no
        sampled token, so it may run before `previous` is sampled.

        `previous` is the step launched before this one, not yet collected: decode rows whose
        newest token it samples read that token on the device at `launch` (from `last_tokens`,
        which its sampling writes). Its sampling may still be deferred (structured outputs):
        `prepare` needs only its rows.
        """
        ints, floats = _Pack(), _Pack()  # every host array of the step goes over in two transfers
        decode = batch.decode
        bs = self.block_size
        # decode rows, one list per field (a comprehension each: this runs for 256 rows every step)
        input_ids = [s.token_ids[-1] for s in decode]  # PENDING (-1) where a launched step samples it
        lens = [len(s.token_ids) for s in decode]
        has_sources = False
        if previous is not None and previous.rows:
            get = previous.rows.get
            sources = [get(s.seq_id, -1) if s.num_pending else -1 for s in decode]
            has_sources = max(sources, default=-1) >= 0
        if decode:
            rows = np.fromiter(map(self._table_row, decode), dtype=np.int64, count=len(decode))
            pos = np.asarray(lens, dtype=np.int64) - 1
            slots = (self.tables[rows, pos // bs] * bs + pos % bs).tolist()
            positions = pos.tolist()
            if has_sources:  # these rows read their newest token on the device; the id sent is a stand-in
                input_ids = [0 if src >= 0 else t for t, src in zip(input_ids, sources)]
        else:
            slots, positions = [], []
        samplers: list[tuple[Sequence, int]] = []  # prefill sequences that sample: (sequence, flat row of its last token)
        spans, key_slots, cu_q, cu_k, tables = [], [], [0], [0], []
        token_tables: list[tuple[list[int], int, int]] = []  # batch-invariant mode: (blocks, start, n) per chunk
        for seq, n in batch.prefill:
            assert not seq.num_pending, "a sequence is prefilled before its sampled token arrived"
            start = seq.num_computed_tokens
            if not self.use_varlen:
                tables.append(ints.add(seq.block_table))
            spans.append(PrefillSpan(len(input_ids), n, start + n, None))
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            block_ids = np.asarray(seq.block_table, dtype=np.int64)
            pos = np.arange(start + n)
            new_slots = block_ids[pos // self.block_size] * self.block_size + pos % self.block_size
            slots += new_slots[start:].tolist()
            if self.use_varlen:
                key_slots.append(new_slots)
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + start + n)
            if self.batch_invariant:
                token_tables.append((seq.block_table, start, n))
            if start + n == len(seq):
                samplers.append((seq, len(input_ids) - 1))
        seqs = [*decode, *(s for s, _ in samplers)]  # the sampling rows: decode rows first, in order
        params = [s.request.params for s in seqs]

        f_ids, f_pos, f_slots = ints.add(input_ids), ints.add(positions), ints.add(slots)
        f_src = ints.add(sources) if has_sources else None
        f_rows = ints.add([*range(len(decode)), *(r for _, r in samplers)])
        f_seeds = ints.add([s.seed for s in seqs])
        f_counters = ints.add([len(s.token_ids) - s.num_prompt_tokens for s in seqs])
        f_top_k = ints.add([p.top_k if p.top_k > 0 else 0 for p in params])
        f_temp, f_top_p = floats.add([p.temperature for p in params]), floats.add([p.top_p for p in params])
        if decode:
            width = max(len(s.block_table) for s in decode)
            decode_tables = self.tables[rows, :width]
            f_tables = ints.add(decode_tables.ravel())
            f_lens = ints.add(lens)
            if self.cascade:
                f_shared = ints.add([shared_prefix_len(decode_tables, lens, bs)])
        if self.use_varlen and spans:
            f_keys, f_cu = ints.add(np.concatenate(key_slots)), ints.add(cu_q + cu_k)
        if token_tables:  # each prefill token's blocks and key count, as a decode row would have them
            p_width = max(len(b) for b, _, _ in token_tables)
            padded = [np.pad(np.asarray(b, dtype=np.int64), (0, p_width - len(b))) for b, _, _ in token_tables]
            f_p_tables = ints.add(np.repeat(np.stack(padded), [n for _, _, n in token_tables], axis=0).ravel())
            f_p_lens = ints.add(np.concatenate([np.arange(start + 1, start + n + 1) for _, start, n in token_tables]))
        i = ints.send(torch.long, self.device, self._staging[0])
        f = floats.send(torch.float32, self.device, self._staging[1])

        ctx = StepContext(slot_mapping=i(f_slots), num_decode=len(batch.decode), prefill=spans)
        for span, t in zip(spans, tables):
            span.block_table = i(t)
        if batch.decode:
            ctx.decode_block_tables = i(f_tables).view(len(batch.decode), width)
            ctx.decode_context_lens = i(f_lens)
            if self.cascade:
                ctx.decode_shared_prefix = i(f_shared)
        if token_tables:
            ctx.prefill_block_tables = i(f_p_tables).view(-1, p_width)
            ctx.prefill_context_lens = i(f_p_lens)
        if self.use_varlen and spans:
            ctx.prefill_key_slots = i(f_keys)
            cu = i(f_cu).to(torch.int32)
            ctx.cu_q, ctx.cu_k = cu[: len(cu_q)], cu[len(cu_q):]
            ctx.max_q, ctx.max_k = max(s.num_new for s in spans), max(s.context_len for s in spans)
        options = SamplingTensors(
            temperature=f(f_temp), top_k=i(f_top_k), top_p=f(f_top_p), seeds=i(f_seeds), counters=i(f_counters),
            **sampling_flags(list({id(p): p for p in params}.values())),  # a request's samples share one params
        )
        return PreparedStep(batch, seqs, i(f_ids), i(f_src) if has_sources else None, i(f_pos), ctx, i(f_rows), options)

    @torch.inference_mode()
    def stage(self, prepared: PreparedStep) -> None:
        """The part of `launch` that does not read the previous step's sampled ids, so that it may
        run before that step's deferred sampling is queued (structured outputs: while the host
        fills its grammar masks, which are then followed only by the sampling and this launch).

        Binds the batch's adapter (refreshing the copy of A the spare rows hold) and, for a
        decode-only step replayed from a CUDA graph, queues its inputs into the graph's buffers.
        A step that runs eagerly stages nothing more (its forward reads the sampled ids).
        """
        batch, options = prepared.batch, prepared.options
        lora = prepared.lora = self._lora_segments(batch)
        if lora:  # the spare-rows LoRA path: refresh the copy of A if the trainer changed it
            self.model.bind_lora(lora, len(prepared.ids))
        prepared.has_grammar = any(s.grammar is not None for s in prepared.seqs)
        prepared.fused = not (options.needs_truncation or options.num_top_logprobs)
        if not self._graphable(batch, lora):
            return
        ctx = prepared.ctx
        # the RL rollout case samples inside the graph: no top-k/top-p, no top logprobs, no grammar
        prepared.staged = self.graphs.stage(
            prepared.ids, prepared.sources, prepared.positions, ctx.slot_mapping, ctx.decode_block_tables,
            ctx.decode_context_lens, lora[0].adapter if lora else None, prepared.fused and not prepared.has_grammar,
            shared_prefix=ctx.decode_shared_prefix)

    @torch.inference_mode()
    def launch(self, prepared: PreparedStep) -> LaunchedStep | None:
        """Run a prepared step's forward and sampling (after `stage`, which it calls if the caller
        did not); returns its sampling rows (None if no sequence samples). Does not wait for the device.

        The step the batch was prepared against must have been sampled (launched, or
        `sample_deferred`): decode rows read their pending newest token from `last_tokens`.
        """
        if prepared.lora is None:
            self.stage(prepared)
        batch, seqs, ids, ctx, options = prepared.batch, prepared.seqs, prepared.ids, prepared.ctx, prepared.options
        lora, has_grammar, staged = prepared.lora, prepared.has_grammar, prepared.staged
        if staged is None and prepared.sources is not None:  # rows whose newest token is still on the device
            src, n = prepared.sources, len(batch.decode)
            ids[:n] = torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], ids[:n])
        if self.link is not None:  # the followers run this forward with the leader
            self._send_step(prepared)
        if staged is not None:  # a decode-only step, replayed from its CUDA graph
            sampling = (options.temperature, options.seeds, options.counters)
            hidden = self.graphs.replay(staged, sampling if staged.sample else None)
            if staged.sample:
                step = LaunchedStep(seqs, [], self.last_tokens[:len(seqs)], {s.seq_id: j for j, s in enumerate(seqs)})
                self._copy_to_host(step, self.graphs.logprobs[:len(seqs)])
                return step
        else:
            hidden = self.model.forward(ids, prepared.positions, ctx, self.kv_cache, lora)
        if not seqs:
            return None
        step = LaunchedStep(seqs, [], None, {s.seq_id: j for j, s in enumerate(seqs)})
        if has_grammar and staged is not None and prepared.fused:  # a graph computes the logits and samples: sample_deferred()
            self.graphs.stage_masked(hidden, (options.temperature, options.seeds, options.counters))
            step.deferred = (hidden, options, True)
            return step
        logits = self.model.logits(hidden[prepared.sample_rows])  # [S, V]
        if has_grammar:  # structured outputs: sampled by sample_deferred()
            step.deferred = (logits, options, False)
            return step
        self._sample(step, logits, options)
        return step

    @torch.inference_mode()
    def sample_deferred(self, step: LaunchedStep, masks: PendingMasks | ReadyMasks) -> None:
        """Sample a step that has grammar rows, with the bitmasks that `masks` fills once the matchers
        consumed the previous step's tokens (`GrammarMask.compute`'s result, on the host while the
        device runs the step's forward; waited for here). Rows whose sample ended meanwhile may be
        sampled free: their token is dropped anyway."""
        values, options, graphed = step.deferred
        step.deferred = None
        num_rows = len(step.seqs)
        index = GrammarMask.row_index_host(masks.rows, num_rows, pinned=True) if graphed and masks.rows else None
        computed = masks.result()  # (the index was built while the helper filled the masks)
        if graphed and computed is not None:  # logits and masked sampling in one graph launch
            rows, bits = computed
            logprobs, num_allowed = self.graphs.sample_masked(num_rows, bits, index)
            step.grammar_mask = GrammarMask.sampled(rows, num_rows, num_allowed)
            step.grammar_mask.counts_to_host()
            step.token_ids = self.last_tokens[:num_rows]
            self._copy_to_host(step, logprobs)
            return
        logits = self.model.logits(values) if graphed else values
        step.grammar_mask = GrammarMask.to_device(computed, num_rows, self.device)
        self._sample(step, logits, options)

    def _sample(self, step: LaunchedStep, logits: torch.Tensor, options: SamplingTensors) -> None:
        """Sample `step` and start copying its tokens to the host."""
        out = sample(logits, options, step.grammar_mask, exact_logprobs=self.batch_invariant)
        if step.grammar_mask is not None:
            step.grammar_mask.counts_to_host()
        num_rows = out.token_ids.shape[0]
        self.last_tokens[:num_rows].copy_(out.token_ids)
        step.token_ids = self.last_tokens[:num_rows]
        step.host_top_ids, step.host_top_logprobs = (_to_host(t, self.is_cuda) for t in (out.top_ids, out.top_logprobs))
        self._copy_to_host(step, out.logprobs)

    def _copy_to_host(self, step: LaunchedStep, logprobs: torch.Tensor) -> None:
        """Start copying a sampled step's ids (`step.token_ids`) and `logprobs` to the host."""
        if not self.is_cuda:
            step.host_ids, step.host_logprobs = step.token_ids.clone(), logprobs
            return
        step.host_ids, step.host_logprobs = self._host_ring.copy(step.token_ids, logprobs)
        step.done = torch.cuda.Event()
        step.done.record()

    def collect(self, step: LaunchedStep) -> SampledTokens:
        """Wait for a launched step and return its sampled tokens, in row order."""
        if step.done is not None:
            step.done.synchronize()  # the step's one device→host synchronization
        tops = None
        if step.host_top_ids is not None:
            top_ids, top_lps = step.host_top_ids.tolist(), step.host_top_logprobs.tolist()
            tops = [list(zip(top_ids[j][: s.request.params.num_top_logprobs], top_lps[j]))
                    for j, s in enumerate(step.seqs)]
        forced = step.grammar_mask.forced() if step.grammar_mask is not None else None
        return SampledTokens(step.seqs, step.indices, step.host_ids.tolist(), step.host_logprobs.tolist(), tops, forced,
                             step.versions or [0] * len(step.seqs))

    def _send_step(self, prepared: PreparedStep) -> None:
        """Broadcast a launched step's inputs to the followers (the leader of a tensor-parallel group)."""
        ids, staged, n = prepared.ids, prepared.staged, len(prepared.batch.decode)
        if staged is not None and prepared.sources is not None:  # the graph reads these on the device
            src = prepared.sources
            ids = torch.cat([torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], ids[:n]), ids[n:]])
        segments = [(s.start, s.end, s.adapter.name) for s in prepared.lora]
        graph = (staged.bucket, staged.sample) if staged is not None else None
        self.link.send_step(ids, prepared.positions, prepared.ctx, segments, graph)

    @torch.inference_mode()
    def follow(self, message: StepMessage, adapters: dict[str, EngineAdapter]) -> None:
        """Run the leader's forward described by `message` on this follower's shards and cache
        (a CAPTURE: warm up and capture the graph the leader is capturing); `adapters`: this rank's
        adapters of the names the message's segments use."""
        lora = [LoRASegment(start, end, adapters[name]) for start, end, name in message.segments]
        if message.kind == CAPTURE:
            bucket, sample = message.graph
            if lora:
                self.model.bind_lora(lora, bucket)
            self.graphs.capture(bucket, lora[0].adapter if lora else None, sample)
            return
        ids, ctx = message.ids, message.ctx
        if lora:
            self.model.bind_lora(lora, ids.shape[0])
        if message.graph is not None:  # the leader replays a graph of `bucket` rows: so does this rank
            staged = self.graphs.stage(ids, None, message.positions, ctx.slot_mapping, ctx.decode_block_tables,
                                       ctx.decode_context_lens, lora[0].adapter if lora else None, message.graph[1],
                                       shared_prefix=ctx.decode_shared_prefix)
            self.graphs.replay(staged, None)
        else:
            self.model.forward(ids, message.positions, ctx, self.kv_cache, lora)

    def _graphable(self, batch: ScheduledBatch, lora: list[LoRASegment]) -> bool:
        """A decode-only batch that fits a graph bucket, with one adapter (or none) for all rows."""
        if self.graphs is None or batch.prefill or not batch.decode:
            return False
        if len(batch.decode) > self.graphs.max_batch_size:
            return False
        return not lora or (len(lora) == 1 and lora[0].start == 0 and lora[0].end == len(batch.decode))

    def forget_adapter(self, adapter: EngineAdapter) -> None:
        if self.graphs is not None:
            self.graphs.forget(adapter)
        spare = self.model.spare_rows
        if spare is not None and spare.bound is adapter:
            spare.bound = None

    def _lora_segments(self, batch: ScheduledBatch) -> list[LoRASegment]:
        """Contiguous row ranges of the flat batch that share an adapter."""
        segments: list[_Segment] = []
        row = 0
        for seq, n in batch.items():
            name = seq.request.policy.adapter_name
            if segments and segments[-1].end == row and segments[-1].adapter_name == name:
                segments[-1].end += n
            else:
                segments.append(_Segment(row, row + n, name))
            row += n
        return [LoRASegment(s.start, s.end, self.adapter_weights(s.adapter_name)) for s in segments if s.adapter_name]


class _HostRing:
    """Pinned host buffers that sampled ids and logprobs are copied into, reused in turn.

    A step's buffers are read when the step is collected; the engine collects a step before it
    launches the second step after it, so four slots are never overwritten while still unread.
    """

    SLOTS = 4

    def __init__(self, rows: int) -> None:
        self.ids = torch.empty(self.SLOTS, rows, dtype=torch.long, pin_memory=True)
        self.logprobs = torch.empty(self.SLOTS, rows, dtype=torch.float32, pin_memory=True)
        self.next = 0

    def copy(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start copying ids [S] int64 and logprobs [S] float32 (S <= rows) to the next slot; returns its views."""
        slot, n = self.next, ids.shape[0]
        self.next = (slot + 1) % self.SLOTS
        host_ids, host_logprobs = self.ids[slot, :n], self.logprobs[slot, :n]
        host_ids.copy_(ids, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
        return host_ids, host_logprobs


def _to_host(t: torch.Tensor | None, is_cuda: bool) -> torch.Tensor | None:
    """Start copying t to (pinned) host memory; on CPU, t itself."""
    if t is None or not is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass(slots=True)
class _Segment:
    start: int
    end: int
    adapter_name: str | None


class _Pack:
    """Host lists and arrays concatenated into one buffer, sent to the device in one (pinned, async) copy."""

    def __init__(self) -> None:
        self.parts: list = []
        self.size = 0

    def add(self, values) -> tuple[int, int]:
        start = self.size
        self.parts.append(values)
        self.size += len(values)
        return start, len(values)

    def send(self, dtype: torch.dtype, device: torch.device, staging: _Staging | None):
        """Copy to `device` (through `staging`'s pinned memory on a GPU); returns a function from an
        `add` handle to its device slice."""
        np_dtype = np.int64 if dtype == torch.long else np.float32
        arrays = [np.asarray(p, dtype=np_dtype) for p in self.parts]
        if staging is None:
            values = np.concatenate(arrays) if arrays else np.zeros(0, np_dtype)
            buffer = torch.from_numpy(values).to(device)
        else:
            host = staging.take(self.size)
            if arrays:
                np.concatenate(arrays, out=host.numpy())
            buffer = host.to(device, non_blocking=True)
            staging.sent()
        return lambda handle: buffer[handle[0]:handle[0] + handle[1]]


class _Staging:
    """Pinned host buffers that a step's inputs are packed into for one asynchronous copy, used
    in turn; a buffer is reused once the copy out of it has finished (long since, in practice:
    the engine collects a step before it prepares the second step after it)."""

    SLOTS = 3

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self.events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.slot = 0

    def take(self, size: int) -> torch.Tensor:
        """The next pinned buffer, [size] of this dtype, free to overwrite."""
        self.slot = (self.slot + 1) % self.SLOTS
        if self.events[self.slot] is not None:
            self.events[self.slot].synchronize()
        buffer = self.buffers[self.slot]
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[self.slot] = torch.empty(max(size, 1 << 16), dtype=self.dtype, pin_memory=True)
        return buffer[:size]

    def sent(self) -> None:
        """Mark the copy out of the current buffer as queued."""
        event = self.events[self.slot] = torch.cuda.Event()
        event.record()
