"""PyTorch Lightning: ``Trainer(accelerator="cpu", strategy="ddp", devices=2)`` fitting on
``dist_shard`` pipelines, in real processes (tests/integration_scripts/lightning_fit.py).

Lightning's DDP launcher re-runs the script for rank 1, so the training runs as a
subprocess of the test, in a process group of its own that is killed in ``finally``
(Lightning starts rank 1 and the DataLoader workers in that group too): bounded by
``WAIT`` seconds, and every collective raises after ``DDP_TIMEOUT`` seconds. To
pay the start-up of two Lightning processes only twice, one script run fits many
*phases* one after the other in the same two processes (``PHASES``), and a second
one shows what torch's ``sharding_filter`` does with uneven ranks (it stalls).

Every rank logs every element id it trained on (and validated), per epoch, to a
file per rank and phase; the tests compare the union over both ranks with the
elements the documented ``even="drop"`` tail leaves (computed from the same
seeded order), and the steps of the two ranks with each other and with
``len(loader)``.

What Lightning 2.6.6 does with a stateful train DataLoader (``state_dict`` /
``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``): its fit loop saves the
loader's ``state_dict()`` in the checkpoint (``loops.fit_loop.state_dict.combined_loader``)
and loads it back before the loader's iterator is created. Under DDP only rank 0
writes the checkpoint, so every rank is handed rank 0's position: ``dist_shard``
refuses it on rank 1 (``test_lightning_alone_gives_every_rank_rank0s_position``).
The callback ``LoaderStatePerRank`` (docs/integrations.md) stores every rank's
state and makes the resume exact (``test_resume_mid_epoch_through_lightnings_checkpoint``).

``ModelParallelStrategy`` (tensor parallel over 2 CPU processes, a pipeline built with
``mesh=self.device_mesh["data_parallel"]``) runs its own script
(tests/integration_scripts/lightning_model_parallel.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip(
    "pytorch_lightning",
    reason="pytorch-lightning is not installed (pip install 'distshard[integrations]')",
)

from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402

import distshard  # noqa: E402,F401  (registers .dist_shard, used by order())
from distshard.verify import free_port  # noqa: E402

from .helpers import LaunchedRun, child_env  # noqa: E402

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="uses fork DataLoader workers, loopback gloo and killpg"
)

SCRIPT = Path(__file__).parent / "integration_scripts" / "lightning_fit.py"
N, BATCH, SEED = 203, 4, 7  # 203 is not a multiple of any slot count used here
N_VAL, VAL_FIRST = 61, 1000  # validation elements: 1000 .. 1060
WORLD = 2
CKPT_STEP = 7  # mid-epoch: 2 workers have delivered 4 and 3 batches
WAIT = 240  # seconds for one script run (all its phases)
DDP_TIMEOUT = 60  # seconds any collective may wait before raising

PHASES = [
    # the pipeline users build: dist_shard(even="drop", multiple_of=4), default seed
    {"name": "workers0", "workers": 0},
    {"name": "workers2", "workers": 2, "seed": SEED},
    # controls
    {"name": "no_multiple_of", "workers": 2, "shard": "drop", "seed": SEED},
    {"name": "sharding_filter", "workers": 2, "shard": "sharding_filter"},
    {"name": "unsharded", "workers": 2, "shard": "none", "epochs": 1, "val": False},
    # checkpoint mid-epoch, resume through Lightning's own checkpoint (+ the recipe)
    {
        "name": "ckpt_save",
        "workers": 2,
        "stateful": True,
        "seed": SEED,
        "recipe": True,
        "max_steps": CKPT_STEP,
        "save_every": CKPT_STEP,
    },
    {"name": "ckpt_resume", "workers": 2, "stateful": True, "seed": SEED, "recipe": True, "resume": "ckpt_save"},
    {
        "name": "ckpt0_save",
        "workers": 0,
        "stateful": True,
        "seed": SEED,
        "recipe": True,
        "max_steps": CKPT_STEP,
        "save_every": CKPT_STEP,
    },
    {"name": "ckpt0_resume", "workers": 0, "stateful": True, "seed": SEED, "recipe": True, "resume": "ckpt0_save"},
    {
        "name": "no_multiple_of_save",
        "workers": 2,
        "shard": "drop",
        "stateful": True,
        "seed": SEED,
        "recipe": True,
        "max_steps": CKPT_STEP,
        "save_every": CKPT_STEP,
    },
    {
        "name": "no_multiple_of_resume",
        "workers": 2,
        "shard": "drop",
        "stateful": True,
        "seed": SEED,
        "recipe": True,
        "resume": "no_multiple_of_save",
    },
    # persistent_workers=True: every epoch reaches the workers, also after a resume
    {"name": "persistent", "workers": 2, "seed": SEED, "persistent": True},
    {
        "name": "ckpt_persistent_save",
        "workers": 2,
        "stateful": True,
        "seed": SEED,
        "recipe": True,
        "persistent": True,
        "max_steps": CKPT_STEP,
        "save_every": CKPT_STEP,
    },
    {
        "name": "ckpt_persistent_resume",
        "workers": 2,
        "stateful": True,
        "seed": SEED,
        "recipe": True,
        "persistent": True,
        "resume": "ckpt_persistent_save",
    },
    # last, as it ends the run: Lightning alone hands rank 0's position to rank 1
    {"name": "resume_without_recipe", "workers": 2, "stateful": True, "seed": SEED, "resume": "ckpt_save"},
]
EXPECTED_TO_FAIL = "resume_without_recipe"


# -- running the script ------------------------------------------------------------------


class Run(LaunchedRun):  # returncode None: killed after WAIT seconds
    def phase(self, name: str) -> dict[int, list[dict]]:
        """``{rank: records}`` of a phase; fails with the run's output if it did not run."""
        found = {}
        for rank in range(WORLD):
            text = self.rank_file("phase", name, rank, ".jsonl").read_text()
            found[rank] = [json.loads(line) for line in text.splitlines() if line]
        return found


