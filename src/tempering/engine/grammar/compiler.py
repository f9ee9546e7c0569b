"""GrammarSpec → compiled grammar (cached by spec) → one matcher per sequence, on llguidance.

llguidance (https://github.com/guidance-ai/llguidance, MIT) compiles JSON schemas, regexes and
Lark/GBNF grammars into a lazily built lexer and an Earley parser over the tokenizer's token
trie; a matcher computes the allowed-token bitmask of its parse state and consumes sampled
tokens. Why llguidance rather than xgrammar, with the measurements: docs/guides/structured-outputs.md.

JSON is generated compactly in OpenAI's style (`{"a": 1, "b": [2, 3]}`: no free whitespace), so
a model cannot spend its tokens on newlines and spaces; a schema's own `"x-guidance"` options
override that. Object properties come in the schema's order.
"""

from __future__ import annotations

import collections
import copy
import importlib.util
import itertools
import json
import logging
import os
import threading
from typing import Any

from ...errors import ConfigError, MissingDependencyError
from .spec import GrammarSpec

__all__ = ["MAX_SHARDS", "CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "default_num_shards", "holds_byte_level",
           "import_llguidance", "llguidance_installed"]

log = logging.getLogger("tempering")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_HINTS = {
    "json_schema": "fix the schema, or remove the keyword the error names (the keywords the engine supports: "
                   "https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md)",
    "regex": "fix the regular expression (Rust regex syntax; no lookaround or backreferences)",
    "choice": "send plain strings",
    "grammar": "fix the grammar (Lark syntax, or GBNF as llama.cpp writes it)",
}


def llguidance_installed() -> bool:
    """Whether the grammar library (a dependency of tempering) is installed, without importing it."""
    return importlib.util.find_spec("llguidance") is not None


def import_llguidance() -> Any:
    """The llguidance module.

    Raises:
        MissingDependencyError: if it is not installed, naming the pip extra that installs it.
    """
    try:
        import llguidance
        import llguidance.hf  # the Hugging Face tokenizer bridge
    except ImportError:
        raise MissingDependencyError(
            "structured outputs (response_format, guided_json/regex/choice/grammar, forced tool calls) need "
            "the llguidance package, a dependency of tempering that is missing here: "
            "pip install 'llguidance>=1.6.1,<1.7'"
        ) from None
    return llguidance


MAX_SHARDS = 4
"""The most copies of each compiled grammar that matchers are spread over (round robin), so that
the rows of a step fill their masks on several threads. The matchers copied from one compiled grammar share
its lazily built lexer, and llguidance 1.9 serializes them on it: on an H100 host, consuming 256
tokens and filling 256 masks took 4.2-4.6 ms on one thread and no less on 4-8 threads over one
grammar, but 2.0-2.1 ms on 4-8 threads over 4-8 separately compiled copies (a scratch
measurement; `python benchmarks/structured_outputs.py threads` times the engine's arrangement
against llguidance's own: benchmarks/RESULTS.md). More than 4 gained nothing."""


def default_num_shards() -> int:
    """Copies per grammar, and the threads of llguidance's pool that work on them (`MaskWorker`):
    MAX_SHARDS, but no more than the CPUs less one (the engine thread's); 1 on a 2-core machine,
    where extra copies would only cost compile time."""
    return max(1, min(MAX_SHARDS, (os.cpu_count() or 1) - 1))


