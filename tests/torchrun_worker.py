"""One rank of a real multi-node ``torchrun`` job, launched by tests/test_torchrun.py.

The test starts two torchrun agents on this machine as two "nodes" (c10d
rendezvous on 127.0.0.1, 2 processes each: 4 ranks). On two real machines a
user runs the same command on each of them (HOST0 is the address of one of the
machines, reachable from the other; the port is any free one on HOST0)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 train.py

With c10d rendezvous there is no ``--node-rank`` / ``--master-addr``: node ranks
are assigned at rendezvous. If gloo picks the wrong network interface (e.g. the
hostname resolves to 127.0.1.1), set ``GLOO_SOCKET_IFNAME`` to the interface
that connects the machines.

Each rank joins the gloo group from torchrun's environment (``env://``),
iterates ``IterableWrapper(records).shuffle().dist_shard(even="drop").map(decode)``
through a DataLoader with 2 fork workers, does one ``all_reduce`` per element as
a DDP step would, and writes what it consumed to ``OUT_DIR/rank{RANK}.json``.

Usage (under torchrun): ``torchrun_worker.py OUT_DIR N_RECORDS``
"""

import os
import sys

OUT_DIR = sys.argv[1]
# Written first, before the slow imports: the test kills these process groups
# (torchrun starts every rank in a session of its own) if anything outlives it.
with open(os.path.join(OUT_DIR, f"pid-{os.environ.get('RANK', 'x')}-{os.getpid()}"), "w") as _f:
    _f.write(str(os.getpid()))

import json  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, get_worker_info  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402

import distshard  # noqa: E402  (registers .dist_shard)

TIMEOUT = 30  # seconds, for gloo collectives and DataLoader workers


def records(n: int) -> list[dict]:
    return [{"id": f"rec-{i:04d}", "value": i % 7} for i in range(n)]


def decode(record: dict) -> dict:
    """Runs in the DataLoader worker: tags the element with who decoded it."""
    ctx = distshard.current_context()
    info = get_worker_info()
    return {
        **record,
        "decoded": record["id"].upper(),
        "worker": None if info is None else info.id,
        "slot": ctx.slot,
        "num_slots": ctx.num_slots,
        "ctx_rank": ctx.rank,
        "source": ctx.source,
    }


def write(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def main() -> None:
    n = int(sys.argv[2])
    env = {
        k: os.environ.get(k)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
    }
    out = os.path.join(OUT_DIR, f"rank{env['RANK']}.json")
    payload: dict = {"env": env, "pid": os.getpid(), "rank": None, "elements": [], "error": None}
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))
        rank, world = dist.get_rank(), dist.get_world_size()
        payload.update(rank=rank, world_size=world)

        pipe = IterableWrapper(records(n)).shuffle().dist_shard(even="drop").map(decode)
        loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=TIMEOUT)
        step = 0
        for element in loader:
            payload["elements"].append(element)
            step += 1
            # The DDP step: [still going, step] summed over ranks. A rank that ran
            # out early sends [0, -1] below and every rank sees the mismatch
            # instead of waiting in a collective.
            t = torch.tensor([1.0, float(step)])
            dist.all_reduce(t)
            if t.tolist() != [float(world), float(world * step)]:
                raise RuntimeError(
                    f"rank {rank}: step {step} all_reduce gave {t.tolist()}: "
                    "the ranks do not take the same number of steps"
                )
        t = torch.tensor([0.0, -1.0])
        dist.all_reduce(t)
        if t.tolist() != [0.0, float(-world)]:
            raise RuntimeError(
                f"rank {rank}: finished after {step} steps but the final "
                f"all_reduce gave {t.tolist()}: another rank is still going"
            )
        payload["steps"] = step
    except BaseException:
        payload["error"] = traceback.format_exc()
        raise
    finally:
        write(out, payload)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
