"""One rank of a Hugging Face Accelerate job on a ``dist_shard`` pipeline; run by
tests/test_accelerate.py under ``torchrun --nproc-per-node 2`` (or ``accelerate
launch --multi_gpu --num_processes 2``; with ``Accelerator(cpu=True)`` either gives
a 2-process gloo group on CPU).

Usage: ``accelerate_train.py OUT_DIR CASE [CASE ...]``. Every rank writes
``OUT_DIR/<case>-rank<R>.json`` for each case:

* ``working``: the configuration docs/integrations.md shows: model and optimizer
  prepared, the DataLoader iterated directly, batches moved to
  ``accelerator.device``, ``accelerator.backward``; 2 epochs.
* ``prepare_no_dispatch``: ``DataLoaderConfiguration(dispatch_batches=False)`` and
  ``accelerator.prepare(DataLoader(unbatched_pipeline, batch_size=4, num_workers=2))``
  (Accelerate wraps the dataset in its ``IterableDatasetShard``), then iterate:
  distshard must raise ``RuntimeError`` before the first batch, on every rank.
* ``prepare_no_dispatch_recipe``: the same with the recipe's own loader,
  ``DataLoader(batched_pipeline, batch_size=None, num_workers=2)``: Accelerate's
  ``IterableDatasetShard`` gets ``batch_size=None`` and fails on its own before it
  reads the pipeline (``len()`` records distshard's refusal as the cause of torch's
  ``TypeError``).
* ``prepare_default``: ``accelerator.prepare(DataLoader(pipeline, batch_size=None,
  num_workers=2))`` with Accelerate's defaults (a ``DataLoaderDispatcher``), then
  iterate: distshard must raise ``RuntimeError`` before the first batch. Only rank 0
  reads with the dispatcher, so only rank 0 meets the refusal; the other ranks wait
  in a broadcast until rank 0's process ends (and then fail with "Connection closed
  by peer"): this case must come last.

Each JSON holds ``steps`` (optimizer steps per epoch), ``ids`` (every element id
trained, per epoch), ``error`` (``"Type: message"`` or ``None``) and
``batches_before_error``.
"""

from __future__ import annotations

import os
import sys

# Written first, before the slow imports: the test kills these process groups
# (torchrun starts every rank in a session of its own) if anything outlives it.
with open(os.path.join(sys.argv[1], f"pid-{os.getpid()}"), "w") as _f:
    _f.write(str(os.getpid()))

import json  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402

import distshard  # noqa: E402

N = 203
BATCH = 4
EPOCHS = 2
TIMEOUT = timedelta(seconds=60)  # gloo collectives raise instead of hanging


def to_tensor(i: int) -> torch.Tensor:
    return torch.tensor(i)


def elements():
    return IterableWrapper(range(N)).shuffle().dist_shard(even="drop", multiple_of=BATCH).map(to_tensor)


def batched():
    return elements().batch(BATCH).collate()


def step(accelerator, model, optimizer, batch) -> None:
    x = batch.float().unsqueeze(1) / 256
    loss = (model(x) - x).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def model_and_optimizer(accelerator):
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def refused(accelerator, loader) -> dict:
    """Prepare ``loader`` with ``accelerator`` and train on it: record what happens."""
    model, optimizer = model_and_optimizer(accelerator)
    result: dict[str, Any] = {
        "ids": [[]],
        "steps": [0],
        "error": None,
        "batches_before_error": 0,
        "prepared": None,
        "len_error": None,
        "len_cause": None,
    }
    try:
        prepared = accelerator.prepare(loader)
        result["prepared"] = type(prepared).__name__
        if accelerator.distributed_type != "NO" and type(prepared).__name__ == "DataLoaderShard":
            try:
                len(prepared)
            except Exception as exc:
                result["len_error"] = f"{type(exc).__name__}: {exc}"
                cause = exc.__cause__
                result["len_cause"] = None if cause is None else f"{type(cause).__name__}: {cause}"
        for batch in prepared:
            result["ids"][0].extend(batch.tolist())
            step(accelerator, model, optimizer, batch)
            result["steps"][0] += 1
            result["batches_before_error"] += 1
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def working(accelerator) -> dict:
    model, optimizer = model_and_optimizer(accelerator)  # prepare these ...
    pipeline = batched()
    loader = DataLoader(pipeline, batch_size=None, num_workers=2)  # ... but not the DataLoader
    result: dict[str, Any] = {"ids": [], "steps": [], "error": None, "len": len(loader)}
    for epoch in range(EPOCHS):
        distshard.set_epoch(pipeline, epoch)
        ids, steps = [], 0
        for batch in loader:
            batch = batch.to(accelerator.device)
            ids.extend(batch.tolist())
            step(accelerator, model, optimizer, batch)
            steps += 1
        result["ids"].append(ids)
        result["steps"].append(steps)
    accelerator.wait_for_everyone()
    return result


def main() -> int:
    out, cases = sys.argv[1], sys.argv[2:]
    kwargs = [InitProcessGroupKwargs(timeout=TIMEOUT)]
    status = 0
    for case in cases:
        if case == "prepare_default":
            accelerator = Accelerator(cpu=True, kwargs_handlers=kwargs)
            result = refused(accelerator, DataLoader(batched(), batch_size=None, num_workers=2))
        elif case in ("prepare_no_dispatch", "prepare_no_dispatch_recipe"):
            accelerator = Accelerator(
                cpu=True, kwargs_handlers=kwargs, dataloader_config=DataLoaderConfiguration(dispatch_batches=False)
            )
            loader = (
                DataLoader(elements(), batch_size=BATCH, num_workers=2)
                if case == "prepare_no_dispatch"
                else DataLoader(batched(), batch_size=None, num_workers=2)
            )
            result = refused(accelerator, loader)
        elif case == "working":
            accelerator = Accelerator(cpu=True, kwargs_handlers=kwargs)
            try:
                result = working(accelerator)
            except Exception as exc:
                traceback.print_exc()
                result = {"error": f"{type(exc).__name__}: {exc}"}
                status = 3
        else:
            raise SystemExit(f"unknown case {case!r}")
        result.update(
            rank=accelerator.process_index,
            world=accelerator.num_processes,
            distributed_type=str(accelerator.distributed_type),
        )
        with open(os.path.join(out, f"{case}-rank{accelerator.process_index}.json"), "w") as f:
            json.dump(result, f)
        if status:
            break
    return status


if __name__ == "__main__":
    sys.exit(main())
