"""``distshard.explain(pipeline)``: what a ``dist_shard`` pipeline will do, before it runs.

The resolved context (and where it came from), the plan (slots, counts, what
``even`` drops or repeats, where a few positions go), how often each element is
read and decoded as the pipeline is placed, and warnings with their fix.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
from torch.utils.data.graph import DataPipeGraph

from .context import ShardContext
from .core import PlanModel
from .engine import SlotRun, carry_run_base, layout_for, shuffle_order
from .errors import OptionError, OptionTypeError
from .graph import is_sharding_pipe, pipe_graph, pipeline_of, upstream_pipes
from .pack import PackIterDataPipe
from .plan import carry_summary, dropped_count, padded_count, slot_count
from .protocol import IdentifiedSource
from .readers import RandomAccessReader, Reader, StreamReader

__all__ = ["Explanation", "explain", "explain_model", "explain_shard"]

_SOURCES = {
    "explicit": "the rank= / world_size= arguments",
    "mesh": "the mesh= argument (the data-parallel dimensions of a DeviceMesh)",
    "group": "the group= argument (the data-parallel ProcessGroup)",
    "torch.distributed": "the initialized torch.distributed process group",
    "pickled": "torch.distributed as captured when the pipe was sent to this process",
    "env": "the RANK / WORLD_SIZE environment (torchrun; or LOCAL_RANK / NODE_RANK as Lightning sets them)",
    "default": "nothing: no rank given, no torch.distributed, no RANK/WORLD_SIZE",
}

# pipes after dist_shard that change how many elements a slot yields
_UNBALANCING = ("FilterIterDataPipe", "FlatMapperIterDataPipe", "UnBatcherIterDataPipe")


@dataclass
class Explanation:
    """What :func:`distshard.explain` found; ``str()`` for terminals,
    ``_repr_html_`` for notebooks.

    For a pipeline with several ``dist_shard`` pipes, ``parts`` holds one
    Explanation per pipe (in traversal order, downstream first); the sections and
    warnings of the whole are theirs, labelled with the pipe they concern, its
    ``context`` is the first one's and the per-element figures are left ``None``.
    """

    context: ShardContext
    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    total: int | None = None
    per_slot: list[int] | None = None  # what every slot yields this epoch, when the length is known
    left_out: int | None = None  # positions no slot yields (even="drop", with multiple_of)
    repeated: int | None = None  # elements yielded twice (even="pad")
    layout: str | None = None  # how positions go to slots: stride, chunks, blocks or units
    first_positions: dict[int, list[int]] = field(default_factory=dict)  # slot -> its first positions
    reads_per_element: float | None = None
    decodes_per_element: float | None = None
    parts: list["Explanation"] = field(default_factory=list)

    def __str__(self) -> str:
        out = []
        for title, lines in self.sections:
            out.append(f"{title}:")
            out.extend(f"  {line}" for line in lines)
        out.append("warnings:" if self.warnings else "warnings: none")
        out.extend(f"  ! {w}" for w in self.warnings)
        return "\n".join(out)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        parts = ["<div class='distshard-explain'>"]
        for title, lines in self.sections:
            parts.append(f"<b>{html.escape(title)}</b><ul>")
            parts.extend(f"<li>{html.escape(line)}</li>" for line in lines)
            parts.append("</ul>")
        if self.warnings:
            parts.append("<b>warnings</b><ul>")
            parts.extend(f"<li style='color:#b00'>{html.escape(w)}</li>" for w in self.warnings)
            parts.append("</ul>")
        else:
            parts.append("<b>warnings</b>: none")
        parts.append("</div>")
        return "".join(parts)


def _name(pipe: Any) -> str:
    fn = getattr(pipe, "fn", None)
    if isinstance(pipe, MapperIterDataPipe) and fn is not None:
        return f"map({getattr(fn, '__name__', type(fn).__name__)})"
    return type(pipe).__name__.replace("IterDataPipe", "")


def _chain(pipe: IterDataPipe) -> list:
    """The linear chain of pipes from ``pipe`` down to its first source (first
    parent of each)."""
    chain: list = []
    graph = pipe_graph(pipe)
    while graph:
        node, graph = next(iter(graph.values()))
        chain.append(node)
    return chain


def _path(graph: DataPipeGraph, target: Any) -> list | None:
    """The pipes from the top of ``graph`` down to ``target`` (excluded), or ``None``
    if ``target`` is not in it."""
    for node, parents in graph.values():
        if node is target:
            return []
        below = _path(parents, target)
        if below is not None:
            return [node, *below]
    return None


def _pipeline_of(obj: Any) -> IterDataPipe:
    """The ``IterDataPipe`` inside ``obj`` (see ``graph.pipeline_of``), or ``TypeError``."""

    found = pipeline_of(obj)
    if found is None:
        raise OptionTypeError(
            f"explain() needs an IterDataPipe pipeline, or an object holding one as .pipeline or "
            f".dataset (distshard.StatefulPipeline, a DataLoader), got {type(obj).__name__}"
        )
    return found


def explain(pipeline: Any) -> Explanation:
    """What the ``dist_shard`` pipes of ``pipeline`` will do in this process: the
    context and where it came from, the plan (slots, counts, what ``even`` drops
    or repeats), how often elements are read and decoded as placed, and warnings
    with their fix, including pipes after ``dist_shard`` that unbalance or shard
    again.

    Args:
        pipeline: an ``IterDataPipe`` holding one or more ``dist_shard`` pipes, or
            an object with the pipeline as ``.pipeline`` or ``.dataset`` (a
            :class:`distshard.StatefulPipeline`, a ``DataLoader``).

    Returns:
        An :class:`Explanation` (``print()`` it, or let a notebook show it); with
        several ``dist_shard`` pipes it combines one per pipe, kept in ``parts``.

    Example:
        >>> import distshard
        >>> from torch.utils.data.datapipes.iter import IterableWrapper
        >>> pipeline = IterableWrapper(range(10)).dist_shard(rank=0, world_size=2).batch(2)
        >>> distshard.explain(pipeline).total
        10
    """

    top = _pipeline_of(pipeline)
    shards = _shards_in(top)
    if not shards:
        raise OptionError(
            f"explain() found no dist_shard in {type(top).__name__}; add .dist_shard() to the "
            "pipeline, or pass the pipeline that holds it"
        )
    parts = [explain_shard(shard, top) for shard in shards]
    if len(parts) == 1:
        return parts[0]
    labels = [f"dist_shard {index} of {len(parts)}" for index in range(1, len(parts) + 1)]
    whole = Explanation(parts[0].context, parts=parts)
    whole.sections.append(("pipeline", [f"{label}: {shard!r}" for label, shard in zip(labels, shards, strict=True)]))
    for label, part in zip(labels, parts, strict=True):
        whole.sections.extend((f"{label}: {title}", lines) for title, lines in part.sections)
        whole.warnings.extend(f"{label}: {warning}" for warning in part.warnings)
    return whole


def _shards_in(pipeline: IterDataPipe) -> list[Any]:
    """The ``dist_shard`` pipes of ``pipeline``: those that offer a :class:`PlanModel`."""
    return [p for p in upstream_pipes(pipeline) if callable(getattr(type(p), "plan_model", None))]


_SHOWN_SLOTS, _SHOWN_POSITIONS = 16, 8


class _Positions(RandomAccessReader):
    """``reader`` as a run sees it, yielding the positions it reads instead of the
    elements: the engine itself says where positions go, in every layout."""

    def __init__(self, reader: RandomAccessReader) -> None:
        self.reader, self.mode, self.prefers_blocks = reader, reader.mode, reader.prefers_blocks

    def length(self) -> int:
        return self.reader.length()

    def identity(self) -> str:
        return self.reader.identity()

    def order(self, seed: int) -> Any:
        return self.reader.order(seed)

    def read(self, positions: Any, shuffled: bool = False) -> Any:
        return iter(positions)


def _plan(model: PlanModel, ctx: ShardContext, total: int, out: Explanation) -> list[str]:
    """The plan of an epoch of ``total`` positions: counts, what ``even`` leaves out or
    repeats, the layout, and the first positions of every slot, as the engine runs them."""
    S, even, multiple, shuffled = ctx.num_slots, model.even, model.multiple_of, model.shuffle
    reader: Reader = model.reader()
    positions: Reader = (
        _Positions(reader)
        if isinstance(reader, RandomAccessReader)
        else StreamReader(lambda: range(total), "positions", reader.identity())
    )
    layout = layout_for(positions, multiple)
    out.layout = layout.name
    counts = out.per_slot = [slot_count(s, S, total, even, multiple) for s in range(S)]
    shown = counts if S <= _SHOWN_SLOTS else counts[:_SHOWN_SLOTS] + ["..."]
    lines = [f"N = {total} positions over {S} slots; per slot: {shown}; this slot: {counts[ctx.slot]}"]
    out.left_out, out.repeated = dropped_count(S, total, even, multiple), padded_count(S, total, even)
    whole = f" with multiple_of={multiple} (every slot a multiple of {multiple})" if multiple > 1 else ""
    order = " of the permuted order" if shuffled else ""
    if even == "drop":
        lines.append(
            f"even='drop'{whole} leaves out the last {out.left_out} positions{order}"
            if out.left_out
            else f"even='drop'{whole} leaves nothing out: N is a multiple of the slot count"
        )
    seed = model.seed
    permute = shuffle_order(reader, seed, model.epoch) if shuffled else (lambda v: v)  # type: ignore[arg-type]
    if even == "pad":
        pad = layout.pad_position(ctx.slot, S, total)
        lines.append(
            f"even='pad' repeats {out.repeated} elements in all"
            + (f"; this slot repeats position {permute(pad)}" if pad is not None else "; none in this slot")
        )
    K = ctx.num_workers
    lines.extend(layout.explain(ctx, total, even, multiple, shuffled))
    for slot in range(min(S, _SHOWN_SLOTS)):
        rank, worker = divmod(slot, K)
        run = SlotRun(
            positions,
            ctx=ShardContext(rank, ctx.world_size, worker, K, ctx.source),
            even=even,
            shuffle=shuffled,
            epoch=model.epoch,
            seed=seed,
            multiple=multiple,
        )
        out.first_positions[slot] = list(islice(run, _SHOWN_POSITIONS))
    listed = "; ".join(
        f"s{slot}: {', '.join(map(str, first))}" + (" ..." if counts[slot] > len(first) else "")
        for slot, first in out.first_positions.items()
    )
    lines.append(
        f"first positions per slot{' (permuted)' if shuffled else ''}: {listed}" + (" ..." if S > _SHOWN_SLOTS else "")
    )
    return lines


def _carry_lines(model: PlanModel, total: int, S: int, out: Explanation) -> list[str]:
    """What ``even="carry"`` takes from the epochs before this one and leaves to the next."""

    epoch, unit = model.epoch, S * model.multiple_of
    base, first = carry_run_base(model.pending, model.carry, epoch)
    if first > epoch:
        return [f"even='carry': the loaded state was taken after epoch {epoch} ended: nothing left of it here"]
    count, earlier, left = carry_summary(base, first, epoch, total, unit)
    out.per_slot, out.left_out, out.repeated = [count // S] * S, 0, 0
    taken = ", ".join(f"{n} from the tail of epoch {e}" for e, n in sorted(earlier.items())) or "nothing earlier"
    lines = [
        f"N = {total} positions an epoch; even='carry': the epochs form one stream, cut into whole rounds of "
        f"{unit} ({S} slots x multiple_of {model.multiple_of}); epoch {epoch} takes {count} positions of it, "
        f"{count // S} per slot, nothing dropped or repeated",
        f"epoch {epoch} opens with {taken}, and leaves {left} of epoch {epoch}'s elements to epoch {epoch + 1}",
    ]
    if (base.to_list(), first) != ([[0, None]], 0):
        lines.append(
            "its boundaries come from a loaded state (an elastic resume moves them): keep loading states "
            "into the pipeline (merge_states) so later epochs know them"
        )
    return lines


def _packing_lines(packed: PackIterDataPipe, out: Explanation, ctx: ShardContext) -> list[str]:
    """What ``distshard.pack`` below ``dist_shard`` makes: tokens per block, blocks per
    slot, the padding and what a block reads."""
    plan = packed.packing()
    how = {
        "source": "from the source's own counts (no document read)",
        "cache": "from the cache ($DISTSHARD_CACHE, keyed by the files' identities and what the maps and the "
        "token picker compute)",
        "counted": "counted in one pass over the documents when pack() was built"
        + (", and cached for the next pack() of the same files and maps" if packed._counts.entry else ""),
    }[packed._counts.how]
    if plan.fit == "best":
        window = (
            f"windows of {packed.window_documents} documents"
            if packed.window_documents is not None
            else f"windows of {packed.window} tokens"
        )
        fit = (
            f"whole documents placed by best fit (decreasing, within {window} in source order; a document "
            f"longer than {packed.seq_len} in pieces of {packed.seq_len} and its remainder): {plan.padding} padding "
            f"tokens at the ends of blocks, {plan.padding / max(plan.blocks * packed.seq_len, 1):.2%}"
        )
    else:
        fit = f"{plan.padding} padding tokens in the last block"
    lines = [
        f"{plan.blocks} blocks of {packed.seq_len} tokens (input_ids, position_ids restarting at each document, "
        f"loss_mask, segment_ids) from {packed.documents} documents, {plan.total} tokens"
        + (f" with an eos ({packed.eos}) after each document" if packed.eos is not None else ""),
        f"{fit} (pad={packed.pad}, loss_mask 0); no token dropped, the blocks are the same at any world size",
        f"token counts {how}",
    ]
    if out.per_slot is not None:
        shown = sorted(set(out.per_slot))
        lines.append(
            f"blocks per slot: {shown[0]}" + (f" to {shown[-1]}" if len(shown) > 1 else "") + f" ({packed.seq_len} "
            f"tokens each); this slot: {out.per_slot[ctx.slot]}"
        )
    if plan.blocks:
        lines.append(
            f"a block reads only the documents it spans: {plan.documents / plan.blocks:.3g} documents a block "
            "on average; a slot reading consecutive blocks reads a document at their boundary once"
        )
        first = out.first_positions.get(ctx.slot)
        if first:
            k0, k1 = plan.documents_of(first[0])
            seed = packed._order_seed()
            d0, d1 = (k0, k1) if seed is None else (packed.order(seed)(k0), packed.order(seed)(k1))
            span = f"documents {d0}..{d1}" if seed is None else f"documents {d0} .. {d1} (packed {k0}..{k1})"
            lines.append(f"this slot's first block: block {first[0]} reads {span}")
    per_document = plan.nbytes / max(packed.documents, 1)
    if packed.shuffle_documents:
        lines.append(
            "documents packed in an order seeded from (seed, epoch): a new packing every epoch"
            + (" (and a new number of blocks)" if plan.fit == "best" else "")
            + f"; the plan holds {per_document:.3g} bytes per document besides the counts in that order"
        )
    else:
        lines.append(f"the plan holds {per_document:.3g} bytes per document besides the source's token counts")
    return lines


def explain_shard(pipe: Any, pipeline: IterDataPipe | None = None) -> Explanation:
    """The :class:`Explanation` of one ``dist_shard`` pipe; ``pipeline``, if given,
    is the whole pipeline, whose pipes after ``pipe`` are checked too (see
    ``DistShardIterDataPipe.explain``)."""
    return explain_model(pipe.plan_model(), pipeline)


def explain_model(model: PlanModel, pipeline: IterDataPipe | None = None) -> Explanation:
    """The :class:`Explanation` of one shard from its :class:`~distshard.core.PlanModel`:
    where it runs, its plan, what it reads how often, its upstream randomness and,
    given the whole ``pipeline``, what the pipes after it undo."""
    out = Explanation(model.context)
    _context_section(model.context, out)
    _plan_section(model, out)
    _reads_section(model, out)
    _randomness_section(model, out)
    if pipeline is not None:
        _after_shard_warnings(pipeline, model.pipe, out)
    return out


def _context_section(ctx: ShardContext, out: Explanation) -> None:
    """Where this process sits (rank, worker, slot) and where that came from."""
    out.sections.append(
        (
            "context",
            [
                f"rank {ctx.rank} of {ctx.world_size}, from {_SOURCES[ctx.source]}",
                f"worker {ctx.worker_id} of {ctx.num_workers} "
                + (
                    "(a DataLoader worker)"
                    if ctx.num_workers > 1 or ctx.worker_id
                    else "(no DataLoader worker here: inside a DataLoader with K workers there are K slots per rank)"
                ),
                f"slot {ctx.slot} of {ctx.num_slots} (slot = rank * num_workers + worker_id)",
                *_group_lines(ctx),
            ],
        )
    )
    if ctx.source == "default":
        out.warnings.append(
            "no distributed context found: every process will think it is rank 0 of 1 and read "
            "everything. Initialize torch.distributed, run under torchrun, or pass rank=/world_size=."
        )


def _group_lines(ctx: ShardContext) -> list[str]:
    """The data group that gave the rank, if one did."""
    if ctx.group is None:
        return []
    return [
        f"data group: {ctx.group.describe()}; the rank is the data rank, and model-parallel peers "
        "(ranks with the same data coordinate) read the same elements in the same order"
    ]


def _plan_section(model: PlanModel, out: Explanation) -> None:
    """The options, and how positions go to slots: whole files, a stream of unknown
    length, the carry's stream of epochs or the plan of a known length."""
    S, total = model.context.num_slots, model.total
    out.total = total
    seed = f"given: {model.given_seed}" if model.given_seed is not None else None
    plan_lines = [
        f"mode: {model.mode}; even={model.even!r}; "
        + (f"multiple_of={model.multiple_of}; " if model.multiple_of > 1 else "")
        + f"shuffle={model.shuffle}; "
        f"epoch={model.epoch}; seed={seed or 'None (0, or the DataLoader shared seed when synced)'}"
    ]
    if total is None and model.whole_files:
        plan_lines.append(
            f"whole files: file k goes to slot k mod {S}; a slot's count is known once its files "
            "are read (counts differ)"
        )
    elif total is None:
        plan_lines.append(
            "stream length unknown: each slot finds its share while streaming; "
            + {
                None: "slot counts will differ by at most 1",
                "drop": f"every slot yields N // {S}, the last N % {S} are dropped",
                "pad": f"every slot yields ceil(N / {S}), repeating fewer than {S} elements",
                "carry": "even='carry' needs the length (it reads at positions)",
            }[model.even]
        )
    elif model.even == "carry":
        plan_lines += _carry_lines(model, total, S, out)
    else:
        plan_lines.extend(_plan(model, model.context, total, out))
    out.sections.append(("plan", plan_lines))


