"""Plot helpers for ``distshard_tour.ipynb``: run every slot of a pipeline in this
process, and draw what came out. Matplotlib only.

Every picture is computed from real runs of ``distshard`` (and of the recipes it is
compared with); nothing here knows where a position should go.

``show(fig, name)`` displays a figure as a PNG in the notebook and, when the
environment variable ``DISTSHARD_FIGURES`` names a directory, also saves it
there as ``<name>.png`` (the test suite checks those files).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import matplotlib

matplotlib.use("Agg")  # render to PNG bytes ourselves: the same in Jupyter and headless
import matplotlib.pyplot as plt  # noqa: E402
import torch.utils.data._utils.worker as worker_module  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from torch.utils.data._utils.worker import WorkerInfo  # noqa: E402

DPI = 120
plt.rcParams.update({
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "axes.labelsize": 10.5,
    "legend.fontsize": 9.5,
    "figure.facecolor": "white",
})

DROPPED = "#d4d4d4"
BEFORE, AFTER = "#3b75af", "#ef8636"  # the run before the checkpoint, the run after it


# -- running every slot in this process ---------------------------------------------
@contextlib.contextmanager
def as_worker(worker_id: int, num_workers: int) -> Iterator[None]:
    """Run the block as if inside DataLoader worker ``worker_id`` of ``num_workers``
    (fakes the worker record torch's DataLoader installs in a worker process)."""
    previous = worker_module._worker_info
    if num_workers:
        worker_module._worker_info = WorkerInfo(id=worker_id, num_workers=num_workers, seed=0, dataset=None)
    try:
        yield
    finally:
        worker_module._worker_info = previous


def run_slots(build: Callable[[int], Any], world_size: int, num_workers: int) -> dict[int, list]:
    """``{slot: elements}`` for every slot of ``world_size`` ranks x ``num_workers``
    workers; ``build(rank)`` makes that rank's pipeline (inside the worker)."""
    out = {}
    for rank in range(world_size):
        for worker in range(num_workers):
            with as_worker(worker, num_workers):
                out[rank * num_workers + worker] = list(build(rank))
    return out


@dataclass
class Layout:
    """Who got which position, from what every slot yielded (elements = positions)."""

    n: int
    owner: dict[int, int] = field(default_factory=dict)  # position -> slot that yielded it
    repeats: list[tuple[int, int]] = field(default_factory=list)  # (slot, position) yielded again
    dropped: list[int] = field(default_factory=list)  # positions nobody yielded


def layout(per_slot: dict[int, list], n: int) -> Layout:
    """Read a :class:`Layout` off ``run_slots`` output over ``range(n)``: the first
    time a position comes out (earliest in its slot's order) is its owner, any
    later time is a repeat (``even='pad'``)."""
    seen = sorted((index, slot, p) for slot, elements in per_slot.items() for index, p in enumerate(elements))
    out = Layout(n)
    for _, slot, p in seen:
        if p in out.owner:
            out.repeats.append((slot, p))
        else:
            out.owner[p] = slot
    out.dropped = [p for p in range(n) if p not in out.owner]
    return out


# -- showing ---------------------------------------------------------------------
def show(fig, name: str):
    """Display ``fig`` as a PNG (and save it under ``$DISTSHARD_FIGURES``), then close it."""
    from IPython.display import Image, display

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    data = buffer.getvalue()
    folder = os.environ.get("DISTSHARD_FIGURES")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.png").write_bytes(data)
    display(Image(data=data))


def slot_colours(world_size: int, num_workers: int) -> list:
    """One colour per slot: a hue per rank, darker for worker 0, lighter for worker 1."""
    cmap = plt.get_cmap("tab20" if num_workers == 2 else "tab10")
    if num_workers == 2:
        return [cmap.colors[(2 * rank + worker) % 20] for rank in range(world_size) for worker in range(2)]
    return [cmap.colors[slot % 10] for slot in range(world_size * num_workers)]


def _cell(ax, x, y, colour, text="", hatch=None, text_colour=None, height=0.8, fontsize=8):
    ax.add_patch(Rectangle((x, y - height / 2), 1, height, facecolor=colour, edgecolor="white",
                           linewidth=1.2, hatch=hatch))
    if hatch:  # the hatch takes the edge colour: draw the white border again on top
        ax.add_patch(Rectangle((x, y - height / 2), 1, height, facecolor="none", edgecolor="white", linewidth=1.2))
    if text:
        if text_colour is None:  # white on dark cells, black on light ones
            r, g, b = to_rgb(colour)
            text_colour = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "black"
        ax.text(x + 0.5, y, text, ha="center", va="center", fontsize=fontsize, color=text_colour)


def _strip(ax, rows: list[tuple[str, Layout]], colours: list, pad_start: int) -> None:
    """One row per layout: cells coloured by slot with the slot number, dropped
    positions grey, repeats hatched after the end of the stream."""
    for y, (_, lay) in enumerate(rows):
        for p in range(lay.n):
            if p in lay.owner:
                _cell(ax, p, y, colours[lay.owner[p]], str(lay.owner[p]))
            else:
                _cell(ax, p, y, DROPPED, "×", text_colour="#777777", fontsize=9)
        for k, (slot, p) in enumerate(sorted(lay.repeats)):
            _cell(ax, pad_start + k, y, colours[slot], str(slot), hatch="///")
            ax.add_patch(Rectangle((p + 0.06, y - 0.36), 0.88, 0.72, facecolor="none", edgecolor="black", linewidth=1.8))
    n = max(lay.n for _, lay in rows)
    width = max([n] + [pad_start + len(lay.repeats) for _, lay in rows])
    if any(lay.repeats for _, lay in rows):
        ax.axvline(n, color="black", linestyle=":", linewidth=1.2)
        ax.text(n + 0.1, -0.5, "padding", fontsize=8.5, va="bottom", style="italic")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(-0.3, width + 0.3)
    ticks = list(range(0, n + 1, 5))
    ax.set_xticks([t + 0.5 for t in ticks if t < n], [str(t) for t in ticks if t < n])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def slot_map_figure(element_rows, unit_rows, unit_sizes, unit_names, world_size, num_workers):
    """The slot map: element-mode rows on top, unit-mode rows below with the
    unit boundaries drawn."""
    colours = slot_colours(world_size, num_workers)
    n = max(lay.n for _, lay in element_rows + unit_rows)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 1.25 + 0.5 * (len(element_rows) + len(unit_rows)) + 1.3),
        gridspec_kw={"height_ratios": [len(element_rows), len(unit_rows) + 0.6], "hspace": 0.6},
    )
    _strip(top, element_rows, colours, n)
    top.set_title(f"Element mode: {n} positions over {world_size} ranks × {num_workers} workers = "
                  f"{world_size * num_workers} slots", loc="left")
    top.set_xlabel("position in the stream (cell: the slot that yields it)")

    _strip(bottom, unit_rows, colours, n)
    edge = 0
    for name, size in zip(unit_names, unit_sizes):
        bottom.axvline(edge, color="black", linewidth=1.6)
        bottom.text(edge + size / 2, -0.75, name, ha="center", va="bottom", fontsize=8.5)
        edge += size
    bottom.axvline(edge, color="black", linewidth=1.6)
    bottom.set_ylim(len(unit_rows) - 0.5, -1.05)
    bottom.set_title(f"Unit mode: {len(unit_sizes)} units ({unit_names[0]} to {unit_names[-1]}) of uneven size; black lines: unit boundaries",
                     loc="left", pad=4)
    bottom.set_xlabel("element of the concatenated units")

    handles = [Patch(facecolor=c, label=f"slot {s}: rank {s // num_workers}, worker {s % num_workers}")
               for s, c in enumerate(colours)]
    handles += [Patch(facecolor=DROPPED, label="× dropped (even='drop')"),
                Patch(facecolor="white", edgecolor="grey", hatch="///",
                      label="padding (even='pad'): repeats\nthe slot's framed position")]
    fig.legend(handles=handles, loc="upper center", ncol=5, frameon=False, bbox_to_anchor=(0.5, 0.02))
    return fig