class GrammarMatcher:
    """One sequence's position in its grammar (an llguidance `LLMatcher`).

    Attributes:
        inner: the LLMatcher.
        compiler: the GrammarCompiler it came from (its vocabulary size, stop ids and executor).
        shard: which copy of the compiled grammar it came from (matchers of different shards can
            be worked on by different threads at the same time).
        failed: set when a token it was given was not allowed (it is then in llguidance's error
            state for good); the mask code reads this flag instead of asking llguidance every step.
    """

    __slots__ = ("compiler", "failed", "inner", "shard")

    def __init__(self, inner: Any, compiler: GrammarCompiler, shard: int = 0) -> None:
        self.inner = inner
        self.compiler = compiler
        self.shard = shard
        self.failed = False

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and an error state) if the grammar does not allow it."""
        ok = self.inner.consume_token(token_id)
        if not ok:
            self.mark_failed()
        return ok

    def mark_failed(self) -> None:
        """Record (and log, once) that this matcher rejected a token."""
        if not self.failed:
            self.failed = True
            log.warning("a grammar-constrained sample hit a parser error and is ended: %s", self.error[:500])

    @property
    def is_error(self) -> bool:
        return self.inner.is_error()

    @property
    def error(self) -> str:
        return self.inner.get_error()


class CompiledGrammar:
    """A GrammarSpec compiled for one tokenizer. `matcher()` starts a sequence at the grammar's start.

    Attributes:
        spec: what it was compiled from.
        compiler: the GrammarCompiler that compiled it.
    """

    __slots__ = ("_next", "_templates", "compiler", "spec")

    def __init__(self, spec: GrammarSpec, templates: list[Any], compiler: GrammarCompiler) -> None:
        self.spec = spec
        self._templates = templates  # the compiler's num_shards separately compiled copies
        self._next = itertools.count()
        self.compiler = compiler

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher (a copy of a compiled start state: no parsing or lexer work is redone),
        from the grammar's copies in turn."""
        shard = next(self._next) % len(self._templates)
        return GrammarMatcher(self._templates[shard].deep_copy(), self.compiler, shard)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and keeps the most recent ones. Thread-safe.

    The llguidance tokenizer (its token trie) is built on the first `compile` (1-3 s for a 50k to
    150k vocabulary), so servers that never constrain pay nothing.

    Args:
        tokenizer: a Hugging Face *fast* tokenizer, or an `llguidance.LLTokenizer` built some
            other way (e.g. from a tiktoken vocabulary, for benchmarks of models without one).
        stop_token_ids: ids that end a sample; once the grammar is complete these are the only
            allowed tokens.
        end_of_turn_id: the one of them a completed grammar ends on where the grammar library
            takes a single id (llguidance < 1.7): the chat template's end of turn
            (`ChatRenderer.end_of_turn_id`); default: the tokenizer's EOS.
        vocab_size: V, the width of the model's logits (it may exceed `len(tokenizer)`; ids
            past the tokenizer are never allowed). Masks have ceil(V / 32) int32 words per row.
        cache_size: how many compiled grammars to keep (least recently used ones are dropped).
        num_shards: separately compiled copies of each grammar (default: `default_num_shards()`).
    """

    def __init__(self, tokenizer: Any, *, stop_token_ids: list[int], vocab_size: int, cache_size: int = 256,
                 num_shards: int | None = None, end_of_turn_id: int | None = None) -> None:
        if not stop_token_ids:
            raise ConfigError("a grammar needs at least one stop token id to end on")
        self.hf_tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.end_of_turn_id = end_of_turn_id
        self.vocab_size = int(vocab_size)
        self.cache_size = cache_size
        self.num_shards = num_shards if num_shards is not None else default_num_shards()
        self._cache: collections.OrderedDict[GrammarSpec, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._lltokenizer: Any = None
        self._executor: Any = None

    @property
    def num_mask_words(self) -> int:
        """int32 words per bitmask row: ceil(V / 32)."""
        return (self.vocab_size + 31) // 32

    @property
    def executor(self) -> Any:
        """llguidance's executor for filling masks and consuming tokens of many matchers in one call
        on the calling thread (one call: the GIL is released once, not once per row). One thread:
        with llguidance 1.9 its pool over the matchers of one copy was slower than one thread (see
        MAX_SHARDS; the engine's `MaskWorker` runs a pool over rows grouped by copy instead)."""
        self._ensure_tokenizer()
        return self._executor

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled before.

        Raises:
            ConfigError: if the spec cannot be compiled (an invalid schema or a keyword llguidance
                does not support, an invalid regex or grammar); the message names the problem.
            MissingDependencyError: if llguidance is not installed.
        """
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        llg = self._ensure_tokenizer()
        try:
            grammar = _llguidance_grammar(spec, llg)
        except ValueError as exc:
            raise ConfigError(f"{spec.where}: {exc}; {_HINTS[spec.kind]}") from None
        template = llg.LLMatcher(self._lltokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConfigError(f"{spec.where} cannot be used: {template.get_error().strip()}; {_HINTS[spec.kind]}")
        for warning in template.get_grammar_warnings():
            log.warning("%s: %s", spec.where, warning)
        templates = [template] + [llg.LLMatcher(self._lltokenizer, grammar, log_level=0) for _ in range(self.num_shards - 1)]
        compiled = CompiledGrammar(spec, templates, self)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _ensure_tokenizer(self) -> Any:
        llg = import_llguidance()
        with self._lock:
            if self._lltokenizer is None and isinstance(self.hf_tokenizer, llg.LLTokenizer):
                self._lltokenizer = self.hf_tokenizer
                self._executor = llg.LLExecutor(num_threads=1)
            if self._lltokenizer is None:
                try:
                    self._lltokenizer = _lltokenizer(llg, self.hf_tokenizer, self.vocab_size, self.stop_token_ids,
                                                     self.end_of_turn_id)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise ConfigError(f"structured outputs need a fast (tokenizers-backed) tokenizer: {exc}") from None
                self._executor = llg.LLExecutor(num_threads=1)
        return llg


def _lltokenizer(llg: Any, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 end_of_turn_id: int | None = None) -> Any:
    """llguidance's tokenizer, ending a completed grammar on any of `stop_token_ids`.

    llguidance before 1.7 takes one EOS id only (its wheels for glibc 2.28, 1.6.1, among them):
    then a completed grammar ends on `end_of_turn_id`, else on the tokenizer's own EOS. The two
    differ for Gemma 3 (`<end_of_turn>` against `<eos>`) and for SmolLM2 as transformers 5.17
    converts its GGUF (`<|im_end|>` against `<|im_start|>`): a sample ended on the tokenizer's EOS
    then did not render back as it was sampled, so its next turn's prompt was tokenized anew and
    the trainer split the conversation in two (seen on a GPU machine)."""
    hf_tokenizer = _byte_level_decoder(hf_tokenizer)
    try:
        return llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
    except TypeError:  # "'list' object cannot be interpreted as an integer": llguidance < 1.7
        eos = next((t for t in (end_of_turn_id, hf_tokenizer.eos_token_id) if t in stop_token_ids), stop_token_ids[0])
        return llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


def holds_byte_level(component: Any) -> bool:
    """Whether a `tokenizers` decoder or pre-tokenizer is ByteLevel (GPT-2's byte alphabet) or a
    Sequence holding one, read from its own serialization."""

    def found(node: dict) -> bool:
        parts = node.get("pretokenizers") or node.get("decoders") or []
        return node.get("type") == "ByteLevel" or any(found(part) for part in parts)

    return found(json.loads(component.__getstate__()))


def _byte_level_decoder(hf_tokenizer: Any) -> Any:
    """`hf_tokenizer`, or a copy whose decoder is plain ByteLevel where its tokens are byte-level but
    its decoder a Sequence around ByteLevel (transformers 5.17 converts SmolLM2's GGUF tokenizer to
    ByteFallback + Fuse + Replace("▁") + ByteLevel). llguidance recognises byte-level tokens by a
    ByteLevel decoder alone and took those tokens' text for their bytes (the token `Ġ"` as the UTF-8
    bytes of `Ġ` and a quote, not a space and a quote), so a grammar rejected what the model sampled.
    The tokenizer's own decoding is unchanged."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or backend.pre_tokenizer is None:
        return hf_tokenizer
    is_sequence = json.loads(backend.decoder.__getstate__()).get("type") == "Sequence"
    if not is_sequence or not holds_byte_level(backend.decoder) or not holds_byte_level(backend.pre_tokenizer):
        return hf_tokenizer
    from tokenizers import decoders

    fixed = copy.deepcopy(hf_tokenizer)
    fixed.backend_tokenizer.decoder = decoders.ByteLevel()
    return fixed


def _llguidance_grammar(spec: GrammarSpec, llg: Any) -> str:
    """The llguidance grammar text of a spec. Raises ValueError for text that does not convert."""
    if spec.kind == "json_schema":
        if not spec.suffix:
            return llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
        schema = json.loads(spec.text)
        schema["x-guidance"] = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
        lark = f"start: body {json.dumps(spec.suffix)}\nbody: %json {json.dumps(schema)}"
        return llg.LLMatcher.grammar_from_lark(lark)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices))
    return llg.grammar_from("grammar", spec.text)
