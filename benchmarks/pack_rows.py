"""bench_pack's rows: what each one builds on a rank (distshard, HF ``group_texts``,
litdata, Grain), the job every rank of a gloo group runs, the one-process run, the
peers' copies of the corpus and distshard's resume on another world size.
bench_pack runs ``run_row``, ``one_process`` and ``prepare_peers`` in a child by
name (``harness.launch``)."""

from __future__ import annotations

import base64
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import harness
from pack_corpus import SEQ_LEN, CorpusDocuments

WORLD_SIZE, NUM_WORKERS = 4, 2
BATCH = 8  # blocks per batch, every row (litdata's loader needs a batch size)
HF_BATCH = 1_000  # group_texts' map batch (HF's default)
GRAIN_BINS = 8  # Grain's num_packing_bins: one batch of blocks
DISTSHARD = ("distshard", "distshard-drop", "distshard-best")
GRAIN = ("grain-ff", "grain-bf")


# -- the rows ------------------------------------------------------------------------------------------
def group_texts(examples: dict[str, list]) -> dict[str, list]:
    """HF's run_clm ``group_texts``: concatenate a batch, cut it into blocks, drop the remainder."""
    from itertools import chain

    ids = list(chain.from_iterable(examples["input_ids"]))
    total = len(ids) // SEQ_LEN * SEQ_LEN
    return {"input_ids": [ids[i : i + SEQ_LEN] for i in range(0, total, SEQ_LEN)]}


class GrainPieces:
    """Grain's data source: the corpus's documents pre-split into pieces of at most
    ``L`` tokens, by position, read from the memory map (opened once per process)."""

    def __init__(self, root: str) -> None:
        import numpy as np

        lengths = np.load(os.path.join(root, "lengths.npy"))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        starts = [np.arange(offsets[d], offsets[d + 1], SEQ_LEN) for d in range(len(lengths))]
        self.starts = np.concatenate(starts).astype(np.int64)
        self.stops = np.minimum(self.starts + SEQ_LEN, np.repeat(offsets[1:], [len(s) for s in starts]))
        self.root, self._map = root, None

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import numpy as np

        if self._map is None:
            self._map = np.memmap(os.path.join(self.root, "tokens.bin"), dtype=np.int32, mode="r")
        return {"input_ids": np.array(self._map[self.starts[i] : self.stops[i]])}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}


def grain_pipeline(key: str, root: str, rank: int, world_size: int, workers: int) -> Any:
    """Grain's recipe: shard the source by rank, pack in each worker's slice, batch."""
    import grain
    from grain import experimental

    packer = experimental.FirstFitPackIterDataset if key == "grain-ff" else experimental.BestFitPackIterDataset
    pieces = grain.MapDataset.source(GrainPieces(root))[rank::world_size]
    packed = packer(pieces.to_iter_dataset(), length_struct={"input_ids": SEQ_LEN}, num_packing_bins=GRAIN_BINS)
    batched = packed.batch(BATCH)
    return batched.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else batched


def build(key: str, root: str, rank: int, world_size: int) -> Any:
    if key.startswith("distshard"):
        import distshard

        even = "drop" if key == "distshard-drop" else None
        fit = "best" if key == "distshard-best" else "concat"
        return distshard.pack(CorpusDocuments(root), SEQ_LEN, fit=fit).dist_shard(even=even)
    if key in GRAIN:
        return grain_pipeline(key, root, rank, world_size, NUM_WORKERS)
    if key == "hf":
        import datasets
        from datasets.distributed import split_dataset_by_node

        docs = datasets.load_from_disk(os.path.join(root, "hf"))
        stream = docs.to_iterable_dataset(num_shards=WORLD_SIZE * NUM_WORKERS)
        blocks = stream.map(group_texts, batched=True, batch_size=HF_BATCH, remove_columns=["input_ids"])
        return split_dataset_by_node(blocks, rank=rank, world_size=world_size).with_format("torch")
    if key == "litdata":
        from litdata import StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        return StreamingDataset(os.path.join(root, "litdata"), item_loader=TokensLoader(block_size=SEQ_LEN))
    raise ValueError(key)


