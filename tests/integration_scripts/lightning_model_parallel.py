"""Fit a tiny tensor-parallel model with ``pytorch_lightning.Trainer(accelerator="cpu",
devices=2, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2))``
on a ``dist_shard(mesh=...)`` pipeline; run by tests/test_lightning.py.

The pipeline is built in ``train_dataloader()``, where the strategy's device mesh
exists: ``mesh=self.device_mesh["data_parallel"]``. Both ranks are tensor-parallel
peers of the one data rank, so they must train on identical batches. Lightning's
launcher starts rank 1 by re-running this script (``LOCAL_RANK=1``). Arguments: the
output folder; every rank writes ``rank<R>.json``, the ids of every training batch.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import distshard

N, BATCH = 48, 4


def as_row(i: int) -> torch.Tensor:
    return torch.full((4,), float(i))


class TensorParallel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.seen: list[list[int]] = []

    @property
    def mesh(self) -> Any:
        assert self.device_mesh is not None, "the strategy's mesh exists from setup on"
        return self.device_mesh

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(self.net, self.mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(self.net, mesh=self.mesh["data_parallel"])

    def train_dataloader(self) -> StatefulDataLoader:
        shard = IterableWrapper(list(range(N))).dist_shard(
            mesh=self.mesh["data_parallel"], even="drop", multiple_of=BATCH, shuffle=True, seed=1
        )
        pipeline = distshard.StatefulPipeline(shard.map(as_row).batch(BATCH).collate())
        return StatefulDataLoader(pipeline, batch_size=None)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append([int(x) for x in batch[:, 0].tolist()])
        return self.net(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    module = TensorParallel()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, timeout=timedelta(seconds=60)),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    with open(f"{sys.argv[1]}/rank{trainer.global_rank}.json", "w") as out:
        json.dump(module.seen, out)


if __name__ == "__main__":
    main()
