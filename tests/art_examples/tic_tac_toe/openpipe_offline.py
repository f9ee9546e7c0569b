"""tempering's stand-in for `openpipe.client.OpenPipe` in the copied tic-tac-toe example (not ART's code).

ART's rollout logs completions to OpenPipe's hosted service only when `OPENPIPE_API_KEY` is set.
The test runs without a key and with no network, so the client is never asked to report; the real
`openpipe` package is not installed because it pins openai < 2. A run that does set the key gets
an error naming the package, which the rollout catches and prints.
"""

from __future__ import annotations

from typing import Any


class OpenPipe:
    def __init__(self, api_key: str | None = None, **_: Any) -> None:
        self.api_key = api_key

    def report(self, **_: Any) -> None:
        raise RuntimeError("reporting to OpenPipe needs the `openpipe` package (pip install openpipe)")

    update_log_metadata = report