# -- recipes ----------------------------------------------------------------------
@dataclass
class RecipeResult:
    name: str
    duplicates: int = 0
    missing: int = 0
    imbalance: int = 0  # largest slot count minus smallest
    decodes: int = 0
    per_slot: list[int] = field(default_factory=list)
    error: str | None = None


def measure(name: str, run: Callable[[], dict[int, list]], expected: list, decodes: Counter) -> RecipeResult:
    """Run a recipe over every slot (``run()`` -> ``{slot: elements}``) and count
    duplicates, missing elements, slot imbalance and decodes (``decodes["n"]``,
    incremented by the recipe's counting map)."""
    decodes.clear()
    try:
        per_slot = run()
    except TypeError as exc:
        return RecipeResult(name, error=f"TypeError: {str(exc).splitlines()[0]}")
    seen = Counter(x for elements in per_slot.values() for x in elements)
    counts = [len(v) for v in per_slot.values()]
    return RecipeResult(
        name,
        duplicates=sum(c - 1 for c in seen.values()),
        missing=sum(1 for x in set(expected) if x not in seen),
        imbalance=max(counts) - min(counts),
        decodes=decodes["n"],
        per_slot=counts,
    )


def recipes_figure(results: list[RecipeResult], n: int, title: str, notes: dict[str, str] | None = None):
    """Per recipe (one column each): grouped bars of duplicates / missing / slot
    imbalance on top, decodes per element below; ``notes`` (recipe name -> text)
    are written above a recipe's bars."""
    notes = notes or {}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.6), sharex=True,
                                      gridspec_kw={"height_ratios": [1.6, 1], "hspace": 0.12})
    metrics = [("duplicates", "#d62728", "duplicates"), ("missing", "#7f7f7f", "missing"),
               ("imbalance", "#9467bd", "slot imbalance (largest − smallest count)")]
    width = 0.25
    highest = max([getattr(r, m) for r in results for m, _, _ in metrics] + [1])
    xs = list(range(len(results)))
    for k, (metric, colour, _) in enumerate(metrics):
        for x, r in zip(xs, results):
            if r.error:
                continue
            value = getattr(r, metric)
            top.bar(x + (k - 1) * width, value, width, color=colour)
            top.text(x + (k - 1) * width, value + highest * 0.015, str(value), ha="center", va="bottom", fontsize=9)
    for x, r in zip(xs, results):
        if r.name in notes:
            top.text(x, highest * 1.15, notes[r.name], ha="center", va="center", fontsize=8.5, style="italic",
                     color="#333333")
    top.legend(handles=[Patch(facecolor=c, label=label) for _, c, label in metrics],
               loc="upper center", ncol=3, frameon=False)
    top.set_ylim(0, highest * 1.42)
    top.set_xlim(-0.6, len(results) - 0.4)
    top.set_ylabel(f"elements (of {n})")
    top.set_title(title, loc="left")

    per_element = [r.decodes / n for r in results]
    for x, r, v in zip(xs, results, per_element):
        if r.error:
            continue
        bottom.bar(x, v, 0.5, color="#2a9d8f" if v <= 1.01 else "#e9a23b")
        bottom.text(x, v + 0.15, f"{v:.2f}×", ha="center", va="bottom", fontsize=9.5)
    bottom.axhline(1, color="black", linestyle=":", linewidth=1)
    bottom.set_ylim(0, max(per_element + [1]) * 1.25 + 0.3)
    bottom.set_ylabel("decodes per element\n(all slots together)")
    bottom.set_xticks(xs, [r.name for r in results])
    for x, r in zip(xs, results):
        if r.error:
            for ax, y in ((top, highest * 0.5), (bottom, bottom.get_ylim()[1] * 0.5)):
                ax.text(x, y, "crashes:\n" + r.error.split(":")[0], ha="center", va="center", fontsize=10,
                        color="#b00000", bbox=dict(boxstyle="round", facecolor="#fff0f0", edgecolor="#b00000"))
    for ax in (top, bottom):
        ax.spines[["top", "right"]].set_visible(False)
    return fig


