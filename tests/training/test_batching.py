import pytest
import torch

from tempering.training.batching import RowShape, pack_sequences
from tempering.training.tokenize import TokenizedSequence


def seq(n, k, start=1):
    return TokenizedSequence(list(range(start, start + n)), [False] * (n - k) + [True] * k,
                             [float("nan")] * (n - k) + [-1.0] * k, advantage=0.5)


def test_packing_respects_the_budget_and_keeps_every_sequence():
    seqs = [seq(n, 2) for n in (10, 3, 7, 9, 4, 10)]
    rows = pack_sequences(seqs, max_tokens=20)
    assert all(r.num_tokens <= 20 for r in rows)
    assert sorted(len(s) for r in rows for s in r.sequences) == sorted(len(s) for s in seqs)
    assert sum(int(r.loss_mask.sum()) for r in rows) == 12
    assert len(rows) == 3  # 43 tokens in rows of 20: no row is wasted


def test_positions_restart_and_sequence_starts_are_never_trained():
    a = TokenizedSequence([5, 6, 7], [True, True, True], [-1.0, -1.0, -1.0], advantage=1.0)  # odd: trained first token
    b = seq(4, 2, start=50)
    [row] = pack_sequences([a, b], max_tokens=100)
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert row.seq_index.tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    assert row.loss_mask.tolist() == [[False, False, True, True, False, True, True]]
    assert row.input_ids.tolist() == [[50, 51, 52, 53, 5, 6, 7]]


@pytest.mark.parametrize("share_prefixes", [False, True])
def test_a_row_padded_to_a_multiple_of_the_tensor_parallel_size_keeps_its_tokens_and_predictions(share_prefixes):
    """Sequence parallelism splits a row's tokens evenly over the ranks: the trainer pads a row of
    43 tokens to 44 (P = 4) with one segment of its own, and nothing else of the row changes."""
    prompt = list(range(100, 120))
    seqs = [TokenizedSequence(prompt + [i, i + 1], [False] * 20 + [True, True], [float("nan")] * 20 + [-1.0, -1.0],
                              advantage=0.5) for i in (1, 3)]
    [micro] = pack_sequences([*seqs, seq(3, 2)], max_tokens=100, share_prefixes=share_prefixes)
    plain, padded = micro.row(), micro.row(RowShape.padded(micro, 4))
    T = micro.num_tokens
    assert T % 4 and len(padded.input_ids) == -(-T // 4) * 4
    assert torch.equal(padded.input_ids[:T], plain.input_ids) and padded.cu_seq_lens[-1] == len(padded.input_ids)
    for name in ("pred_positions", "targets", "advantages", "weights", "seq_index"):
        assert torch.equal(getattr(padded, name), getattr(plain, name)), name
    assert micro.shares_prefixes == share_prefixes
    assert RowShape.padded(micro, 1).num_tokens == T


def test_a_sequence_longer_than_the_budget_gets_its_own_row():
    rows = pack_sequences([seq(50, 2), seq(5, 2)], max_tokens=20)
    assert [r.num_tokens for r in rows] == [50, 5]


def test_groups_that_fit_no_row_whole_are_split_so_that_rows_stay_full():
    """An RL group's prompt held once per row: a group larger than any row's room is split over the
    rows with room, each piece with its own copy of the prompt (rows half empty would cost a CUDA
    graph's padding, or row count)."""
    seqs = []
    for g in range(3):  # 3 groups of 4: a 20-token prompt and 30 sampled tokens each (140 tokens per group)
        prompt = list(range(1000 * g, 1000 * g + 20))
        seqs += [TokenizedSequence(prompt + list(range(100 * i + 500, 100 * i + 530)), [False] * 20 + [True] * 30,
                                   [float("nan")] * 20 + [-1.0] * 30, advantage=0.5) for i in range(4)]
    rows = pack_sequences(seqs, max_tokens=200, share_prefixes=True, min_shared_tokens=8)
    assert sorted(id(s) for r in rows for s in r.sequences) == sorted(id(s) for s in seqs)
    assert all(r.num_tokens <= 200 for r in rows)
    assert sum(int(r.loss_mask.sum()) for r in rows) == 12 * 30
    # whole groups would leave 60 tokens of each of three rows empty; with pieces two rows are 95% full
    assert len(rows) == 3 and sorted(r.num_tokens for r in rows) == [80, 190, 190]
    whole = sum(r.num_tokens for r in pack_sequences(seqs, max_tokens=200))
    assert sum(r.num_tokens for r in rows) < whole


# bfloat16 on a GPU: random tokens have logprobs near -16, where bfloat16 logits are 0.125 apart, so
# packed and separate rows (GEMMs of other shapes) may differ by one such step; a packing error (a row
# attending to its neighbour) moves logprobs by whole nats
DEVICES = [("cpu", torch.float32, 1e-4)] + ([("cuda", torch.float32, 1e-3), ("cuda", torch.bfloat16, 0.25)]
                                             if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,dtype,tol", DEVICES, ids=[f"{d}-{str(t)[6:]}" for d, t, _ in DEVICES])
def test_packed_logprobs_equal_separate_sequences(default_model_dir, device, dtype, tol):
    from transformers import AutoModelForCausalLM

    from tempering.training import Trainer
    from tempering.types import LoRAConfig

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=dtype).to(device)
    trainer = Trainer.new(model, LoRAConfig(rank=4))
    g = torch.Generator().manual_seed(0)
    seqs = [seq(n, n // 2) for n in (23, 11, 17)]
    for s in seqs:
        s.token_ids = torch.randint(10, 40000, (len(s),), generator=g).tolist()
    with torch.no_grad():
        [row] = pack_sequences(seqs, max_tokens=1000)
        packed, _ = trainer._logprobs(row)
        alone = []
        for s in row.sequences:
            [single] = pack_sequences([s], max_tokens=1000)
            alone.append(trainer._logprobs(single)[0])
    assert (packed - torch.cat(alone)).abs().max() < tol


def test_key_entries_no_segment_reads_pass_no_gradient_whatever_it_holds():
    """FlashAttention leaves the gradient of a padded row's unread key entries uninitialized
    (NaN or 1e6 on real weights): the gather that builds the keys drops it."""
    from tempering.training.attention import gather_keys

    x = torch.randn(5, 2, 3, requires_grad=True)
    index = torch.tensor([0, 1, 2, 0, 1, 0, 0, 0])  # 5 entries read, 3 padding entries
    keys = gather_keys(x, index, torch.tensor(5, dtype=torch.int32))
    assert torch.equal(keys, x.detach()[index])
    grad = torch.ones(8, 2, 3)
    grad[5:] = float("nan")  # what the varlen backward may leave there
    keys.backward(grad)
    assert torch.equal(x.grad[:, 0, 0], torch.tensor([2.0, 2.0, 1.0, 0.0, 0.0]))