def _reads_section(model: PlanModel, out: Explanation) -> None:
    """How the source is read, how often each element is read, and the source's own lines
    (files, a mixture, packing)."""
    S, read_plan = model.context.num_slots, model.read_plan
    reads = _read_lines(model, out)
    if read_plan.sequence is not None and hasattr(read_plan.base, "stored_hint"):  # a file source
        reads.append(f"files: {read_plan.base.describe()}")
    mixture = getattr(type(read_plan.base), "describe", None)
    if isinstance(read_plan.base, PackIterDataPipe):
        out.sections.append(("packing", _packing_lines(read_plan.base, out, model.context)))
    elif mixture is not None and issubclass(type(read_plan.base), IdentifiedSource):  # a mix, a weighted_sample
        reads.append(f"mixture: {mixture(read_plan.base)}")
    if read_plan.maps:
        reads.append(
            "pushdown: "
            + ", ".join(_name(m) for m in read_plan.maps)
            + " run on this slot's elements only: once per element cluster-wide"
        )
    _decodes(model, out)
    if not model.pushdown and isinstance(model.source, MapperIterDataPipe):
        out.warnings.append(
            f"pushdown=False: {_name(model.source)} runs on every slot ({S}x per element); "
            "keep it only for maps with side effects"
        )
    out.sections.append(("reads", reads))