# -- elastic resume ---------------------------------------------------------------
def resume_figure(before: dict[str, list], would: dict[str, list], after: dict[str, list], n: int, title: str):
    """Positions on x; one row per old slot (what it yielded before the checkpoint,
    and, faint, what it would have yielded without the stop), one per new slot,
    and the union. Cells carry the step at which the slot yielded the position."""
    rows = len(before) + len(after) + 1
    fig, ax = plt.subplots(figsize=(11, 0.48 * rows + 1.5))
    for row in range(rows):  # faint bands guide the eye along a row
        ax.axhspan(row - 0.45, row + 0.45, color="#f3f3f3", zorder=0, linewidth=0)
    y = 0
    for label, taken in before.items():
        for p in would[label]:
            if p not in taken:
                ax.add_patch(Rectangle((p, y - 0.4), 1, 0.8, facecolor="none", edgecolor=BEFORE,
                                       linewidth=1, linestyle=(0, (2, 2)), alpha=0.7))
        for step, p in enumerate(taken, 1):
            _cell(ax, p, y, BEFORE, str(step), text_colour="white")
        y += 1
    split = y - 0.5
    for label, taken in after.items():
        for step, p in enumerate(taken, 1):
            _cell(ax, p, y, AFTER, str(step))
        y += 1
    count = Counter(p for part in (before, after) for taken in part.values() for p in taken)
    old = {p for taken in before.values() for p in taken}
    for p in range(n):
        ok = count[p] == 1
        colour = (BEFORE if p in old else AFTER) if ok else "#d62728"
        _cell(ax, p, y, colour, str(count[p]), text_colour="white" if p in old or not ok else "black")
    ax.axhline(split, color="black", linewidth=1.2)
    ax.axhline(y - 0.5, color="black", linewidth=0.8, linestyle=":")
    labels = [f"before · {label}" for label in before] + [f"after · {label}" for label in after]
    exact = all(count[p] == 1 for p in range(n)) and set(count) <= set(range(n))
    labels.append("union: times yielded")
    ax.set_yticks(range(rows), labels)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(-0.3, n + 0.3)
    ax.set_xticks([t + 0.5 for t in range(0, n, 5)], [str(t) for t in range(0, n, 5)])
    ax.set_xlabel("position in the epoch (number in a cell: the slot's step that yielded it)")
    ax.tick_params(axis="y", length=0)
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.set_title(title, loc="left")
    verdict = "every position exactly once" if exact else "NOT exactly once"
    handles = [Patch(facecolor=BEFORE, label="yielded before the checkpoint"),
               Patch(facecolor="none", edgecolor=BEFORE, linestyle="--",
                     label="that slot's share, had the job not stopped"),
               Patch(facecolor=AFTER, label="yielded after the elastic resume"),
               Patch(facecolor="#d62728", label="missing or repeated")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -1.1 / rows), ncol=2, frameon=False)
    ax.set_title(f"union: {verdict}", loc="right", fontsize=10.5, color="#1a7f37" if exact else "#d62728")
    return fig


