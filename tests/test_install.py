"""Installing distshard as the README says, until it is on the registry: build the
wheel from the checkout, install it with an extra into a fresh virtual environment,
and run a sharded pipeline from outside the checkout.

The install is offline: pip takes torch (pinned to 2.13.0) from the machine's local
CPU wheel and the rest from the local package indexes in pip's own configuration,
with ``--isolated`` so nothing else is asked (tests reach nothing beyond this
machine). Without such local sources the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the dev pin (requirements-dev.txt): a local CPU wheel here, GBs elsewhere

# what the fresh environment runs, from a directory outside the checkout
PROGRAM = r"""
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
from torch.utils.data.datapipes.iter import IterableWrapper
import distshard

pq.write_table(pa.table({"id": [f"r{i}" for i in range(23)]}), "rows.parquet", row_group_size=5)
rows = [[r["id"] for r in distshard.parquet(["rows.parquet"]).dist_shard(rank=k, world_size=2, even="drop")]
        for k in range(2)]
words = [list(IterableWrapper([f"w{i}" for i in range(7)]).shuffle().dist_shard(rank=k, world_size=3))
         for k in range(3)]
print(json.dumps({"file": distshard.__file__, "version": distshard.__version__, "rows": rows, "words": words,
                  "requires": __import__("importlib.metadata").metadata.requires("distshard")}))
"""


def _local_sources() -> list[str]:
    """pip options for the local package sources of pip's configuration (file
    indexes and wheel directories), or ``[]`` if it has none."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    indexes, links = [], []
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        for item in value.strip().strip("'\"").split():
            local = item.startswith("file://") or item.startswith("/")
            if key.endswith("index-url") and item.startswith("file://") and item not in indexes:
                indexes.append(item)
            elif key.endswith("find-links") and local and item not in links:
                links.append(item)
    if not indexes:
        return []
    options = ["--index-url", indexes[0]]
    for index in indexes[1:]:
        options += ["--extra-index-url", index]
    for link in links:
        options += ["--find-links", link]
    return options


def _run(command: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done


def test_the_wheel_installs_with_an_extra_and_shards_outside_the_checkout(tmp_path):
    sources = _local_sources()
    if not sources:
        pytest.skip("pip's configuration names no local package index: this test installs offline only")
    # the wheel, built from a copy of the checkout (a build writes into its source tree)
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "pipes", source / "pipes", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            tmp_path / "dist",
            source,
        ]
    )
    [wheel] = (tmp_path / "dist").glob("distshard-*.whl")

    # a fresh virtual environment, the wheel with its parquet extra, torch pinned
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "--python",
            python,
            "install",
            "--no-compile",
            "--quiet",
            *sources,
            f"{wheel}[parquet]",
            TORCH,
        ]
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["DISTSHARD_CACHE"] = str(tmp_path / "cache")
    done = _run([python, "-c", PROGRAM], cwd=elsewhere, env=env)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["file"]).is_relative_to(venv) and not Path(found["file"]).is_relative_to(ROOT)
    assert found["version"] == "0.1.0"
    assert any("pyarrow" in r and 'extra == "parquet"' in r for r in found["requires"]), found["requires"]
    rows = [r for part in found["rows"] for r in part]  # even="drop": 11 a rank, 1 left out
    assert [len(part) for part in found["rows"]] == [11, 11] and len(set(rows)) == 22
    assert set(rows) <= {f"r{i}" for i in range(23)}
    words = [w for part in found["words"] for w in part]
    assert sorted(words) == sorted(f"w{i}" for i in range(7))
    # the console script of the CLI
    _run([venv / "bin" / "distshard", "check", "--help"], cwd=elsewhere, env=env)