def _read_lines(model: PlanModel, out: Explanation) -> list[str]:
    """How a slot reads (whole files, units, random access or the stream) and the reads
    per element that makes."""
    S, read_plan = model.context.num_slots, model.read_plan
    if model.whole_files:  # a compressed file source: whole files, each read once
        out.reads_per_element = out.decodes_per_element = 1.0
        return [model.reader().describe()]
    if model.mode != "element":
        out.reads_per_element = out.decodes_per_element = 1.0 if model.sizes is not None else None
        if model.sizes is None:
            return [
                "units go whole to slots as far as they go round; each leftover unit is "
                f"read by at most ceil({S} / leftover) slots"
            ]
        return [
            "each slot reads only the units (or unit ranges) of its block: about 1 read "
            "per element with a sequence-returning expand; an iterator-returning expand "
            "decodes what it skips inside a unit"
        ]
    if read_plan.sequence is not None:
        out.reads_per_element = 1.0
        return [
            f"fast path: random access into {type(read_plan.sequence).__name__}; "
            "each slot indexes its own positions: 1 read per element cluster-wide"
        ]
    out.reads_per_element = float(S)
    return [
        f"stream: every slot walks the stream of {_name(read_plan.base)}: "
        f"{S} read{'s' if S > 1 else ''} per element of it (no random access)"
    ]


