"""Engines stop their worker threads before the interpreter exits.

ART-style scripts never close their backend. An engine's worker is a daemon thread; at exit the
interpreter stops such a thread where it next takes the GIL, and a thread that is then inside a
torch call (the one-step lookahead, the idle `malloc_trim`) or a grammar call unwinds through
C++ that cannot be unwound: the process aborts with "terminate called without an active
exception" (exit code 134) after the script's work is done. Seen in 1 of 6-8 runs of the
tic-tac-toe recipe on CPU. `atexit` callbacks run before daemon threads are stopped, so closing
every open engine there lets each worker finish its step and return.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class _Closable(Protocol):
    def close(self) -> None: ...


_open_engines: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(engine: _Closable) -> None:
    """Call `engine.close()` at interpreter exit unless the engine was garbage-collected first."""
    _open_engines.add(engine)


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception:  # the others still close
            log.exception("closing an engine at exit failed")
