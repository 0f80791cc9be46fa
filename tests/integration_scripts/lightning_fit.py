"""Fit a tiny model with ``pytorch_lightning.Trainer(accelerator="cpu", strategy="ddp",
devices=2)`` on ``dist_shard`` pipelines; run by tests/test_lightning.py.

Lightning's DDP launcher starts rank 1 by re-running this script with the same
arguments (``LOCAL_RANK=1`` in its environment), so everything happens under
``main()``. The only argument is a JSON config file holding a list of *phases*,
run one after the other in the same two processes (after the first ``fit`` the
launcher has set ``LOCAL_RANK`` in rank 0's environment, so later Trainers reuse
the processes instead of launching again: one start-up for many runs). Each phase
builds its pipelines and DataLoaders *before* ``trainer.fit``, as users do, when
the process group does not exist yet and the environment has ``WORLD_SIZE`` but
no ``RANK``. Every rank appends what it did to ``OUT/<phase>-rank<R>.jsonl``, one
JSON object a line:

* ``{"kind": "epoch", "epoch": e, "num_training_batches": n}`` when an epoch starts
  (``n``: the batches Lightning expects from this rank, ``"inf"`` without a length);
* ``{"kind": "train", "epoch": e, "batch_idx": i, "ids": [...]}`` per training
  batch and ``{"kind": "val", ...}`` per validation batch, written before the
  step's collectives (so a rank that waits forever has logged its batch);
* ``{"kind": "end", "global_step", "num_training_batches", "len", "error"}`` when
  the phase's ``fit`` returned or raised;
* ``{"kind": "stalled", ...}`` if the phase has ``stall_after`` and nothing was
  logged for that many seconds since the last record (a rank waiting in a
  collective its peer never joins): the process then exits at once with status 4.

The script stops at the first phase that raises (status 3). Phase keys: ``name``;
``workers`` (DataLoader ``num_workers``); ``shard``: ``"multiple_of"``
(``dist_shard(even="drop", multiple_of=4)``), ``"drop"`` (``dist_shard(even="drop")``),
``"sharding_filter"`` (torch's) or ``"none"``; ``n_train``; ``seed`` (dist_shard's);
``val`` (a validation loop on its own dist_shard pipeline, default on); ``epochs``;
``max_steps``; ``stateful`` (``StatefulPipeline`` + ``StatefulDataLoader``);
``save_every`` (``ModelCheckpoint(every_n_train_steps=...)`` into ``OUT/<phase>-ckpt``);
``resume`` (a checkpoint path for ``fit(ckpt_path=)``); ``recipe`` (add
``LoaderStatePerRank``, the callback docs/integrations.md documents);
``stall_after`` (seconds, see above).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard

BATCH = 4


def to_tensor(i: int) -> torch.Tensor:
    return torch.tensor(i)


def train_pipeline(n: int, shard: str, seed: int | None):
    dp = IterableWrapper(range(n)).shuffle()
    if shard == "multiple_of":
        dp = dp.dist_shard(even="drop", multiple_of=BATCH, seed=seed)
    elif shard == "drop":
        dp = dp.dist_shard(even="drop", seed=seed)
    elif shard == "sharding_filter":
        dp = dp.sharding_filter()
    elif shard != "none":
        raise ValueError(f"unknown shard {shard!r}")
    return dp.map(to_tensor).batch(BATCH).collate()


def val_pipeline(n: int, first: int):
    return (
        IterableWrapper(range(first, first + n))
        .dist_shard(even="drop", multiple_of=BATCH)
        .map(to_tensor)
        .batch(BATCH)
        .collate()
    )


class LoaderStatePerRank(pl.Callback):
    """Make Lightning's own checkpoint carry every rank's data position.

    Lightning 2.6 saves the ``state_dict()`` of a stateful train DataLoader in the
    checkpoint and restores it on resume, but under DDP only rank 0 writes the
    file, so every rank would load rank 0's position (``dist_shard`` refuses that:
    ``ValueError: the loaded state is slot 1 of 4's, but this copy is slot 3 of 4``).
    This callback gathers all ranks' loader states into the checkpoint when it is
    saved (Lightning calls ``on_save_checkpoint`` on every rank) and, on resume,
    puts each rank's own state where Lightning's fit loop restores it from.
    """

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        mine = checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")
        states = [None] * trainer.world_size
        torch.distributed.all_gather_object(states, mine)
        checkpoint["loader_state_per_rank"] = states

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        states = checkpoint.get("loader_state_per_rank")
        if states is None:
            return
        if len(states) != trainer.world_size:
            raise RuntimeError(
                f"the checkpoint holds the data positions of {len(states)} ranks, this run has "
                f"{trainer.world_size}: resume with the same number of ranks and DataLoader workers"
            )
        checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = states[trainer.global_rank]


class Tiny(pl.LightningModule):
    def __init__(self, record, train_pipe, shard: str) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.record = record
        self.train_pipe = train_pipe
        self.shard = shard

    def on_train_epoch_start(self) -> None:
        batches = self.trainer.num_training_batches
        self.record(
            {
                "kind": "epoch",
                "epoch": self.current_epoch,
                "num_training_batches": batches if batches != float("inf") else "inf",
            }
        )
        if self.shard in ("multiple_of", "drop"):
            distshard.set_epoch(self.train_pipe, self.current_epoch)

    def training_step(self, batch, batch_idx):
        self.record({"kind": "train", "epoch": self.current_epoch, "batch_idx": batch_idx, "ids": batch.tolist()})
        x = batch.float().unsqueeze(1) / 256
        return (self.layer(x) - x).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.record({"kind": "val", "epoch": self.current_epoch, "batch_idx": batch_idx, "ids": batch.tolist()})
        x = batch.float().unsqueeze(1) / 2048
        loss = (self.layer(x) - x).pow(2).mean()
        self.log("val_loss", loss, sync_dist=True)  # a collective at the end of validation
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder:
    """Appends JSON lines to this rank's file of a phase; remembers when it last did."""

    def __init__(self, path: str) -> None:
        self.handle = open(path, "a")
        self.last: float | None = None  # when it last recorded; None before the first record
        self.lock = threading.Lock()
        self.closed = False

    def __call__(self, obj: dict) -> None:
        with self.lock:
            self.handle.write(json.dumps(obj) + "\n")
            self.handle.flush()
            self.last = time.monotonic()

    def watch(self, seconds: float) -> None:
        """Exit the process (status 4) once nothing was recorded for ``seconds`` after
        the first record (start-up, however slow, does not count)."""

        def loop() -> None:
            while not self.closed:
                time.sleep(0.25)
                last = self.last
                if not self.closed and last is not None and time.monotonic() - last > seconds:
                    self({"kind": "stalled", "seconds": seconds})
                    os._exit(4)

        threading.Thread(target=loop, daemon=True).start()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.handle.close()