# -- mixing by weight ---------------------------------------------------------------
MIX_COLOURS = ["#3b75af", "#ef8636", "#2a9d8f", "#9467bd", "#d62728", "#8c564b"]


def running_counts(stream: list, names: list[str]) -> dict[str, list[int]]:
    """``{name: [count of name in stream[:p] for p = 1 .. len(stream)]}``."""
    counts = {name: [] for name in names}
    seen = Counter()
    for source in stream:
        seen[source] += 1
        for name in names:
            counts[name].append(seen[name])
    return counts


def mix_figure(streams: dict[str, list], weights: dict[str, float], batch: int, title: str):
    """One column per stream (a list of source names, in stream order): on top the
    running share of each source over the first positions (log scale) with the
    target shares dashed; below, each global batch (``batch`` consecutive
    positions): every source's count minus its exact share ``batch × w / sum(w)``,
    with the ±1 band of the target. The largest ``|count − share|`` over all
    prefixes is written in each top panel."""
    names = list(weights)
    total = sum(weights.values())
    colours = dict(zip(names, MIX_COLOURS))
    n = max(len(s) for s in streams.values())
    fig, axes = plt.subplots(2, len(streams), figsize=(11.5, 7.4), sharex="row", sharey="row",
                             gridspec_kw={"height_ratios": [1.2, 1], "hspace": 0.55, "wspace": 0.06})
    deviations = {}
    for label, stream in streams.items():
        batches = [stream[i:i + batch] for i in range(0, len(stream) - batch + 1, batch)]
        deviations[label] = {name: [part.count(name) - batch * weights[name] / total for part in batches]
                             for name in names}
    limit = max(3.0, 1.15 * max(abs(d) for per in deviations.values() for ds in per.values() for d in ds))
    width = 0.8 / len(names)
    for column, (label, stream) in enumerate(streams.items()):
        top, bottom = axes[0][column], axes[1][column]
        counts = running_counts(stream, names)
        positions = range(1, len(stream) + 1)
        worst_prefix = 0.0
        for name in names:
            share = weights[name] / total
            top.plot(positions, [c / p for p, c in zip(positions, counts[name])], color=colours[name],
                     linewidth=1.6, label=f"{name} (target {share:.0%})")
            top.axhline(share, color=colours[name], linestyle=(0, (5, 3)), linewidth=1.2, alpha=0.9)
            worst_prefix = max(worst_prefix, max(abs(c - p * share) for p, c in zip(positions, counts[name])))
        top.text(0.98, 0.95, f"largest |count − exact share|\nover all {len(stream)} prefixes: {worst_prefix:.1f}",
                 transform=top.transAxes, ha="right", va="top", fontsize=9.5,
                 bbox=dict(boxstyle="round", facecolor="white", edgecolor="#bbbbbb"))
        top.set_xscale("log")
        top.set_xlim(1, n)
        top.set_ylim(0, 1)
        top.set_title(label, loc="left", fontsize=11)
        top.set_xlabel("position in the mixed stream (log scale)")
        bottom.axhspan(-1, 1, color="#dddddd", zorder=0, linewidth=0)
        bottom.axhline(0, color="black", linewidth=0.8)
        for k, name in enumerate(names):
            values = deviations[label][name]
            bottom.bar([b + 1 + (k - (len(names) - 1) / 2) * width for b in range(len(values))], values, width,
                       color=colours[name])
        worst_batch = max(abs(d) for ds in deviations[label].values() for d in ds)
        bottom.set_title(f"per global batch of {batch}: worst {worst_batch:.1f} elements off",
                         loc="left", fontsize=10.5, fontweight="normal")
        bottom.set_xticks(range(1, len(values) + 1))
        bottom.set_xlabel(f"global batch ({batch} consecutive positions)")
        for ax in (top, bottom):
            ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].set_ylabel("share of the positions so far")
    axes[1][0].set_ylabel("count − exact share\n(elements; grey band: ±1)")
    axes[1][0].set_ylim(-limit, limit)
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], color="black", linestyle=(0, (5, 3)), linewidth=1.2))
    labels.append("target share")
    fig.subplots_adjust(top=0.84)
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False, bbox_to_anchor=(0.5, 0.955))
    fig.suptitle(title, x=0.125, ha="left", fontsize=12, fontweight="bold", y=0.995)
    return fig


