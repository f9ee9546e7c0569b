from tempering.training.batching import make_micro_batches
from tempering.training.tokenize import TokenizedSequence


def seq(n, k):
    return TokenizedSequence([1] * n, [False] * (n - k) + [True] * k, [float("nan")] * (n - k) + [-1.0] * k, advantage=0.5)


def test_micro_batches_respect_the_token_budget_and_keep_every_sequence():
    seqs = [seq(n, 2) for n in (10, 3, 7, 9, 4, 10)]
    batches = make_micro_batches(seqs, max_tokens=20)
    assert all(b.input_ids.numel() <= 20 for b in batches)
    assert sum(int(b.attention_mask.sum()) for b in batches) == sum(len(s) for s in seqs)
    assert sum(int(b.loss_mask.sum()) for b in batches) == 12


def test_padding_is_never_trained_and_advantage_covers_the_sequence():
    [b] = make_micro_batches([seq(5, 2), seq(3, 1)], max_tokens=100)
    assert b.loss_mask.tolist() == [[False, False, False, True, True], [False, False, True, False, False]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert b.advantages[1, :3].tolist() == [0.5, 0.5, 0.5]


def test_a_sequence_longer_than_the_budget_gets_its_own_batch():
    batches = make_micro_batches([seq(50, 2), seq(5, 2)], max_tokens=20)
    assert [b.input_ids.shape for b in batches] == [(1, 50), (1, 5)]
