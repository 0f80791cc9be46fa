"""Ranks of the model-parallel mesh tests (test_mesh.py), importable by name in the
processes ``run_on_group`` starts: each builds a real ``DeviceMesh`` on its gloo group
and a pipeline whose data group is the mesh's data-parallel dimensions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import distshard

N = 96  # elements: 4 data slots x 6 batches of 4, so even="drop" drops nothing on the 2 x 2 mesh
BATCH = 4


def elements(n: int = N) -> list[str]:
    return [f"e{i}" for i in range(n)]


def write_jsonl(path: Path, n: int = N) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in elements(n)))
    return str(path)


def keep(x: str) -> bool:
    """A filter after the shard: the data ranks' counts differ, the peers' do not."""
    return int(x[1:]) % 3 != 0


def source(
    kind, path, n=N, **group
):  # (unannotated: mypy takes distshard.jsonl for the module sources/formats/jsonl.py)
    if kind == "list":
        return IterableWrapper(elements(n))
    assert kind == "jsonl" and path is not None
    return distshard.jsonl(path, **group)  # the index build: a collective over the data group


def loader(
    kind: str,
    path: str | None,
    *,
    workers: int = 2,
    context: str = "fork",
    filtered: bool = False,
    n: int = N,
    shuffle: bool = True,
    **group: Any,
):
    """A StatefulDataLoader of batches of 4 over ``dist_shard(mesh= / group=)``."""
    shard = source(kind, path, n, **group).dist_shard(even="drop", shuffle=shuffle, seed=3, multiple_of=BATCH, **group)
    pipe = shard.filter(keep) if filtered else shard
    pipeline = distshard.StatefulPipeline(pipe.batch(BATCH))
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options.update(multiprocessing_context=context, timeout=60)
        if context == "spawn":
            options["persistent_workers"] = True
    return StatefulDataLoader(pipeline, batch_size=None, **options)


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...] = ("dp", "tp")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def batches(it, take: int | None = None) -> list[list[str]]:
    out: list[list[str]] = []
    for batch in it:
        out.append(list(batch))
        if take is not None and len(out) == take:
            break
    return out


# -- identical peers, exactly once over the data ranks, group= and stop_together ------------------


def peers(rank: int, world: int, kind: str, path: str | None, context: str, workers: int) -> dict[str, Any]:
    """On a dp = 2 x tp = 2 mesh: two epochs through ``mesh=``, one through ``group=``,
    one guarded by ``stop_together`` behind a filter; the context and explain()."""
    mesh = mesh_of((2, 2))
    dp = mesh["dp"]
    out: dict[str, Any] = {}
    data = loader(kind, path, workers=workers, context=context, mesh=dp)
    out["mesh"] = []
    for epoch in range(2):
        distshard.set_epoch(data, epoch)
        out["mesh"].append(batches(data))
    out["group"] = batches(loader(kind, path, workers=workers, group=dp.get_group()))  # forked workers
    guarded = distshard.stop_together(loader(kind, path, filtered=True, mesh=dp), timeout=30)
    out["together"] = batches(guarded)
    out["steps"], out["unused"] = guarded.steps, guarded.unused_per_rank
    ctx = distshard.current_context(mesh=dp)
    out["context"] = (ctx.rank, ctx.world_size, ctx.source, ctx.group.coordinate if ctx.group else None)
    shard = distshard.StatefulPipeline(source(kind, path, mesh=dp).dist_shard(mesh=dp)).shard
    out["explain"] = str(shard.explain())
    return out


# -- divergent peers are refused ----------------------------------------------------------------------


def divergent(rank: int, world: int) -> dict[str, str]:
    """Rank 1 takes one batch more than its peer rank 0: every gather refuses, on every rank."""
    mesh = mesh_of((2, 2))
    data = loader("list", None, mesh=mesh["dp"])
    it = iter(data)
    batches(it, 2 + (rank == 1))
    out = {}
    for name, call in (
        ("gather_states", lambda: distshard.gather_states(data.state_dict())),
        ("LoaderCheckpoint", lambda: distshard.LoaderCheckpoint(data).state_dict()),
    ):
        try:
            call()
        except distshard.StateMismatchError as exc:
            out[name] = str(exc)
    return out


# -- DCP without a mesh: the world is the data group --------------------------------------------------


def worldwide(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """No mesh: save at step 2 of 4 ranks without workers, resume on the same loaders
    (exactly) and on loaders with 2 workers (elastically)."""
    import torch.distributed.checkpoint as dcp

    data = loader("list", None, workers=0)
    it = iter(data)
    first = batches(it, 2)
    dcp.save({"data": distshard.LoaderCheckpoint(data)}, checkpoint_id=ckpt)
    out: dict[Any, Any] = {"first": first, "rest": batches(it)}
    for workers in (0, 2):
        again = loader("list", None, workers=workers)
        dcp.load({"data": distshard.LoaderCheckpoint(again)}, checkpoint_id=ckpt)
        out[workers] = batches(again)
    return out


# -- DCP: save at step k, resume on the same mesh and on others ---------------------------------------


def checkpointed(rank: int, world: int, kind: str, path: str | None, ckpt: str, k: int, asynchronous: bool):
    """Save at step ``k`` (``dcp.save`` or ``dcp.async_save``, the loop going on before
    the save is waited for), finish the epoch (the uninterrupted run), then resume the
    checkpoint in new loaders: on the same 2 x 2 mesh, on dp = 1 x tp = 4 and on
    dp = 4 x tp = 1 (the same processes, new meshes)."""
    import torch.distributed.checkpoint as dcp

    mesh = mesh_of((2, 2))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    data = loader(kind, path, mesh=mesh["dp"])
    it = iter(data)
    first = batches(it, k)
    state = {"model": model.state_dict(), "data": distshard.LoaderCheckpoint(data)}
    if asynchronous:
        future: Any = dcp.async_save(state, checkpoint_id=ckpt)
        rest = batches(it)  # the state was taken when the save was called
        future.result()
    else:
        dcp.save(state, checkpoint_id=ckpt)
        rest = batches(it)
    out: dict[str, Any] = {"first": first, "rest": rest, "resumed": {}}
    for shape in ((2, 2), (1, 4), (4, 1)):
        again = loader(kind, path, mesh=mesh_of(shape)["dp"])
        fresh = torch.nn.Linear(4, 4)
        dcp.load({"model": fresh.state_dict(), "data": distshard.LoaderCheckpoint(again)}, checkpoint_id=ckpt)
        out["resumed"][shape] = batches(again)
    out["refused"] = {}
    for change, other in (
        ("length", loader("list", None, n=N + 1, mesh=mesh["dp"])),
        ("shuffle", loader(kind, path, shuffle=False, mesh=mesh["dp"])),
    ):
        try:
            dcp.load({"data": distshard.LoaderCheckpoint(other)}, checkpoint_id=ckpt)
        except distshard.StateMismatchError as exc:
            out["refused"][change] = str(exc)
    return out


# -- the first pipeline stage alone reads: no collective waits on the other stage ------------------


def first_stage(rank: int, world: int, path: str) -> dict[str, Any]:
    """pp = 2 x dp = 2: only the ranks of stage 0 build and read the pipeline (a file
    source, a sizes callable, stop_together, the gathers); stage 1 waits at a barrier
    over every rank, which stage 0 reaches only when it is done."""
    mesh = mesh_of((2, 2), ("pp", "dp"))
    out: dict[str, Any] = {}
    if mesh.get_coordinate()[0] == 0:
        dp = mesh["dp"]
        data = loader("jsonl", path, mesh=dp)
        guarded = distshard.stop_together(data, timeout=30)
        out["batches"] = batches(guarded)
        units = IterableWrapper([0, 1, 2]).dist_shard(expand=lambda u: [u] * (u + 1), sizes=lambda u: u + 1, mesh=dp)
        out["units"] = list(units)
        out["merged"] = distshard.gather_states(data.state_dict(), group=dp.get_group())
        out["checkpoint"] = len(distshard.LoaderCheckpoint(data, group=dp.get_group()).state_dict()["distshard_loader"])
    dist.barrier()
    return out


# -- 8 ranks: dp_replicate x dp_shard x tp, the data group a 2-D sub-mesh -------------------------------


def three_d(rank: int, world: int, path: str, ckpt: str) -> dict[str, Any]:
    """2 x 2 x 2; the data mesh is ("dp_replicate", "dp_shard"): data rank
    2 * replicate + shard of 4, tp peers identical; a file source indexed over the
    data group (no process group of its own: one made by its ranks), stop_together,
    and a DCP checkpoint at step 2 resumed on the same mesh."""
    import torch.distributed.checkpoint as dcp

    mesh = mesh_of((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    data_mesh = mesh["dp_replicate", "dp_shard"]
    data = loader("jsonl", path, workers=0, mesh=data_mesh)
    guarded = distshard.stop_together(data, timeout=30)
    it = iter(guarded)
    first = batches(it, 2)
    dcp.save({"data": distshard.LoaderCheckpoint(data)}, checkpoint_id=ckpt)
    rest = batches(it)
    again = loader("jsonl", path, workers=0, mesh=data_mesh)
    dcp.load({"data": distshard.LoaderCheckpoint(again)}, checkpoint_id=ckpt)
    ctx = distshard.current_context(mesh=data_mesh)
    return {
        "first": first,
        "rest": rest,
        "resumed": batches(again),
        "data_rank": ctx.rank,
        "data_world": ctx.world_size,
    }