# -- even="carry": the epochs as one stream ---------------------------------------------
EPOCH_COLOURS = ["#3b75af", "#ef8636", "#2a9d8f", "#9467bd", "#8c564b", "#e377c2"]


def carry_figure(runs: dict[str, dict[str, list[tuple[int, int]]]], n: int, epochs: int, title: str):
    """One panel per run (``{label: {slot label: [(position in the epochs' concatenated
    streams, epoch that yielded it), ...]}}``): x is the position in the concatenation
    (dotted lines where each epoch's own stream begins), one row per slot, a cell's
    colour the epoch in which the slot yielded it; grey cells in the last row are
    positions no slot yielded. An outlined cell lies in an earlier epoch's stream than
    the epoch that yielded it: a tail carried into the next epoch."""
    total = n * epochs
    heights = [len(rows) + 1.6 for rows in runs.values()]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.3 + 0.33 * sum(heights)),
                             gridspec_kw={"height_ratios": heights, "hspace": 0.42})
    for ax, (label, rows) in zip(axes, runs.items()):
        yielded = Counter(g for cells in rows.values() for g, _ in cells)
        for y, cells in enumerate(rows.values()):
            for g, epoch in cells:
                colour = EPOCH_COLOURS[epoch % len(EPOCH_COLOURS)]
                _cell(ax, g, y, colour, height=0.78)
                if g < epoch * n:  # an element of an earlier epoch's stream
                    ax.add_patch(Rectangle((g, y - 0.39), 1, 0.78, facecolor="none", edgecolor="black", linewidth=1.3))
        missing = [g for g in range(total) if g not in yielded]
        for g in missing:
            _cell(ax, g, len(rows), DROPPED, hatch="///", height=0.78)
        for epoch in range(epochs + 1):
            ax.axvline(epoch * n, color="black", linestyle=":", linewidth=1.1)
        for epoch in range(epochs):
            ax.text(epoch * n + n / 2, -0.75, f"epoch {epoch}'s stream", ha="center", va="bottom", fontsize=9,
                    color=EPOCH_COLOURS[epoch % len(EPOCH_COLOURS)])
        counts = ["/".join(map(str, sorted({sum(1 for _, e in cells if e == epoch) for cells in rows.values()})))
                  for epoch in range(epochs)]
        twice = sum(c - 1 for c in yielded.values() if c > 1)
        ax.set_title(f"{label}: per slot {', '.join(counts)} in epochs 0..{epochs - 1}; "
                     f"{len(missing)} never yielded, {twice} yielded twice", loc="left", fontsize=11, pad=16)
        ax.set_yticks(range(len(rows) + 1), [*rows, "no slot"])
        ax.set_ylim(len(rows) + 0.6, -0.9)
        ax.set_xlim(-0.5, total + 0.5)
        ax.set_xticks([e * n for e in range(epochs + 1)], [f"{e}·N" for e in range(epochs + 1)])
        ax.tick_params(axis="y", length=0, labelsize=8.5)
        ax.spines[["top", "right", "left"]].set_visible(False)
    axes[-1].set_xlabel(f"position in the epochs' streams laid end to end (N = {n} an epoch)")
    handles = [Patch(facecolor=EPOCH_COLOURS[e % len(EPOCH_COLOURS)], label=f"yielded in epoch {e}")
               for e in range(epochs)]
    handles += [Patch(facecolor="white", edgecolor="black", label="an earlier epoch's element"),
                Patch(facecolor=DROPPED, hatch="///", label="never yielded")]
    fig.subplots_adjust(top=0.86)
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, 0.955),
               fontsize=9)
    fig.suptitle(title, x=0.125, ha="left", fontsize=12, fontweight="bold", y=0.995)
    return fig


