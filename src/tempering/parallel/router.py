"""Which engine replica (one per GPU) serves a generation request.

Every replica holds the whole model and the live adapter, so any of them can serve any request.
All n samples of a request go to one replica, which prefills the shared prompt once and shares
its KV blocks among them (the engine's prefix cache). Across requests the router prefers the
replica that last served the longest prefix of the prompt, so a conversation's next turn, or an
RL group sent as n separate requests of one prompt (as ART's rollouts do), lands where its
prefix is cached; unless that replica is busier than the least loaded one by more than a slack,
when balance wins. A replica's load is its samples in flight.

Prefixes are tracked as chained hashes of `block_tokens`-token blocks (a hash matches only when
the whole prefix does), plus the whole prompt, in a bounded LRU map on the host.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

__all__ = ["Router", "SubmitFn"]

# submit(prompt_ids, params, *, n, step, on_token) -> Future of n completions
SubmitFn = Callable[..., concurrent.futures.Future]


class Router:
    """Balances requests over replicas with prefix affinity.

    Args:
        replicas: one submit function per replica, `submit(prompt_ids, params, *, n, step,
            on_token) -> concurrent.futures.Future`.
        block_tokens: granularity of the prefix map, in tokens.
        max_prefixes: entries kept in the prefix map (least recently used dropped first).
        min_slack: affinity wins while its replica has at most this many more samples in flight
            than the least loaded one ...
        slack_fraction: ... or this fraction of the least loaded one's load, if larger.
    """

    def __init__(self, replicas: Sequence[SubmitFn], *, block_tokens: int = 64, max_prefixes: int = 1 << 18,
                 min_slack: int = 16, slack_fraction: float = 0.25) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.block_tokens = block_tokens
        self.max_prefixes = max_prefixes
        self.min_slack = min_slack
        self.slack_fraction = slack_fraction
        self.loads = [0] * len(replicas)  # samples in flight per replica
        self.num_requests = [0] * len(replicas)
        self.num_affinity_hits = 0
        self._owners: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def submit(self, prompt_ids: list[int], params: Any, *, n: int = 1, step: int | None = None,
               on_token: Any = None) -> concurrent.futures.Future:
        """Send the request to one replica; its Future of n completions.

        Raises:
            whatever the chosen replica's submit raises (nothing is counted then).
        """
        keys = self._prefix_keys(prompt_ids, step)
        with self._lock:
            replica = self._pick(keys)
            self.loads[replica] += n
            self.num_requests[replica] += 1
        try:
            future = self.replicas[replica](prompt_ids, params, n=n, step=step, on_token=on_token)
        except BaseException:
            with self._lock:
                self.loads[replica] -= n
                self.num_requests[replica] -= 1
            raise
        future.add_done_callback(lambda _: self._done(replica, n))
        return future

    def _done(self, replica: int, n: int) -> None:
        with self._lock:
            self.loads[replica] -= n

    def _pick(self, keys: list[Hashable]) -> int:
        least = min(range(len(self.loads)), key=self.loads.__getitem__)
        owner = next((self._owners[k] for k in reversed(keys) if k in self._owners), None)
        slack = max(self.min_slack, int(self.slack_fraction * self.loads[least]))
        if owner is not None and self.loads[owner] - self.loads[least] <= slack:
            choice = owner
            self.num_affinity_hits += 1
        else:
            choice = least
        for k in keys:
            self._owners[k] = choice
            self._owners.move_to_end(k)
        while len(self._owners) > self.max_prefixes:
            self._owners.popitem(last=False)
        return choice

    def _prefix_keys(self, prompt_ids: list[int], step: int | None) -> list[Hashable]:
        """Chained hashes of the prompt's full blocks, then of the whole prompt (when it does not
        end on a block boundary): key i matches only prompts that share all of blocks 0..i."""
        keys: list[Hashable] = []
        h = hash(("prefix", step))
        b = self.block_tokens
        full = len(prompt_ids) - len(prompt_ids) % b
        for start in range(0, full, b):
            h = hash((h, tuple(prompt_ids[start:start + b])))
            keys.append(h)
        if full < len(prompt_ids):
            keys.append(hash((h, tuple(prompt_ids[full:]), "end")))
        return keys
