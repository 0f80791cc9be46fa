"""What ``distshard.mix`` takes, checked: the sources' names, the weights (a mapping or
phases, with an error for every other shape that names the mapping that was meant), the
costs, the sources' lengths and stored bytes, and the digest of weights and costs that
goes into a mix's identity."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from typing import Any, Iterable, Sequence

from torch.utils.data.datapipes.datapipe import IterDataPipe

from .digests import blake2b_hex
from .errors import OptionError, OptionTypeError, UnsupportedError
from .graph import plan_pushdown

Weights = Mapping[Any, float]
Phases = Sequence[tuple[int, Weights]]


def digest(*values: Any) -> str:
    """A 16-hex-digit digest of the whole ``repr`` of values (every item, unlike
    ``readers.stable_digest``'s sample): for weights and costs in identities."""
    return blake2b_hex(repr(values).encode(), 8)


def check_int(name: str, value: object, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(
            f"{name}={value!r} must be {'None or ' if optional else ''}an int (got {type(value).__name__})"
        )
    if value < 0:
        raise OptionError(f"{name}={value} must be non-negative")
    return value


def source_names(sources: Mapping) -> list[str]:
    names = [str(key) for key in sources]
    seen: dict[str, Any] = {}
    for key, name in zip(sources, names, strict=True):
        if name in seen:
            raise OptionError(
                f"sources {seen[name]!r} and {key!r} have the same name {name!r}; give the sources "
                "keys that print differently"
            )
        seen[name] = key
    return names


def check_keys(keys: list, given: Mapping, what: str, missing: str) -> None:
    """Every key of ``given`` is a source key and every source has one."""
    extra = [key for key in given if key not in keys]
    if extra:
        hint = ""
        if any(str(key) == str(e) for key in keys for e in extra):
            hint = " (the keys must be the sources' own keys, of the same type)"
        raise OptionError(f"{what} name {extra[0]!r}, which is not a source; sources are {keys}{hint}")
    absent = [key for key in keys if key not in given]
    if absent:
        raise OptionError(missing.format(key=absent[0]))


def check_weights(keys: list, weights: object, where: str, zero_ok: bool) -> list[float]:
    """One phase's weights, in source order."""
    if not isinstance(weights, Mapping):
        raise OptionTypeError(f"{where}weights must be a mapping source -> weight, got {type(weights).__name__}")
    check_keys(keys, weights, f"{where}weights", f"{where}source {{key!r}} has no weight; give every source a weight")
    out = []
    for key in keys:
        weight = weights[key]
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise OptionTypeError(f"{where}the weight of source {key!r} is {weight!r}, not a number")
        if not math.isfinite(weight) or weight < 0 or (weight == 0 and not zero_ok):
            raise OptionError(
                f"{where}the weight of source {key!r} is {weight!r}; weights must be positive and "
                "finite (drop a source instead of giving it weight 0)"
            )
        out.append(float(weight) if not isinstance(weight, int) else weight)
    if not any(out):
        raise OptionError(f"{where}every weight is 0: give some source a positive weight")
    return out


_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxdict = 8
_SHORT.maxstring, _SHORT.maxother = 60, 60
_USAGE = (
    "mix() takes weights as a mapping {source: weight} or as phases "
    "[(0, {source: weight}), (start, {source: weight}), ...]"
)
_TAKES = "but " + _USAGE


def _mapping(pairs: Iterable[tuple[Any, Any]]) -> str:
    """``{key: value, ...}`` as Python writes it, cut after 8 items."""
    items = list(pairs)
    shown = ", ".join(f"{key!r}: {value!r}" for key, value in items[:8])
    return "{" + shown + (", ...}" if len(items) > 8 else "}")


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def wrong_weights(keys: list, weights: object) -> TypeError | None:
    """The error for ``weights`` of a shape ``mix`` does not take (a list of numbers,
    a number, a set, (source, weight) pairs, mappings without starts, ...), naming
    what it takes and, where it can be told, the mapping that was meant; ``None`` for
    the shapes of phases, checked one by one."""
    what, meant = "", ""
    equal = f"; give each source its weight, e.g. weights={_mapping((key, 1) for key in keys)} for equal shares"
    tolist = getattr(weights, "tolist", None)  # numpy arrays, tensors
    values = tolist() if callable(tolist) and not isinstance(weights, (list, tuple)) else weights
    if _is_number(values):
        what, meant = "is a single number", equal
    elif isinstance(values, (list, tuple)) and values and all(_is_number(v) for v in values):
        kind = type(weights).__name__
        if len(values) == len(keys):
            what = f"is a {kind} of numbers"
            meant = f"; with the sources in their order that is weights={_mapping(zip(keys, values, strict=True))}"
        else:
            what, meant = f"is a {kind} of {len(values)} numbers for {len(keys)} sources", equal
    elif isinstance(weights, (set, frozenset)):
        what, meant = "is a set, which has no order to tell whose weight is whose", equal
    elif (
        isinstance(weights, (list, tuple))
        and weights
        and all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 and not isinstance(pair[1], Mapping) and pair[0] in keys
            for pair in weights
        )
    ):
        what, meant = "is a list of (source, weight) pairs", f"; that is weights={_mapping(weights)}"
    elif isinstance(weights, (list, tuple)) and weights and all(isinstance(m, Mapping) for m in weights):
        what = "is a list of mappings without start positions"
        if len(weights) == 1:
            meant = f"; that is weights={_mapping(weights[0].items())}"
        else:
            first, second = (_mapping(m.items()) for m in weights[:2])
            meant = f"; e.g. weights=[(0, {first}), (1000, {second})] changes to the second at position 1000"
    elif isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        what, meant = f"is of type {type(weights).__name__}", equal
    else:
        return None
    return TypeError(f"weights={_SHORT.repr(weights)} {what}, {_TAKES}{meant}")


def cost_arithmetic(costs: list[list]) -> str:
    """How the schedule computes with these costs, for the identity: fractional float
    costs are scheduled in exact arithmetic since state format 3's schedules computed
    them in floats (a near-tie may break the other way), so a state saved then is
    refused, not resumed onto another schedule; integer costs schedule as they did."""
    fractional = any(isinstance(x, float) and not x.is_integer() for c in costs for x in c)
    return "/exact" if fractional else ""


def check_phases(keys: list, weights: object) -> list[tuple[int, list[float]]]:
    """``weights`` (a mapping, or phases ``[(start, mapping), ...]``) as phases of
    weights in source order."""
    if isinstance(weights, Mapping):
        return [(0, check_weights(keys, weights, "", zero_ok=False))]
    wrong = wrong_weights(keys, weights)
    if wrong is not None:
        raise wrong
    assert isinstance(weights, Sequence)
    if not weights:
        raise OptionError("weights has no phase; give [(0, {source: weight, ...}), ...]")
    phases: list[tuple[int, list[float]]] = []
    for j, phase in enumerate(weights):
        if isinstance(phase, (str, bytes)) or not isinstance(phase, Sequence) or len(phase) != 2:
            raise OptionTypeError(
                f"phase {j} is {_SHORT.repr(phase)}; each phase is a pair (start position, {{source: weight}}): "
                + _USAGE
            )
        start, mapping = phase
        if isinstance(start, bool) or not isinstance(start, int):
            raise OptionTypeError(f"phase {j} starts at {start!r}, not an int position")
        if j == 0 and start != 0:
            raise OptionError(f"phase 0 starts at {start}; the first phase must start at position 0")
        if j and start <= phases[-1][0]:
            raise OptionError(
                f"phase {j} starts at {start}, not after phase {j - 1}'s start {phases[-1][0]}: starts must increase"
            )
        phases.append((start, check_weights(keys, mapping, f"phase {j} (from position {start}): ", zero_ok=True)))
    for i, key in enumerate(keys):
        if not any(weights_[i] for _, weights_ in phases):
            raise OptionError(f"source {key!r} has weight 0 in every phase; drop it instead")
    return phases


def is_sequence(value: object) -> bool:
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, (str, bytes, Mapping))


