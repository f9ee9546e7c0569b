"""`init_weave_with_wandb`: start Weave tracing in the W&B project the metrics go to (ART's `art.utils`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import MissingDependencyError

__all__ = ["init_weave_with_wandb"]

log = logging.getLogger("tempering")


def init_weave_with_wandb(project: str) -> Any:
    """`weave.init(project)` when W&B is configured (`WANDB_API_KEY` set), as ART's helper does.

    Afterwards `@weave.op` functions, and rollouts wrapped with `tempering.integrations.tracing`,
    are traced to the W&B project `project` (`"<entity>/<project>"` names the entity too).
    Without `WANDB_API_KEY` nothing is started (logged at INFO). If `weave.init` itself fails
    (no network, a bad key) the failure is logged as a warning and training goes on untraced,
    as in ART.

    Args:
        project: the W&B project, usually the model's `project`.

    Returns:
        the Weave client, or None when nothing was started.

    Raises:
        MissingDependencyError (an ImportError): weave is not installed; the message names
            `pip install "tempering[weave]"`.
    """
    try:
        import weave
    except ImportError as exc:
        raise MissingDependencyError(
            'init_weave_with_wandb needs weave: pip install "tempering[weave]"') from exc
    if not os.environ.get("WANDB_API_KEY"):
        log.info("init_weave_with_wandb(%r): WANDB_API_KEY is not set, so Weave is not started", project)
        return None
    try:
        client = weave.init(project)
    except Exception as exc:  # tracing is optional: a run must not die because its traces cannot be sent
        log.warning("init_weave_with_wandb(%r): weave.init failed, so nothing is traced: %s: %s",
                    project, type(exc).__name__, exc)
        return None
    log.info("Weave is tracing to W&B project %r", project)
    return client