def block_tokens(batch: Any) -> tuple[bytes, int, int, int, bytes]:
    """(the real token ids as int32 bytes, the batch's tokens, its padding, its blocks,
    the real tokens of each block as int32 bytes) of one batch of blocks (``BATCH``
    rows of ``L``; the last batch may be shorter)."""
    import numpy as np
    import torch

    if isinstance(batch, dict) and ("loss_mask" in batch or "input_ids_segment_ids" in batch):
        ids = torch.as_tensor(np.asarray(batch["input_ids"]))
        real = batch["loss_mask"].bool() if "loss_mask" in batch else torch.as_tensor(batch["input_ids_segment_ids"]) > 0
        per_block = real.sum(1).to(torch.int32).numpy().tobytes()
        return ids[real].to(torch.int32).numpy().tobytes(), ids.numel(), int((~real).sum()), len(ids), per_block
    ids = torch.as_tensor(batch["input_ids"] if isinstance(batch, dict) else batch)
    per_block = np.full(len(ids), ids.shape[-1], dtype=np.int32).tobytes()
    return ids.reshape(-1).to(torch.int32).numpy().tobytes(), ids.numel(), 0, len(ids), per_block


@dataclass
class PackJob(harness.Job):
    key: str = "distshard"
    root: str = ""

    def prepare(self, rank: int) -> None:
        import numpy  # noqa: F401

        if self.key == "hf":
            import datasets  # noqa: F401
        if self.key == "litdata":
            import litdata  # noqa: F401
        if self.key in GRAIN:
            import grain  # noqa: F401

    def build(self, rank: int) -> Any:
        return build(self.key, self.root, rank, self.world_size)

    def loader(self, pipe: Any) -> Any:
        if self.key == "litdata":
            from litdata import StreamingDataLoader

            return StreamingDataLoader(pipe, batch_size=BATCH, num_workers=self.num_workers, timeout=self.timeout)
        if self.key in GRAIN:
            return pipe  # batched, its workers started by mp_prefetch
        return super().loader(pipe)

    def close(self, iterator: Any) -> None:
        if iterator is not None and hasattr(iterator, "close") and not hasattr(iterator, "_shutdown_workers"):
            iterator.close()  # Grain's mp_prefetch workers, joined (so that RUSAGE_CHILDREN counts them)
            return
        super().close(iterator)

    def keep(self, item: Any, values: list) -> None:
        values.append(block_tokens(item))


def _compact(run: dict[str, Any]) -> dict[str, Any]:
    """A rank's blocks as one base64 string of int32 ids (JSON-able, small) and counts."""
    for rank in run["ranks"]:
        blocks = [b for epoch in rank.pop("values", []) for b in epoch]
        rank["blocks"] = sum(b[3] for b in blocks)
        rank["block_tokens"] = sum(b[1] for b in blocks)
        rank["padding"] = sum(b[2] for b in blocks)
        rank["ids"] = base64.b64encode(b"".join(b[0] for b in blocks)).decode()
        rank["per_block"] = base64.b64encode(b"".join(b[4] for b in blocks)).decode()
    return run


def run_row(key: str, root: str, timeout: float) -> dict[str, Any]:
    job = PackJob(key=key, root=root, world_size=WORLD_SIZE, num_workers=NUM_WORKERS, timeout=timeout,
                  report=key not in ("litdata", *GRAIN), batch_size=BATCH)
    out = _compact(asdict(harness.run_job(job)))
    if key not in DISTSHARD:
        out["versions"] = harness.versions("torch", "datasets", "litdata", "grain")
    return out