def check_costs(key: Any, costs: object) -> list:
    if not is_sequence(costs):
        raise OptionTypeError(
            f"the costs of source {key!r} are a {type(costs).__name__}; give a sequence of "
            "per-element costs aligned with the source's positions (e.g. token counts)"
        )
    out = []
    for index in range(len(costs)):  # type: ignore[arg-type]
        value = costs[index]  # type: ignore[index]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise OptionTypeError(f"cost[{key!r}][{index}]={value!r} is not a number")
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
        if not math.isfinite(value) or value < 0:
            raise OptionError(f"cost[{key!r}][{index}]={value!r}; costs must be finite and non-negative")
        out.append(value)
    if out and not any(out):
        raise OptionError(
            f"the costs of source {key!r} are all 0: it would take every position of its phases; "
            "give its elements their costs, or drop it"
        )
    return out


def source_length(source: IterDataPipe) -> int | None:
    plan = plan_pushdown(source, True)
    if plan.sequence is not None:
        return len(plan.sequence)
    try:
        return len(source)
    except TypeError:
        return None


def stored_bytes(key: Any, source: IterDataPipe) -> list[int]:
    sequence = plan_pushdown(source, True).sequence
    sample_bytes = getattr(sequence, "sample_bytes", None)
    if not callable(sample_bytes):
        raise UnsupportedError(
            f"cost='bytes' takes each sample's stored bytes from the index of a distshard file source "
            f"(webdataset, jsonl), but source {key!r} is a {type(source).__name__}"
            f"{'' if sequence is None else ' over ' + type(sequence).__name__}; pass "
            "cost={source: [per-element costs], ...} instead"
        )
    return list(sample_bytes())
