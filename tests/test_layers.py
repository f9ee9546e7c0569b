"""House rules that a test can check: no upward imports, a sorted public surface."""

from __future__ import annotations

import ast
from pathlib import Path

import tempering

SRC = Path(tempering.__file__).parent

# Lower layers never import higher ones (DESIGN.md "Layers"); the leaves import no other layer.
RANK = {
    "errors": 0, "types": 0, "chat": 0,
    "storage": 1, "modeling": 1,
    "engine": 2, "training": 2, "parallel": 2,
    "service": 3,
    "backends": 4,
    "tracking": 4.5, "progress": 4.5, "capture": 4.5, "endpoint": 4.5,
    "model": 5, "gather": 5, "rewards": 5, "guided_completion": 5, "pipeline_trainer": 5.5, "sft": 6,
    "trajectories": 5, "utils": 5, "dev": 5, "local": 5,  # ART's module paths (client layer)
    "demo": 6, "integrations": 6, "langgraph": 6.5, "mcp": 6.5, "autorl": 6.5, "cli": 7, "__init__": 8,
}
LEAVES = {"errors", "types", "chat"}


def _layer(module: str) -> str:
    return module.split(".")[0]


def _imports(path: Path) -> set[str]:
    """tempering-internal modules imported by `path`, as dotted names relative to the package."""
    package = path.relative_to(SRC).with_suffix("").parts[:-1]
    out = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # those under `if TYPE_CHECKING:` too: an annotation is a dependency as well
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                target = ".".join(base + ([node.module] if node.module else []))
                if target:
                    out.add(target)
                else:  # `from . import x` at the package root
                    out.update(a.name for a in node.names)
            elif node.module and node.module.startswith("tempering"):
                out.add(node.module.removeprefix("tempering").lstrip(".") or "__init__")
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("tempering.") for a in node.names if a.name.startswith("tempering."))
    return out


def test_no_module_imports_a_higher_layer_and_leaves_import_only_leaves():
    problems = []
    for path in SRC.rglob("*.py"):
        here = _layer(".".join(path.relative_to(SRC).with_suffix("").parts))
        for target in _imports(path):
            there = _layer(target)
            if there == here:
                continue
            if here in LEAVES and there not in LEAVES - {"chat"} | {"errors"}:
                problems.append(f"{path.relative_to(SRC)} (leaf) imports {target}")
            elif there not in LEAVES and RANK[there] >= RANK[here]:
                problems.append(f"{path.relative_to(SRC)} imports {target} (a higher or sibling layer)")
    assert not problems, "\n".join(problems)


def test_public_names_are_sorted_and_importable():
    assert list(tempering.__all__) == sorted(tempering.__all__)
    for name in tempering.__all__:
        assert getattr(tempering, name) is not None


# Public callables whose **kwargs go on to another library's constructor (its options, not ours)
FORWARDS_KWARGS = {"capturing_http_client": "httpx.AsyncClient", "init_chat_model": "langchain_openai.ChatOpenAI"}


def test_public_classes_and_functions_show_their_real_parameters():
    """What help(), IDEs and the API reference show is `inspect.signature`: never a bare
    `(*args, **kwargs)` standing in for the real parameters (LocalBackend's `__new__` once did)."""
    import importlib
    import inspect
    import typing

    problems = []
    for module_name in ("tempering", "tempering.dev", "tempering.utils", "tempering.rewards", "tempering.local",
                        "tempering.trajectories", "tempering.autorl", "tempering.mcp"):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj) or (isinstance(obj, type) and (
                    issubclass(obj, BaseException) or typing.is_typeddict(obj) or getattr(obj, "_is_protocol", False))):
                continue  # exceptions take a message; TypedDicts are dicts; a Protocol is never constructed
            if typing.get_origin(obj) is not None:  # a type alias such as Messages = list[dict[str, Any]]
                continue
            kinds = {p.kind for p in inspect.signature(obj).parameters.values()}
            if inspect.Parameter.VAR_POSITIONAL in kinds or (
                    inspect.Parameter.VAR_KEYWORD in kinds and name not in FORWARDS_KWARGS):
                problems.append(f"{module_name}.{name}{inspect.signature(obj)}")
    assert not problems, "\n".join(problems)
    local_backend = inspect.signature(tempering.LocalBackend).parameters
    assert {"path", "device", "gpus", "in_process", "engine_config"} <= set(local_backend)
