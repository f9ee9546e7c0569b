"""examples/notebooks/quickstart.ipynb runs top to bottom (nbclient, CPU, one small step) so it never rots."""

from __future__ import annotations

import json
import sys

import nbclient  # in the `test` extra: the notebook must run, never be skipped
import nbformat

from conftest import EXAMPLES


def test_quickstart_notebook_trains_one_step_and_plots(tmp_path, monkeypatch):
    # the kernel runs this interpreter (a machine-wide "python3" kernelspec may name another Python)
    spec = tmp_path / "jupyter" / "kernels" / "tempering-test" / "kernel.json"
    spec.parent.mkdir(parents=True)
    spec.write_text(json.dumps({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                "display_name": "tempering test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    notebook = nbformat.read(EXAMPLES / "notebooks" / "quickstart.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source += f"\nSTEPS, GROUPS_PER_STEP, GROUP_SIZE, NUM_VAL, PATH = 1, 1, 2, 1, {str(tmp_path / 'runs')!r}"
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="tempering-test",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "validation reward before training" in text and "validation reward:" in text
    assert any("image/png" in o.get("data", {}) for o in outputs if o.output_type == "display_data")
    assert list((tmp_path / "runs" / "quickstart" / "models").glob("quickstart-*/checkpoints/0001/adapter_config.json"))
