"""The tour notebook (notebooks/distshard_tour.ipynb) runs top to bottom, headless,
in a fresh kernel of *this* interpreter, so it cannot rot.

The kernel is started from a kernel spec written here whose argv is
``sys.executable``: whatever ``python3`` kernel spec a machine has installed
elsewhere (a user's, a system Jupyter's) is never used.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

import distshard

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "distshard_tour.ipynb"
KERNEL = "distshard-test"
CELL_TIMEOUT = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Inserted before the first cell of the in-memory copy (never saved): proves which
# interpreter and which distshard the kernel runs.
PROBE = (
    "import sys, distshard\n"
    "print('KERNEL-PREFIX', sys.prefix)\n"
    "print('KERNEL-DISTSHARD', distshard.__file__)"
)


def _kernel_manager(spec_root: Path) -> AsyncKernelManager:
    spec_dir = spec_root / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "distshard test kernel",
        "language": "python",
    }))
    specs = KernelSpecManager(kernel_dirs=[str(spec_root)], ensure_native_kernel=False)
    return AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)


def _outputs(cell) -> list:
    return cell.get("outputs", []) if cell.cell_type == "code" else []


def _text(cell) -> str:
    parts = []
    for out in _outputs(cell):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def _pngs(nb) -> list[bytes]:
    return [base64.b64decode(out.data["image/png"])
            for cell in nb.cells for out in _outputs(cell)
            if out.output_type in ("execute_result", "display_data") and "image/png" in out.data]


def _errors(nb) -> list[str]:
    return [f"{out.ename}: {out.evalue}" for cell in nb.cells for out in _outputs(cell)
            if out.output_type == "error"]


@pytest.mark.timeout(600)
def test_the_tour_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    # The kernel inherits this environment: no torchrun variables, quiet debugger, headless plots.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    workdir = tmp_path / "cwd"
    workdir.mkdir()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:  # from scratch: nothing of the saved run survives
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE, id="test-probe"))

    client = NotebookClient(
        nb,
        km=_kernel_manager(tmp_path / "kernels"),
        timeout=CELL_TIMEOUT,
        allow_errors=False,  # a cell that raises fails the test with its traceback
        resources={"metadata": {"path": str(workdir)}},  # the kernel's cwd
    )
    client.execute(cleanup_kc=True)  # shut the kernel down (the client does not own `km`)

    assert not _errors(nb)
    probe = _text(nb.cells[0])
    assert f"KERNEL-PREFIX {sys.prefix}\n" in probe, probe
    assert f"KERNEL-DISTSHARD {distshard.__file__}\n" in probe, probe

    code = [cell for cell in nb.cells[1:] if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code)
    everything = "".join(_text(cell) for cell in code)

    # 1. explain(): HTML as the shard's cell output, text from print()
    html = [out.data["text/html"] for cell in code for out in _outputs(cell)
            if out.output_type == "execute_result" and "text/html" in out.data]
    assert any("distshard-explain" in h and "no distributed context found" in h for h in html)
    assert "rank 1 of 4, from the rank= / world_size= arguments" in everything
    # 2. the picture
    pngs = _pngs(nb)
    assert pngs and all(png.startswith(PNG_MAGIC) and len(png) > 10_000 for png in pngs)
    # 3. the comparison table
    assert "classic recipe, string ids" in everything and "crashes: TypeError" in everything
    row = re.search(r"^shuffle \+ dist_shard\(even='drop'\) +(\d+) +(\d+) ", everything, re.M)
    assert row and row.groups() == ("0", "2"), everything  # no duplicates; 'drop' drops 1002 % 8
    # 4. verify on a real gloo group
    assert "verdict: EXACTLY-ONCE" in everything
    assert "per slot: [250, 250, 250, 250]" in everything
    # 5. resume
    assert "identical to the uninterrupted epoch: True" in everything
    # nothing written where the notebook runs
    assert not any(workdir.iterdir())


def test_the_saved_notebook_shows_its_outputs():
    """What GitHub renders: the notebook is stored executed, without errors."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code), \
        "save the notebook with its outputs (run it top to bottom, then save)"
    assert not _errors(nb)
    assert _pngs(nb)