def one_process(key: str, root: str) -> dict[str, Any]:
    """The whole corpus packed and batched in this process, no workers, after the
    imports and a first batch (what a library imports lazily is not the packer's
    cost): CPU seconds (building the pipeline included) and the real tokens delivered."""
    import numpy as np

    def pipeline() -> Any:
        if key in GRAIN:
            return grain_pipeline(key, root, 0, 1, 0)
        from torch.utils.data import DataLoader

        import distshard

        fit = "best" if key == "distshard-best" else "concat"
        return DataLoader(distshard.pack(CorpusDocuments(root), SEQ_LEN, fit=fit).dist_shard(rank=0, world_size=1),
                          batch_size=BATCH)

    def real(batch: Any) -> int:  # counted, not copied: the packer's cost alone
        if key in GRAIN:
            return int(np.count_nonzero(batch["input_ids_segment_ids"]))
        return int(batch["loss_mask"].sum())

    next(iter(pipeline()))  # the warm-up
    cpu = time.process_time()
    delivered = sum(real(batch) for batch in pipeline())
    return {"cpu_s": time.process_time() - cpu, "delivered": delivered,
            "tokens": int(np.load(os.path.join(root, "lengths.npy")).sum())}


def prepare_peers(root: str) -> dict[str, Any]:
    """In the peers' venv: the corpus as an Arrow dataset (HF) and as litdata chunks."""
    import datasets
    import numpy as np
    import torch
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    tokens = np.fromfile(os.path.join(root, "tokens.bin"), dtype=np.int32)
    lengths = np.load(os.path.join(root, "lengths.npy"))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    docs = [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(lengths))]
    datasets.Dataset.from_dict({"input_ids": docs}).save_to_disk(os.path.join(root, "hf"))
    optimize(fn=_litdata_doc, inputs=[(root, int(offsets[i]), int(offsets[i + 1])) for i in range(len(lengths))],
             output_dir=os.path.join(root, "litdata"), chunk_size=(SEQ_LEN * 64), item_loader=TokensLoader(),
             num_workers=1, mode="overwrite")
    del torch
    return {"ok": True}


def _litdata_doc(spec: tuple[str, int, int]) -> Iterator[Any]:
    import numpy as np
    import torch

    root, start, stop = spec
    tokens = np.memmap(os.path.join(root, "tokens.bin"), dtype=np.int32, mode="r")
    yield torch.from_numpy(np.array(tokens[start:stop]))


# -- resume on another world size ------------------------------------------------------------------------
def _resume_rank(rank: int, world_size: int, root: str, key: str, take: int | None,
                 state: dict | None) -> tuple[str, int, dict]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    import distshard

    pipeline = distshard.StatefulPipeline(build(key, root, rank, world_size))
    pipeline.set_epoch(0)
    if state is not None:
        pipeline.load_state_dict(state)
    loader = StatefulDataLoader(pipeline, batch_size=BATCH, num_workers=NUM_WORKERS, multiprocessing_context="fork",
                                timeout=60)
    got: list[bytes] = []
    it = iter(loader)
    while take is None or len(got) < take:
        try:
            got.append(block_tokens(next(it))[0])
        except StopIteration:
            break
    merged = distshard.gather_states(loader.state_dict())
    del it
    return base64.b64encode(b"".join(got)).decode(), len(got), merged


def resume_check(root: str, key: str, timeout: float) -> dict[str, Any]:
    """4 ranks × 2 workers take 5 batches each, checkpoint; 3 ranks × 2 workers resume."""
    from distshard.verify import run_on_group

    first = run_on_group(_resume_rank, world_size=WORLD_SIZE, timeout=timeout, args=(root, key, 5, None))
    errors = [o.error for o in first if o.error]
    if errors:
        return {"errors": errors}
    state = first[0].value[2]
    second = run_on_group(_resume_rank, world_size=3, timeout=timeout, args=(root, key, None, state))
    errors = [o.error for o in second if o.error]
    if errors:
        return {"errors": errors}
    return {"ids": [o.value[0] for o in first + second], "blocks_before": [o.value[1] for o in first],
            "blocks_after": [o.value[1] for o in second]}
