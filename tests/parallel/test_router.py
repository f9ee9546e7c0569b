"""The router: all n samples of a request on one replica, prefix affinity, balance by load."""

from __future__ import annotations

import concurrent.futures

from tempering.parallel import Router


class Replica:
    """A replica that records its requests and finishes them when told."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], int]] = []
        self.futures: list[concurrent.futures.Future] = []

    def __call__(self, prompt_ids, params, *, n, step, on_token):
        self.requests.append((prompt_ids, n))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.futures.append(future)
        return future

    def finish_all(self) -> None:
        for f in self.futures:
            if not f.done():
                f.set_result([])


def prompt(seed: int, length: int = 150) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(length)]


def test_distinct_prompts_are_balanced_and_each_request_stays_whole():
    replicas = [Replica(), Replica()]
    router = Router(replicas)
    for i in range(32):
        router.submit(prompt(i), None, n=8)
    assert [len(r.requests) for r in replicas] == [16, 16]
    assert all(n == 8 for r in replicas for _, n in r.requests)
    assert router.loads == [128, 128]


def test_separate_requests_of_one_prompt_follow_its_prefix_while_loads_are_close():
    replicas = [Replica(), Replica()]
    router = Router(replicas, min_slack=8)
    for group in range(4):  # ART-style groups: 8 requests of one prompt each, n=1
        for _ in range(8):
            router.submit(prompt(100 + group), None, n=1)
    for group in range(4):  # every request of a group went to one replica
        sent = [k for k, r in enumerate(replicas) if any(p == prompt(100 + group) for p, _ in r.requests)]
        assert len(sent) == 1, group
    assert [len(r.requests) for r in replicas] == [16, 16]
    assert router.num_affinity_hits == 28


def test_the_next_turn_of_a_conversation_goes_where_its_history_is():
    replicas = [Replica(), Replica()]
    router = Router(replicas)
    first = prompt(1, 300)
    router.submit(first, None, n=1)
    router.submit(prompt(2, 300), None, n=1)  # another conversation, on the other replica
    router.submit(first + [5, 6, 7] * 40, None, n=1)  # turn 2 extends turn 1
    assert [len(r.requests) for r in replicas] == [2, 1]
    assert replicas[0].requests[1][0][:300] == first


def test_balance_wins_over_affinity_past_the_slack():
    replicas = [Replica(), Replica()]
    router = Router(replicas, min_slack=4, slack_fraction=0.0)
    for _ in range(5):
        router.submit(prompt(9), None, n=1)
    assert [len(r.requests) for r in replicas] == [5, 0]  # loads 4 vs 0 still within the slack
    router.submit(prompt(9), None, n=1)
    assert [len(r.requests) for r in replicas] == [5, 1]  # 5 vs 0: past it


def test_finished_requests_leave_the_load_and_a_failed_submit_is_not_counted():
    replicas = [Replica(), Replica()]
    router = Router(replicas)
    for i in range(4):
        router.submit(prompt(i), None, n=2)
    replicas[0].finish_all()
    assert router.loads == [0, 4]

    def broken(*args, **kwargs):
        raise ValueError("prompt too long")

    router.replicas[0] = broken
    try:
        router.submit(prompt(50), None, n=3)
    except ValueError:
        pass
    assert router.loads == [0, 4] and router.num_requests == [2, 2]
