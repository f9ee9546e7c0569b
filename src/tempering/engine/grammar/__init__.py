"""Structured outputs: constrain sampling to a JSON schema, a regex, a choice or a grammar.

`GrammarSpec` (what to match) → `GrammarCompiler.compile` (llguidance, cached by spec) →
`CompiledGrammar.matcher()` per sequence → each step `GrammarMask.fill` / `apply` / `forced`
and `advance` (mask.py describes the order).
"""

from .compiler import (
    MAX_SHARDS,
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    default_num_shards,
    import_llguidance,
    llguidance_installed,
)
from .mask import GrammarMask, MaskWorker, PendingMasks, ReadyMasks, advance
from .spec import GrammarSpec

__all__ = [
    "MAX_SHARDS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMask",
    "GrammarMatcher",
    "MaskWorker",
    "PendingMasks",
    "ReadyMasks",
    "GrammarSpec",
    "advance",
    "default_num_shards",
    "import_llguidance",
    "llguidance_installed",
]
