"""bench_mix's data: three sources of small records, the calibrated decode every row
runs, the token counts of the cost-weighted row and the weights of the phased one."""

from __future__ import annotations

from typing import Any

import harness

WORLD_SIZE, NUM_WORKERS = 4, 2
GLOBAL_BATCH = 256
RANK_BATCH = GLOBAL_BATCH // WORLD_SIZE
NAMES = ("web", "code", "math")
WEIGHTS = (0.7, 0.2, 0.1)
SEED = 0
PHASE_WEIGHTS = (0.3, 0.3, 0.4)


# -- decode: a calibrated busy loop, counted over the rank and its workers -------------
class Decode(harness.Decode):
    """``record -> (source id, index)`` (or a dict, for HF's ``map``) after ~50 µs of CPU."""

    def __init__(self, iters: int, as_dict: bool = False) -> None:
        super().__init__(iters)
        self.as_dict = as_dict

    def __call__(self, record: dict[str, Any]) -> Any:
        sid = NAMES.index(record["source"])
        index = int(record["idx"])
        self.work(sid * 10_000_000 + index + len(record["text"]))
        return {"sid": sid, "idx": index} if self.as_dict else (sid, index)


def calibration_decode(iters: int) -> Any:
    """What ``harness.calibrate`` times: the decode of one record."""
    decode, record = Decode(iters), {"source": "web", "idx": 0, "text": "x" * 40}
    return lambda i: decode(record)


TOKENS = {"web": (60, 240), "code": (200, 800), "math": (20, 120)}  # (fewest, most) tokens a record


def tokens(name: str, k: int) -> int:
    """A record's token count (deterministic, spread over the source's range): the
    per-element cost of the cost-weighted rows."""
    low, high = TOKENS[name]
    return low + (k * 2654435761 + len(name)) % (high - low + 1)


def make_records(name: str, n: int) -> list[dict[str, Any]]:
    return [{"source": name, "idx": k, "text": f"{name} record {k:06d}: lorem ipsum dolor",
             "tokens": tokens(name, k)} for k in range(n)]


def phases(steps: int) -> list[tuple[int, dict[str, float]]]:
    """The phased rows' weights: 70 / 20 / 10, then from the middle 30 / 30 / 40
    (an annealing mix), the boundary inside a global batch."""
    return [(0, dict(zip(NAMES, WEIGHTS, strict=True))), (steps * GLOBAL_BATCH // 2 + 100, dict(zip(NAMES, PHASE_WEIGHTS, strict=True)))]


def mix_options(key: str, data: dict[str, list], steps: int) -> dict[str, Any]:
    """``weights=`` and ``cost=`` of a distshard row."""
    if key == "distshard_phases":
        return {"weights": phases(steps)}
    if key == "distshard_cost":
        return {"weights": dict(zip(NAMES, WEIGHTS, strict=True)),
                "cost": {name: [r["tokens"] for r in records] for name, records in data.items()}}
    return {"weights": dict(zip(NAMES, WEIGHTS, strict=True))}
