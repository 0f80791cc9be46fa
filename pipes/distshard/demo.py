"""``python -m distshard demo``: the classic gist's exactly-once check, on records
that are not integers, over a real gloo group of 4 ranks × 4 DataLoader workers."""

from __future__ import annotations

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper

from .baselines import ClassicModuloIterDataPipe
from .context import forced_distributed
from .datapipe import DistShardIterDataPipe
from .verify import verify

RECORDS = 1000


def records() -> list[dict]:
    """Records as a real dataset has them: string ids, not consecutive integers."""
    return [{"id": f"utt-{i:05d}", "label": i % 7} for i in range(RECORDS)]


def build() -> IterDataPipe:
    """The pipeline each rank builds: shuffle, shard, decode."""
    return DistShardIterDataPipe(IterableWrapper(records()).shuffle(), even="drop").map(_decode)


def _decode(record: dict) -> dict:
    return {**record, "text": record["id"].upper()}


def classic_on_strings() -> str:
    """What the classic per-value modulo recipe does with the same records."""
    pipe = ClassicModuloIterDataPipe(IterableWrapper(records()))
    try:
        with forced_distributed(1, 4):
            next(iter(pipe))
    except TypeError as exc:
        return f"TypeError: {str(exc).splitlines()[0]}"
    return "no error"


def run(world_size: int = 4, num_workers: int = 4, timeout: float = 120.0) -> int:
    """Print the demo's report; return the exit status: 0 exactly-once, 1 violated,
    2 could not run (``timeout`` bounds the whole run)."""
    print(
        f"distshard demo: {RECORDS} dict records with string ids, shuffled, sharded over "
        f"{world_size} ranks x {num_workers} DataLoader workers (gloo on 127.0.0.1)\n"
    )
    print("classic per-value modulo recipe on these records:")
    print(f"  {classic_on_strings()}\n")
    print("IterableWrapper(records).shuffle().dist_shard(even='drop').map(decode):")
    report = verify(build, world_size=world_size, num_workers=num_workers, timeout=timeout)
    print(report.summary())
    return 0 if report.ok else 1 if report.violated else 2