def run_phase(config: dict, phase: dict) -> bool:
    out = config["out"]
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # one node: the global rank
    record = Recorder(os.path.join(out, f"{phase['name']}-rank{rank}.jsonl"))

    workers = phase.get("workers", 0)
    shard = phase.get("shard", "multiple_of")
    pipe = train_pipeline(phase.get("n_train", config["n_train"]), shard, phase.get("seed"))
    persistent: dict[str, Any] = (
        {"persistent_workers": True} if phase.get("persistent") else {}
    )  # workers live across epochs
    if phase.get("stateful"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        pipe = distshard.StatefulPipeline(pipe)
        train_loader = StatefulDataLoader(pipe, batch_size=None, num_workers=workers, **persistent)
    else:
        train_loader = DataLoader(pipe, batch_size=None, num_workers=workers, **persistent)
    val_loader = None
    if phase.get("val", True):
        val_loader = DataLoader(
            val_pipeline(config["n_val"], config["val_first"]), batch_size=None, num_workers=workers
        )

    callbacks: list[pl.Callback] = []
    if phase.get("save_every"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(out, f"{phase['name']}-ckpt"),
                filename="{step}",
                every_n_train_steps=phase["save_every"],
                save_top_k=-1,
            )
        )
    if phase.get("recipe"):
        callbacks.append(LoaderStatePerRank())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=phase.get("epochs", 2),
        max_steps=phase.get("max_steps", -1),
        # strategy="ddp" with a bound on every collective: a rank left waiting raises instead of hanging
        strategy=DDPStrategy(timeout=timedelta(seconds=config["ddp_timeout"])),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(phase.get("save_every")),
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if val_loader is not None else 0,
        callbacks=callbacks,
    )
    if phase.get("stall_after"):
        record.watch(phase["stall_after"])
    error = None
    start = time.monotonic()
    try:
        trainer.fit(
            Tiny(record, pipe, shard),
            train_dataloaders=train_loader,
            val_dataloaders=val_loader,
            ckpt_path=phase.get("resume"),
        )
    except Exception as exc:  # recorded for the test; the script stops after this phase
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    try:
        length: int | str = len(train_loader)
    except TypeError as exc:  # torch's DataLoader wraps the pipe's TypeError: keep its cause
        length = f"TypeError: {exc}" + (f" <- {exc.__cause__}" if exc.__cause__ else "")
    batches = trainer.num_training_batches
    record(
        {
            "kind": "end",
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "num_training_batches": batches if batches != float("inf") else "inf",
            "len": length,
            "error": error,
            "seconds": round(time.monotonic() - start, 2),
        }
    )
    record.close()
    return error is None


def main() -> int:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    for phase in config["phases"]:
        if not run_phase(config, phase):
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
