"""Every notebook runs top to bottom (at reduced sizes), so none can rot."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_are_there():
    assert {p.stem for p in NOTEBOOKS} == {"kv_budget", "eviction_practice", "tradeoffs"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch, tmp_path):
    monkeypatch.setenv("KVC_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("KVC_NOTEBOOK_OUT", str(tmp_path))
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(notebook, timeout=900, kernel_name="python3", resources=resources).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors


def _outputs(path):
    notebook = nbformat.read(path, as_version=4)
    return [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_hold_no_warnings_bars_or_machine_paths(path):
    outputs = _outputs(path)
    assert outputs, "the committed notebook was not executed"
    assert [o.get("text", "")[:80] for o in outputs if o.get("name") == "stderr"] == []
    texts = [o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs]
    for marker in ("/work/", "/home/", "/root/", "/tmp/", "site-packages", "Warning"):
        assert not [t for t in texts if marker in t], marker


def test_kv_budget_draws_the_measured_bytes():
    kv_budget = NOTEBOOKS[[p.stem for p in NOTEBOOKS].index("kv_budget")]
    assert any("image/png" in o.get("data", {}) for o in _outputs(kv_budget))
