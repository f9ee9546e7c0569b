"""The documentation: the mkdocs site builds with --strict, and the documents keep to the product's words."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_docs_packages() -> list[str]:
    missing = []
    for name in DOCS_PACKAGES:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:  # a parent package is missing
            missing.append(name)
    return missing


def test_the_docs_site_builds_with_strict(tmp_path):
    """A broken link or anchor, a page missing from the nav, or a docstring that does not render fails."""
    missing = _missing_docs_packages()
    if missing:
        pytest.skip(f"the docs extra is not installed (missing {', '.join(missing)}): pip install -e \".[docs]\"")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "reference" / "tempering" / "index.html").is_file()


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md",
            *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("README.md"))]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_documents_describe_the_product_not_how_it_was_built():
    """"session" only as the product uses it (an MCP, HTTP or W&B session); no "lease"."""
    allowed_before_session = {"mcp", "http", "w&b", "wandb", "client"}
    problems = []
    for path in _documents():
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in re.finditer(r"\b(leases?|sessions?)\b", line, re.IGNORECASE):
                before = line[:match.start()].split()
                if match.group(1).lower().startswith("session") and before and before[-1].lower() in allowed_before_session:
                    continue
                problems.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not problems, "words about how the project was developed:\n" + "\n".join(problems)


def test_results_open_with_the_current_figures_table():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    start = text.index("<!-- --8<-- [start:current] -->")
    assert start < text.index("\n## ", text.index("## Current figures") + 1)


def test_the_cli_reference_names_every_command_and_option():
    import typer.main

    from tempering.cli import app

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    missing = [f"tempering {name} {opt}" for name, command in typer.main.get_command(app).commands.items()
               for opt in [f"## `tempering {name}"] + [p.opts[0] for p in command.params if p.opts[0].startswith("--")]
               if f"`{opt}" not in page and opt not in page]
    assert not missing, f"docs/reference/cli.md lacks: {missing}"
