"""Hugging Face Accelerate with ``dist_shard``, in real processes: 2 ranks under
``torchrun --nproc-per-node 2`` and under ``accelerate launch --multi_gpu
--num_processes 2``, each with ``Accelerator(cpu=True)`` (a gloo group on CPU),
running tests/integration_scripts/accelerate_train.py.

* ``accelerator.prepare(DataLoader(pipeline))`` is refused with a ``SetupError`` (a ``RuntimeError``)
  that says what to do, before any batch is trained: with Accelerate's default
  (a ``DataLoaderDispatcher``: rank 0 alone would read, so only its shard would be
  trained) and with ``dispatch_batches=False`` (``IterableDatasetShard`` would
  keep 1 / world_size of every rank's shard).
* The working configuration (prepare the model and optimizer only, iterate the
  DataLoader, move batches to ``accelerator.device``) trains every element kept by
  ``even="drop"`` exactly once over both ranks, with equal steps.

``accelerate launch --cpu --num_processes 2`` starts ONE process (multi-CPU needs
``mpirun`` and ``--mpirun_hostfile``), and ``--cpu --multi_gpu`` is rejected; without
a GPU, ``--multi_gpu --num_processes 2`` starts 2 processes through torchrun's
launcher and ``Accelerator(cpu=True)`` makes them a CPU (gloo) group.

The launchers run in process groups of their own, killed in ``finally`` (torchrun
starts each rank in a session of its own, so the ranks' groups are killed too,
from the pids they record): bounded by ``WAIT`` seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'distshard[integrations]')")

from distshard.verify import free_port  # noqa: E402

from .helpers import LaunchedRun, child_env, kill_leftover_ranks, torchrun_command  # noqa: E402

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="uses fork DataLoader workers, loopback gloo and killpg"
)

SCRIPT = Path(__file__).parent / "integration_scripts" / "accelerate_train.py"
N, BATCH, WORKERS, WORLD, EPOCHS = 203, 4, 2, 2, 2
KEPT_PER_SLOT = N // (WORLD * WORKERS) // BATCH * BATCH  # 50 -> 48: dist_shard(even="drop", multiple_of=4)
WAIT = 150  # seconds for one launch (all its cases)
CASES = ["working", "prepare_no_dispatch", "prepare_no_dispatch_recipe", "prepare_default"]  # default last


class Run(LaunchedRun):  # returncode None: killed after WAIT seconds
    def case(self, name: str) -> list[dict]:
        """Both ranks' results of a case, by rank."""
        return [json.loads(self.rank_file("case", name, rank, ".json").read_text()) for rank in range(WORLD)]


def _env(home: Path) -> dict[str, str]:
    return child_env(HF_HOME=str(home))  # no user's accelerate config file


def launch(out: Path, launcher: list[str]) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    (out / "home").mkdir(exist_ok=True)
    log_path = out / "output.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            launcher + [str(SCRIPT), str(out)] + CASES,
            cwd=out,
            env=_env(out / "home"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            returncode = None
            try:  # SIGTERM first: the agent then stops its ranks itself
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=30)
            time.sleep(0.2)
            kill_leftover_ranks(out, SCRIPT.name)
    return Run(out, returncode, log_path.read_text(errors="replace"))


def _accelerate_launch() -> list[str]:
    script = Path(sys.executable).with_name("accelerate")
    return [str(script), "launch"] if script.exists() else [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory) -> Run:
    run = launch(
        tmp_path_factory.mktemp("torchrun"),
        torchrun_command()
        + ["--nproc-per-node", str(WORLD), "--master-addr", "127.0.0.1", "--master-port", str(free_port())],
    )
    assert run.returncode is not None, f"torchrun did not end in {WAIT}s:\n{run.tail()}"
    return run