# -- weight phases and cost-weighted mixing (section 6) -------------------------------------------
def phases_figure(stream: list, phases: list, title: str):
    """A phased mix's stream (a list of source names, in position order): on top the
    running share of each source counted from the start of its phase, with each
    phase's target shares dashed and the boundaries marked; below, every source's
    count minus its exact share in every prefix of its phase, with the ±1 band."""
    names = list(phases[0][1])
    colours = dict(zip(names, MIX_COLOURS))
    starts = [start for start, _ in phases] + [len(stream)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11.5, 7.2), sharex=True,
                                      gridspec_kw={"height_ratios": [1.25, 1], "hspace": 0.3})
    worst = 0.0
    for (start, weights), end in zip(phases, starts[1:]):
        total = sum(weights.values())
        counts = running_counts(stream[start:end], names)
        positions = range(start + 1, end + 1)
        for name in names:
            share = weights[name] / total
            top.plot(positions, [c / (p - start) for p, c in zip(positions, counts[name])], color=colours[name],
                     linewidth=1.6, label=name if start == 0 else None)
            top.hlines(share, start, end, color=colours[name], linestyle=(0, (5, 3)), linewidth=1.2)
            deviation = [c - (p - start) * share for p, c in zip(positions, counts[name])]
            bottom.plot(positions, deviation, color=colours[name], linewidth=1.1)
            worst = max(worst, max(abs(d) for d in deviation))
        if start:
            for ax in (top, bottom):
                ax.axvline(start, color="black", linewidth=1.2)
            top.text(start, 1.02, f" phase from position {start}", ha="left", va="bottom", fontsize=9.5,
                     transform=top.get_xaxis_transform())
    top.set_ylim(0, 1)
    top.set_xlim(0, len(stream))
    top.set_ylabel("share since the phase began")
    top.legend(loc="upper right", ncol=len(names), frameon=False)
    bottom.axhspan(-1, 1, color="#dddddd", zorder=0, linewidth=0)
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set_ylim(-1.6, 1.6)
    bottom.set_ylabel("count − exact share\n(elements; grey band: ±1)")
    bottom.set_xlabel("position in the mixed stream")
    bottom.set_title(f"every prefix of every phase, counted from its start: at most {worst:.2f} elements off",
                     loc="left", fontsize=10.5, fontweight="normal")
    for ax in (top, bottom):
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title, x=0.125, ha="left", fontsize=12, fontweight="bold", y=0.98)
    return fig