def _env(port: int) -> dict[str, str]:
    return child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run_script(out: Path, phases: list[dict]) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    phases = [
        dict(p, resume=str(out / f"{p['resume']}-ckpt" / f"step={CKPT_STEP}.ckpt")) if "resume" in p else p
        for p in phases
    ]
    config = out / "config.json"
    config.write_text(
        json.dumps(
            {
                "out": str(out),
                "n_train": N,
                "n_val": N_VAL,
                "val_first": VAL_FIRST,
                "ddp_timeout": DDP_TIMEOUT,
                "phases": phases,
            }
        )
    )
    return launch(SCRIPT, str(config), out)


def launch(script: Path, argument: str, out: Path) -> Run:
    """Run ``script argument`` (Lightning starts rank 1 from it) in ``out``, bounded by
    ``WAIT``, killing its process group (rank 1, DataLoader workers) after."""
    log_path = out / "output.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), argument],
            cwd=out,
            env=_env(free_port()),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:  # rank 1 and every DataLoader worker are in this process group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=30)
    return Run(out, returncode, log_path.read_text(errors="replace"))


@pytest.fixture(scope="module")
def fit(tmp_path_factory) -> Run:
    run = run_script(tmp_path_factory.mktemp("lightning"), PHASES)
    assert run.returncode is not None, f"the Lightning run did not end in {WAIT}s:\n{run.tail()}"
    return run


# -- what the records say -----------------------------------------------------------------


def batches(records: list[dict], kind: str, epoch: int) -> list[dict]:
    return [r for r in records if r["kind"] == kind and r["epoch"] == epoch]


def ids(records: list[dict], kind: str, epoch: int) -> list[int]:
    return [i for r in batches(records, kind, epoch) for i in r["ids"]]


def end(records: list[dict]) -> dict:
    ends = [r for r in records if r["kind"] == "end"]
    assert ends, f"no end record: {records[-3:]}"
    return ends[-1]


def order(n: int, seed: int, epoch: int) -> list[int]:
    """The epoch's stream every slot shares: the shuffled ids, seeded from (seed, epoch)."""
    dp = IterableWrapper(range(n)).shuffle().dist_shard(rank=0, world_size=1, seed=seed)
    dp.set_epoch(epoch)
    return list(dp)


def kept(n: int, workers: int, multiple: int = BATCH) -> int:
    """Elements one slot yields with dist_shard(even="drop", multiple_of=multiple)."""
    slots = WORLD * max(1, workers)
    return n // slots // multiple * multiple


