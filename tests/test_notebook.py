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
import struct
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
# the pictures the notebook draws (figures.show(fig, name)): the slot map, the recipe
# comparison, the elastic resume timeline, the running shares of a weighted mix, the
# running shares across a phase boundary, cost shares against sample shares and the
# timeline of even="carry" across epochs, packed blocks with the slots that read them, and the same
# documents packed by fit="concat" and fit="best" side by side
FIGURES = {"slot_map", "recipes", "resume", "mix", "phases", "cost", "carry", "pack", "fits"}
MIN_WIDTH, MIN_HEIGHT = 800, 300  # pixels: readable, not thumbnails

# Inserted before the first cell of the in-memory copy (never saved): proves which
# interpreter and which distshard the kernel runs.
PROBE = "import sys, distshard\nprint('KERNEL-PREFIX', sys.prefix)\nprint('KERNEL-DISTSHARD', distshard.__file__)"


def _kernel_manager(spec_root: Path) -> AsyncKernelManager:
    spec_dir = spec_root / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "distshard test kernel",
                "language": "python",
            }
        )
    )
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
    return [
        base64.b64decode(out.data["image/png"])
        for cell in nb.cells
        for out in _outputs(cell)
        if out.output_type in ("execute_result", "display_data") and "image/png" in out.data
    ]


def _size(png: bytes) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk (always the first one)."""
    assert png.startswith(PNG_MAGIC) and png[12:16] == b"IHDR", png[:16]
    return struct.unpack(">II", png[16:24])


def _errors(nb) -> list[str]:
    return [f"{out.ename}: {out.evalue}" for cell in nb.cells for out in _outputs(cell) if out.output_type == "error"]


@pytest.mark.timeout(600)
def test_the_tour_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    # The kernel inherits this environment: no torchrun variables, quiet debugger, headless plots.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    saved = tmp_path / "figures"  # figures.show() also writes every picture here
    monkeypatch.setenv("DISTSHARD_FIGURES", str(saved))
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
    html = [
        out.data["text/html"]
        for cell in code
        for out in _outputs(cell)
        if out.output_type == "execute_result" and "text/html" in out.data
    ]
    assert any("distshard-explain" in h and "no distributed context found" in h for h in html)
    assert "rank 1 of 4, from the rank= / world_size= arguments" in everything
    assert "len(pipeline) = 62 batches of 4 on every rank; iterated: 62" in everything  # multiple_of=4
    # 2. the pictures: one PNG per figure, shown inline and saved, each readable
    pngs = _pngs(nb)
    assert len(pngs) == len(FIGURES), f"{len(pngs)} image/png outputs, expected {len(FIGURES)}"
    files = {path.stem: path.read_bytes() for path in saved.glob("*.png")}
    assert set(files) == FIGURES, sorted(files)
    assert sorted(files.values()) == sorted(pngs)  # the saved files are the pictures shown
    for name, png in files.items():
        width, height = _size(png)
        assert width >= MIN_WIDTH and height >= MIN_HEIGHT, (name, width, height)
        assert len(png) > 10_000, (name, len(png))  # not blank
    # 3. the comparison, measured: duplicates, missing, decodes per recipe
    assert "classic gist string ids" in everything and "crashes: TypeError" in everything
    rows = {
        m["name"]: tuple(int(g) for g in m.group("dup", "miss", "dec"))
        for m in re.finditer(r"^(?P<name>[^\n]+?) +(?P<dup>\d+) +(?P<miss>\d+) +(?P<dec>\d+)  \[", everything, re.M)
    }
    assert rows["decode, then dist_shard(even='drop')"] == (0, 2, 1000), rows  # 'drop' drops 1002 % 8
    assert rows["classic gist ids 0, 2, 4, …"][:2] == (0, 0), rows
    assert "[251, 0, 250, 0, 250, 0, 251, 0]" in everything  # ... but every worker 1 gets nothing
    for recipe in ("sharding_filter, then decode", "decode, then sharding_filter"):
        assert rows[recipe][0] > 100 and rows[recipe][1] > 100, rows  # unsynced shuffles
    assert rows["decode, then sharding_filter"][2] == 8 * 1002, rows  # every slot decodes everything
    # 4. verify on a real gloo group
    assert "verdict: EXACTLY-ONCE" in everything
    assert "per slot: [250, 250, 250, 250]" in everything
    # 5. resume
    assert "identical to the uninterrupted epoch: True" in everything
    assert "union covers every position exactly once: True" in everything  # elastic: 2x2 -> 3x1
    # 6. mixing by weight: one global stream, every global batch within 1 of its share per source
    assert "reassembled from 8 slots = the unsharded mix: True" in everything
    mixed = re.search(r"^distshard\.mix +worst deviation per global batch of 256: (.*)$", everything, re.M)
    assert mixed and all(float(part.split()[1]) <= 1 for part in mixed.group(1).split(", ")), everything
    # ... in phases, and weighted by tokens: the same stream from 8 slots, the cost bound
    assert "phases: reassembled from 8 slots = the unsharded mix: True" in everything
    assert "math goes on where it stopped: math-99 is its last element before position 1000, math-100" in everything
    assert "cost: reassembled from 8 slots = the unsharded mix: True" in everything
    tokens = re.search(r"^worst token deviation in any prefix: ([0-9.]+) x the largest record", everything, re.M)
    assert tokens and float(tokens.group(1)) <= 1, everything
    # nothing written where the notebook runs
    # 7. even="carry": 4 epochs of 30 draws on 8 slots, against even="drop"
    assert "drop: per-slot counts by epoch [[3], [3], [3], [3]]; 24 of the 120 draws never yielded" in everything
    assert (
        "carry: per-slot counts by epoch [[3], [4], [4], [4]]; 0 of the 120 draws never yielded, 0 yielded twice"
        in everything
    )
    assert "carry: every draw of the 4 epochs yielded exactly once: True" in everything
    assert "carry: draws of epoch e's stream yielded in epoch e + 1: [6, 4, 2]" in everything
    # 8. packing: fit="best" keeps whole documents, cutting only those longer than a block
    assert "best cuts only the documents longer than a block: True" in everything
    assert not any(workdir.iterdir())


def test_the_saved_notebook_shows_its_outputs():
    """What GitHub renders: the notebook is stored executed, without errors."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code), (
        "save the notebook with its outputs (run it top to bottom, then save)"
    )
    assert not _errors(nb)
    pngs = _pngs(nb)
    assert len(pngs) == len(FIGURES)
    assert all(_size(png)[0] >= MIN_WIDTH for png in pngs)