@pytest.fixture(scope="module")
def accelerate_launch(tmp_path_factory) -> Run:
    run = launch(
        tmp_path_factory.mktemp("accelerate_launch"),
        _accelerate_launch()
        + [
            "--multi_gpu",
            "--num_processes",
            str(WORLD),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(free_port()),
        ],
    )
    assert run.returncode is not None, f"accelerate launch did not end in {WAIT}s:\n{run.tail()}"
    return run


def check_working(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["error"] is None, result["error"]
        assert (result["world"], result["distributed_type"]) == (WORLD, "DistributedType.MULTI_CPU")
    batches_per_rank = WORKERS * KEPT_PER_SLOT // BATCH  # 24
    for epoch in range(EPOCHS):
        steps = [result["steps"][epoch] for result in ranks]
        assert steps == [batches_per_rank] * WORLD, f"epoch {epoch}: steps {steps}"
        trained = [i for result in ranks for i in result["ids"][epoch]]
        assert len(trained) == len(set(trained)) == WORLD * WORKERS * KEPT_PER_SLOT, f"epoch {epoch}"  # 192 once
        assert set(trained) <= set(range(N))  # 11 dropped: the tail
        assert [len(result["ids"][epoch]) for result in ranks] == [WORKERS * KEPT_PER_SLOT] * WORLD
    assert all(result["len"] == batches_per_rank for result in ranks)  # len(loader) is exact


def check_refused(result: dict, wrapper: str) -> None:
    error = result["error"]
    # distshard.SetupError, a RuntimeError: re-raised by the DataLoader under its own name
    assert error is not None and error.startswith("SetupError"), error
    assert wrapper in error and "accelerator.prepare()" in error, error
    assert "batch.to(accelerator.device)" in error, error  # says what to do
    assert result["batches_before_error"] == 0 and result["ids"] == [[]], result


def test_working_configuration_trains_each_kept_element_once(torchrun):
    check_working(torchrun.case("working"))


def test_prepare_with_dispatch_batches_false_is_refused_on_every_rank(torchrun):
    ranks = torchrun.case("prepare_no_dispatch")
    for result in ranks:
        assert result["prepared"] == "DataLoaderShard"
        check_refused(result, "IterableDatasetShard")


def test_prepare_with_dispatch_batches_false_and_the_recipes_loader_fails_in_accelerate(torchrun):
    """With the recipe's own DataLoader(batch_size=None), Accelerate's IterableDatasetShard
    multiplies None by the world size before it reads the pipeline: its TypeError comes
    first, on every rank, before any batch; len() carries distshard's refusal as its cause
    (docs/integrations.md says exactly this)."""
    for result in torchrun.case("prepare_no_dispatch_recipe"):
        assert result["prepared"] == "DataLoaderShard"
        assert result["error"].startswith("TypeError") and "'NoneType' and 'int'" in result["error"], result
        assert result["batches_before_error"] == 0 and result["ids"] == [[]], result
        assert result["len_error"].startswith("TypeError"), result
        assert result["len_cause"].startswith("SetupError: Accelerate's IterableDatasetShard"), result


def test_prepare_with_defaults_is_refused_before_any_batch(torchrun):
    """Accelerate's default for an iterable dataset, DataLoaderDispatcher: rank 0 alone
    iterates, so it is the rank that raises; rank 1 waits for rank 0's batches and
    fails when rank 0's process ends. No rank trains a batch."""
    rank0, rank1 = torchrun.case("prepare_default")
    assert rank0["prepared"] == rank1["prepared"] == "DataLoaderDispatcher"
    check_refused(rank0, "DataLoaderDispatcher")
    assert rank1["error"] is not None and rank1["batches_before_error"] == 0, rank1


def test_accelerate_launch_cpu_processes(accelerate_launch):
    check_working(accelerate_launch.case("working"))
    check_refused(accelerate_launch.case("prepare_default")[0], "DataLoaderDispatcher")
    check_refused(accelerate_launch.case("prepare_no_dispatch")[0], "IterableDatasetShard")