def shares(stream: list[int], workers: int, per_slot: int, multiple: int = 1) -> dict[int, set[int]]:
    """What each rank must train. Without multiple_of, position p goes to slot p % S
    (slot = rank * W + worker) and every slot keeps its first ``per_slot`` positions
    (the rest is the dropped tail). With multiple_of=b, chunks of b positions go to
    rank c % WORLD and worker (c // WORLD) % W (the DataLoader's order of batches),
    whole rounds of chunks only."""
    w = max(1, workers)
    slots = WORLD * w
    if multiple > 1:
        from distshard.plan import chunk_positions

        out = {
            rank: {
                stream[p] for worker in range(w) for p in chunk_positions(rank, WORLD, worker, w, len(stream), multiple)
            }
            for rank in range(WORLD)
        }
        assert all(len(v) == per_slot * w for v in out.values())
        return out
    return {
        rank: {x for p, x in enumerate(stream[: slots * per_slot]) if (p % slots) // w == rank} for rank in range(WORLD)
    }


def violations(trained: dict[int, list[int]], expected: dict[int, set[int]]) -> list[str]:
    """Everything wrong with one epoch over all ranks: duplicates, missing elements,
    unexpected ones, and ranks that trained another rank's share."""
    problems = []
    counts = Counter(i for rank_ids in trained.values() for i in rank_ids)
    repeated = sorted(i for i, c in counts.items() if c > 1)
    if repeated:
        problems.append(f"{sum(counts[i] - 1 for i in repeated)} duplicates, e.g. {repeated[:6]}")
    wanted = set().union(*expected.values())
    missing, extra = sorted(wanted - set(counts)), sorted(set(counts) - wanted)
    if missing:
        problems.append(f"{len(missing)} missing, e.g. {missing[:6]}")
    if extra:
        problems.append(f"{len(extra)} not expected, e.g. {extra[:6]}")
    for rank, rank_ids in trained.items():
        if set(rank_ids) != expected[rank]:
            problems.append(f"rank {rank} trained {len(rank_ids)} elements, not its share of {len(expected[rank])}")
    return problems


def imbalance(trained: dict[int, list[int]], steps: list[int], announced) -> list[str]:
    """What keeps DDP ranks from stepping together: unequal shares or steps, and a
    len() (Lightning's epoch length) that is not what the ranks got."""
    problems = []
    counts = [len(trained[rank]) for rank in range(WORLD)]
    if len(set(counts)) > 1:
        problems.append(f"unequal elements per rank: {counts}")
    if len(set(steps)) > 1:
        problems.append(f"unequal steps per rank: {steps}")
    if announced != "inf" and any(s != announced for s in steps):
        problems.append(f"len() announced {announced} batches, ranks took {steps}")
    return problems


def check_validation(phase: dict[int, list[dict]], workers: int, epochs: int = 2) -> None:
    per_slot = kept(N_VAL, workers)
    expected = shares(list(range(VAL_FIRST, VAL_FIRST + N_VAL)), workers, per_slot, BATCH)
    for epoch in range(epochs):
        seen = {rank: ids(phase[rank], "val", epoch) for rank in range(WORLD)}
        assert violations(seen, expected) == [], f"validation, epoch {epoch}"
        assert len(batches(phase[0], "val", epoch)) == len(batches(phase[1], "val", epoch))


# -- dist_shard(even="drop", multiple_of=4) under Lightning DDP --------------------------------


def test_fit_without_workers_trains_each_kept_element_once_with_equal_steps(fit):
    """Default seed (the DataLoader's, shared over the process group): the order is not
    known here, so the count of the dropped tail is checked, not which elements."""
    phase = fit.phase("workers0")
    per_slot = kept(N, 0)  # 203 // 2 = 101 -> 100
    for rank in range(WORLD):
        assert end(phase[rank])["error"] is None, end(phase[rank])
    for epoch in range(2):
        trained = {rank: ids(phase[rank], "train", epoch) for rank in range(WORLD)}
        everything = [i for rank_ids in trained.values() for i in rank_ids]
        assert len(everything) == len(set(everything)) == WORLD * per_slot  # 200, once each
        assert set(everything) <= set(range(N))  # 3 dropped
        assert [len(trained[r]) for r in range(WORLD)] == [per_slot] * WORLD
        steps = [len(batches(phase[r], "train", epoch)) for r in range(WORLD)]
        assert steps == [per_slot // BATCH] * WORLD  # 25 and 25
        assert imbalance(trained, steps, end(phase[0])["num_training_batches"]) == []
    for rank in range(WORLD):
        assert end(phase[rank])["global_step"] == 2 * per_slot // BATCH
        assert end(phase[rank])["num_training_batches"] == end(phase[rank])["len"] == per_slot // BATCH
    check_validation(phase, workers=0)


def test_fit_with_two_workers_trains_exactly_the_kept_elements_with_equal_steps(fit):
    phase = fit.phase("workers2")
    per_slot = kept(N, 2)  # 203 // 4 = 50 -> 48
    for epoch in range(2):
        expected = shares(order(N, SEED, epoch), 2, per_slot, BATCH)
        trained = {rank: ids(phase[rank], "train", epoch) for rank in range(WORLD)}
        assert violations(trained, expected) == [], f"epoch {epoch}"
        steps = [len(batches(phase[r], "train", epoch)) for r in range(WORLD)]
        assert steps == [2 * per_slot // BATCH] * WORLD  # 24 and 24
        assert imbalance(trained, steps, end(phase[0])["num_training_batches"]) == []
        assert all(
            len(b["ids"]) == BATCH for r in range(WORLD) for b in batches(phase[r], "train", epoch)
        )  # no partial batch
    assert order(N, SEED, 0) != order(N, SEED, 1)  # set_epoch reached the pipeline
    for rank in range(WORLD):
        record = end(phase[rank])
        assert record["error"] is None and record["global_step"] == 2 * 24
        assert record["num_training_batches"] == record["len"] == 24  # len() is exact
    check_validation(phase, workers=2)


def test_without_multiple_of_len_is_refused_and_lightning_trains_every_element(fit):
    """Control: without multiple_of, len() of the batched pipe raises TypeError naming
    multiple_of; Lightning then runs the loader to its end, partial batches included,
    so only even="drop"'s own tail (203 % 4 = 3 elements) is left out."""
    phase = fit.phase("no_multiple_of")
    for rank in range(WORLD):
        record = end(phase[rank])
        assert record["error"] is None
        assert record["num_training_batches"] == "inf"
        assert record["len"].startswith("TypeError") and "multiple_of=4" in record["len"]
    for epoch in range(2):
        expected = shares(order(N, SEED, epoch), 2, N // (WORLD * 2))  # 50 per slot
        trained = {rank: ids(phase[rank], "train", epoch) for rank in range(WORLD)}
        assert violations(trained, expected) == [], f"epoch {epoch}"
        steps = [len(batches(phase[r], "train", epoch)) for r in range(WORLD)]
        assert steps == [2 * 13] * WORLD  # 13 batches per worker, the last of 2


def test_sharding_filter_control_is_flagged(fit):
    """Control: torch's sharding_filter under Lightning. The DataLoader shards it once
    the process group exists, so each element is trained once here; but the ranks get
    unequal shares (102 and 101) and len() announces 51 batches where each rank
    gets 26. The balance check that passes for dist_shard flags both."""
    phase = fit.phase("sharding_filter")
    trained = {rank: ids(phase[rank], "train", 0) for rank in range(WORLD)}
    everything = [i for rank_ids in trained.values() for i in rank_ids]
    assert sorted(everything) == list(range(N))
    steps = [len(batches(phase[r], "train", 0)) for r in range(WORLD)]
    announced = end(phase[0])["num_training_batches"]
    assert ([len(trained[r]) for r in range(WORLD)], steps, announced) == ([102, 101], [26, 26], 51)
    problems = imbalance(trained, steps, announced)
    assert problems == ["unequal elements per rank: [102, 101]", "len() announced 51 batches, ranks took [26, 26]"], (
        problems
    )


def test_unsharded_control_duplicates_are_detected(fit):
    """Control: the same run with no sharding at all: the check reports the duplicates."""
    phase = fit.phase("unsharded")
    trained = {rank: ids(phase[rank], "train", 0) for rank in range(WORLD)}
    problems = violations(trained, shares(list(range(N)), 2, N // 4))
    assert any("duplicates" in p for p in problems), problems


def test_sharding_filter_uneven_ranks_stall_ddp(tmp_path):
    """Control: sharding_filter on 201 elements without workers gives rank 0 101
    elements (26 batches) and rank 1 100 (25): Lightning expects 26 steps on rank 0
    and 25 on rank 1, and the ranks stop stepping together (a collective one rank
    waits in is never joined): the run stalls and is stopped. dist_shard(even="drop",
    multiple_of=4) gives both ranks 25 (test_fit_without_workers_...)."""
    run = run_script(
        tmp_path, [{"name": "uneven", "workers": 0, "shard": "sharding_filter", "n_train": 201, "stall_after": 8}]
    )
    assert run.returncode is not None, run.tail()
    phase = run.phase("uneven")
    expected = [[r["num_training_batches"] for r in phase[rank] if r["kind"] == "epoch"][0] for rank in range(WORLD)]
    assert expected == [26, 25], expected
    trained = {rank: ids(phase[rank], "train", 0) for rank in range(WORLD)}
    problems = imbalance(trained, expected, "inf")
    assert "unequal steps per rank: [26, 25]" in problems, problems
    finished = [r for r in range(WORLD) if any(x["kind"] == "end" and x["error"] is None for x in phase[r])]
    stopped = [r for r in range(WORLD) if any(x["kind"] == "stalled" or x.get("error") for x in phase[r])]
    assert not finished and stopped, (phase[0][-2:], phase[1][-2:])


# -- checkpoint mid-epoch and resume ------------------------------------------------------


def _resumed_epoch(save: dict[int, list[dict]], resume: dict[int, list[dict]], epoch: int):
    return {rank: ids(save[rank], "train", epoch) + ids(resume[rank], "train", epoch) for rank in range(WORLD)}


def test_lightning_checkpoint_holds_the_loader_state(fit):
    """Lightning 2.6.6 itself saves a stateful train loader's state_dict() (rank 0's,
    as rank 0 alone writes the file); the recipe adds every rank's."""
    import torch

    fit.phase("ckpt_save")
    checkpoint = torch.load(fit.out / "ckpt_save-ckpt" / f"step={CKPT_STEP}.ckpt", weights_only=False)
    saved = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(saved) == 1 and "_snapshot" in saved[0]  # a StatefulDataLoader state
    per_rank = checkpoint["loader_state_per_rank"]
    assert len(per_rank) == WORLD and per_rank[0] == saved
    assert per_rank[1] != per_rank[0]


def test_resume_mid_epoch_through_lightnings_checkpoint(fit):
    """max_steps=7 with ModelCheckpoint(every_n_train_steps=7), then a new Trainer's
    fit(ckpt_path=...): over both runs epoch 0 is trained exactly once (minus the
    drop tail), every rank resumes at its own position, and epoch 1 is whole."""
    save, resume = fit.phase("ckpt_save"), fit.phase("ckpt_resume")
    per_slot = kept(N, 2)
    for rank in range(WORLD):
        assert end(save[rank])["error"] is None and end(resume[rank])["error"] is None
        assert len(batches(save[rank], "train", 0)) == CKPT_STEP
        assert [b["batch_idx"] for b in batches(resume[rank], "train", 0)] == list(range(CKPT_STEP, 24))
        assert end(resume[rank])["global_step"] == 2 * 24
    for epoch in range(2):
        expected = shares(order(N, SEED, epoch), 2, per_slot, BATCH)
        assert violations(_resumed_epoch(save, resume, epoch), expected) == [], f"epoch {epoch}"


def test_persistent_workers_train_each_epoch_in_its_own_order(fit):
    """persistent_workers=True: the workers keep their copy of the pipeline across
    epochs, and set_epoch in on_train_epoch_start still reaches them."""
    phase = fit.phase("persistent")
    per_slot = kept(N, 2)
    for epoch in range(2):
        expected = shares(order(N, SEED, epoch), 2, per_slot, BATCH)
        trained = {rank: ids(phase[rank], "train", epoch) for rank in range(WORLD)}
        assert violations(trained, expected) == [], f"epoch {epoch}"
    assert ids(phase[0], "train", 0) != ids(phase[0], "train", 1)


def test_resume_mid_epoch_with_persistent_workers(fit):
    """The resumed run trains the rest of epoch 0, then epoch 1 in the same
    persistent workers: both epochs exactly."""
    save, resume = fit.phase("ckpt_persistent_save"), fit.phase("ckpt_persistent_resume")
    per_slot = kept(N, 2)
    for rank in range(WORLD):
        assert end(save[rank])["error"] is None and end(resume[rank])["error"] is None
        assert [b["batch_idx"] for b in batches(resume[rank], "train", 0)] == list(range(CKPT_STEP, 24))
    for epoch in range(2):
        expected = shares(order(N, SEED, epoch), 2, per_slot, BATCH)
        assert violations(_resumed_epoch(save, resume, epoch), expected) == [], f"epoch {epoch}"


def test_without_multiple_of_a_mid_epoch_checkpoint_skips_the_prefetched_batch(fit):
    """Why checkpoints need multiple_of: without a length, Lightning fetches one batch
    ahead (to know which batch is the last), the loader state it saves counts that
    batch as delivered, and the resumed run never trains it: one batch per rank
    missing from the epoch, silently. With multiple_of Lightning knows the length,
    does not prefetch, and the resume is exact (test above)."""
    save, resume = fit.phase("no_multiple_of_save"), fit.phase("no_multiple_of_resume")
    for rank in range(WORLD):
        assert end(save[rank])["error"] is None and end(resume[rank])["error"] is None
        assert end(save[rank])["num_training_batches"] == "inf"
    expected = shares(order(N, SEED, 0), 2, N // (WORLD * 2))
    trained = _resumed_epoch(save, resume, 0)
    everything = [i for rank_ids in trained.values() for i in rank_ids]
    assert len(everything) == len(set(everything))  # no duplicates ...
    missing = set().union(*expected.values()) - set(everything)
    assert len(missing) == WORLD * BATCH, sorted(missing)  # ... one batch a rank lost
    expected1 = shares(order(N, SEED, 1), 2, N // (WORLD * 2))
    assert violations({r: ids(resume[r], "train", 1) for r in range(WORLD)}, expected1) == []


def test_resume_mid_epoch_without_workers(fit):
    """With num_workers=0 StatefulDataLoader restores the pipeline in the main process
    at iter(); len() must still count the epoch (25 batches), or Lightning, counting on
    from its restored batch 7, ends the epoch after 18: 56 elements never trained."""
    save, resume = fit.phase("ckpt0_save"), fit.phase("ckpt0_resume")
    per_slot = kept(N, 0)
    for epoch in range(2):
        expected = shares(order(N, SEED, epoch), 0, per_slot, BATCH)
        assert violations(_resumed_epoch(save, resume, epoch), expected) == [], f"epoch {epoch}"


def test_lightning_alone_gives_every_rank_rank0s_position(fit):
    """Without the recipe, Lightning restores rank 0's loader state on rank 1 too;
    dist_shard refuses it before rank 1 trains anything, naming the fix."""
    phase = fit.phase(EXPECTED_TO_FAIL)
    rank1 = phase[1]
    assert batches(rank1, "train", 0) == []
    error = end(rank1)["error"]
    assert error and "StateMismatchError" in error and "the loaded state is slot" in error, error
    assert "same ranks and workers" in error and "LoaderStatePerRank callback" in error, error
    assert fit.returncode != 0


def test_model_parallel_strategy_peers_train_identical_batches(tmp_path):
    """ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2) on CPU: the
    pipeline built in train_dataloader() with mesh=self.device_mesh["data_parallel"];
    the two tensor-parallel ranks train the same batches, every element once
    (tests/integration_scripts/lightning_model_parallel.py)."""
    run = launch(SCRIPT.parent / "lightning_model_parallel.py", str(tmp_path), tmp_path)
    assert run.returncode == 0, run.tail()
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert seen[0] == seen[1] and len(seen[0]) == 48 // BATCH
    assert sorted(i for batch in seen[0] for i in batch) == list(range(48))