def cost_figure(streams: dict[str, tuple[list, list]], weights: dict[str, float], title: str):
    """One column per mix (label -> (source names, element costs), in position
    order): the running share of each source's *cost* (solid) and of its *count*
    (dotted) over the positions, the target shares dashed."""
    names = list(weights)
    total = sum(weights.values())
    colours = dict(zip(names, MIX_COLOURS))
    fig, axes = plt.subplots(1, len(streams), figsize=(11.5, 4.8), sharey=True, gridspec_kw={"wspace": 0.06})
    for ax, (label, (sources, costs)) in zip(axes, streams.items()):
        positions = range(1, len(sources) + 1)
        counts = running_counts(sources, names)
        spent, own = 0, {name: 0 for name in names}
        shares: dict[str, list[float]] = {name: [] for name in names}
        for source, cost in zip(sources, costs):
            spent += cost
            own[source] += cost
            for name in names:
                shares[name].append(own[name] / spent if spent else 0.0)
        for name in names:
            ax.plot(positions, shares[name], color=colours[name], linewidth=1.7, label=f"{name}: share of tokens")
            ax.plot(positions, [c / p for p, c in zip(positions, counts[name])], color=colours[name],
                    linewidth=1.2, linestyle=":", label=f"{name}: share of samples")
            ax.axhline(weights[name] / total, color=colours[name], linestyle=(0, (5, 3)), linewidth=1.1, alpha=0.9)
        ax.set_xscale("log")
        ax.set_xlim(1, len(sources))
        ax.set_ylim(0, 1)
        ax.set_title(label, loc="left", fontsize=11)
        ax.set_xlabel("position in the mixed stream (log scale)")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("share so far (dashed: the weights)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.subplots_adjust(top=0.76)
    fig.legend(handles, labels, loc="upper center", ncol=3, frameon=False, bbox_to_anchor=(0.5, 0.93))
    fig.suptitle(title, x=0.125, ha="left", fontsize=12, fontweight="bold", y=0.99)
    return fig


_SHADES = ["#4c72b0", "#9fb8dc", "#dd8452", "#f0c1a0", "#55a868", "#a9d4b2"]


def _blocks_panel(ax, rows: list[dict], seq_len: int, tag: Callable[[dict], tuple[str, Any]] | None = None) -> None:
    """One row of ``seq_len`` cells per block, coloured by document (alternating
    shades, a bold edge where a document starts), padding grey; a segment id in each
    cell when the row has ``segments``; ``tag(row)`` gives a label and a colour on the left."""
    for b, row in enumerate(rows):
        y = len(rows) - 1 - b
        previous = None
        for t, doc in enumerate(row["doc"]):
            colour = "#dddddd" if doc < 0 else _SHADES[doc % len(_SHADES)]
            ax.add_patch(Rectangle((t, y + 0.1), 1, 0.8, facecolor=colour, edgecolor="white", linewidth=0.5))
            if doc >= 0 and doc != previous and row["starts"][t]:
                ax.plot([t, t], [y + 0.05, y + 0.95], color="black", linewidth=2)
            if "segments" in row:
                ax.text(t + 0.5, y + 0.5, str(row["segments"][t]), ha="center", va="center", fontsize=6)
            previous = doc
        if tag is not None:
            text, colour = tag(row)
            ax.add_patch(Rectangle((-3.2, y + 0.1), 2.9, 0.8, facecolor=colour, edgecolor="none"))
            ax.text(-1.75, y + 0.5, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(-3.4 if tag is not None else -0.2, seq_len + 0.2)
    ax.set_ylim(-0.2, len(rows) + 0.2)
    ax.set_yticks([len(rows) - 1 - b + 0.5 for b in range(len(rows))], [f"block {b}" for b in range(len(rows))])
    ax.set_xticks(range(0, seq_len + 1, 4))
    for spine in ax.spines.values():
        spine.set_visible(False)


def packed_blocks(rows: list[dict], seq_len: int, colours: list, slot_names: list[str]):
    """``rows``: one per block, in block order, ``{"doc": [document of each token or -1
    for padding], "starts": [whether a document starts there], "slot": slot that read
    it}``, drawn by ``_blocks_panel`` with a tag on the left naming the slot."""
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.2))
    _blocks_panel(ax, rows, seq_len, lambda row: (slot_names[row["slot"]], colours[row["slot"]]))
    ax.set_xlabel("token position in the block (black bar: a document starts; grey: padding)")
    ax.set_title("pack(): blocks cut from the concatenated documents, and the slot that reads each")
    return fig


def fits_figure(fits: dict[str, list[dict]], seq_len: int, title: str):
    """The same documents packed by each fit (``{fit: rows}``, rows as for
    :func:`packed_blocks` with ``segments``, the block's segment id of each token):
    side by side, the segment ids written in the cells."""
    tallest = max(len(rows) for rows in fits.values())
    fig, axes = plt.subplots(1, len(fits), figsize=(6.2 * len(fits), 0.34 * tallest + 1.6))
    for ax, (name, rows) in zip(axes, fits.items(), strict=True):
        _blocks_panel(ax, rows, seq_len)
        ax.set_title(name, loc="left", fontsize=11)
        ax.set_xlabel("token position (digits: segment_ids, 0 on padding)")
    fig.suptitle(title, x=0.06, ha="left", fontsize=12, fontweight="bold")
    fig.tight_layout()
    return fig