def _decodes(model: PlanModel, out: Explanation) -> None:
    """How often each element is decoded: maps below a stream dist_shard cannot select
    through run on every slot."""
    if model.mode != "element":
        return
    read_plan = model.read_plan
    maps_below = [] if read_plan.sequence is not None else _chain(read_plan.base)
    maps_below = [p for p in maps_below if isinstance(p, MapperIterDataPipe)]
    if maps_below:
        what = ", ".join(_name(m) for m in maps_below)
        out.warnings.append(
            f"{what} sits below {_name(read_plan.base)}, which dist_shard cannot select through, "
            f"so it runs on every slot ({model.context.num_slots}x per element): move expensive work after "
            "dist_shard, or make the source random-access"
        )
        out.decodes_per_element = float(model.context.num_slots)
    else:
        out.decodes_per_element = 1.0


def _randomness_section(model: PlanModel, out: Explanation) -> None:
    """The upstream random pipes dist_shard seeds."""
    randoms = model.random_pipes
    if randoms:
        out.sections.append(
            (
                "randomness",
                [
                    f"{len(randoms)} upstream random pipe(s) ({', '.join(_name(p) for p in randoms)}) seeded "
                    "identically on every slot from (seed, epoch); call set_epoch(e) each epoch"
                ],
            )
        )


def _after_shard_warnings(pipeline: IterDataPipe, pipe: Any, out: Explanation) -> None:
    """What the pipes between ``pipe`` and the top of ``pipeline`` undo: a second
    sharding, data-dependent counts, a shuffle buffer no checkpoint covers."""
    for p in _path(pipe_graph(pipeline), pipe) or []:
        if is_sharding_pipe(p) and p is not pipe:
            out.warnings.append(
                f"{_name(p)} after dist_shard shards a second time (torch's DataLoader will raise); remove it"
            )
        if type(p).__name__ in _UNBALANCING:
            out.warnings.append(
                f"{_name(p)} after dist_shard yields a data-dependent number of elements per slot, "
                "so even= cannot keep ranks in step: end DDP loops with distshard.stop_together()"
            )
        if type(p).__name__ == "ShufflerIterDataPipe":
            out.warnings.append(
                "shuffle() after dist_shard holds a buffer that a checkpoint does not cover (a resume "
                "skips it): shuffle before dist_shard or use dist_shard(shuffle=True)"
            )
