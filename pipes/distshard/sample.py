"""``distshard.weighted_sample``: draws with replacement from one random-access
source by per-element weights: the distributed weighted random sampler.

Draw ``t`` of an epoch picks element ``i`` with probability ``w_i / sum(w)``,
from a uniform number that is a pure function of ``(seed, epoch, t)``: the whole
epoch's draws are identical in every process without any communication, so
``.dist_shard()`` after it hands every draw to exactly one slot (a slot computes
only its own draws), resumes at any draw and resumes elastically. Memory beyond the
weights: O(1) per slot (the cumulative weights are one array).
"""

from __future__ import annotations

import bisect
import math
import numbers
from array import array
from collections.abc import Iterable, Mapping
from itertools import accumulate
from typing import Any, Iterator, Sequence

from torch.utils.data.datapipes.datapipe import IterDataPipe

from .digests import blake2b_hex, mix_seed
from .errors import OptionError, OptionTypeError, UnsupportedError
from .graph import plan_pushdown
from .readers import SequenceReader

__all__ = ["WeightedSampleIterDataPipe", "weighted_sample"]


def _check_weights(weights: object, n: int) -> list[float]:
    """One finite non-negative weight per element, some positive, as floats scaled
    by a power of two so that their sum cannot overflow (the proportions are exact)."""
    if isinstance(weights, Mapping):
        raise OptionTypeError(
            "weights is a mapping; weighted_sample takes one weight per element position, as a sequence "
            "aligned with the source: pass [weights[i] for i in range(len(source))]"
        )
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise OptionTypeError(f"weights must be a sequence of one number per element, got {type(weights).__name__}")
    values = list(weights)
    if len(values) != n:
        raise OptionError(
            f"weights has {len(values)} entries but the source has {n} elements; give one weight per element"
        )
    out = []
    for index, weight in enumerate(values):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise OptionTypeError(f"weights[{index}]={weight!r} is not a number")
        try:
            value = float(weight)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value) or value < 0:
            raise OptionError(f"weights[{index}]={weight!r} must be finite and non-negative")
        out.append(value)
    largest = max(out, default=0.0)
    if largest <= 0:
        raise OptionError("the weights sum to 0: at least one element needs a positive weight")
    shift = math.frexp(largest)[1]  # scaled weights are at most 1: their sum at most n
    return [math.ldexp(value, -shift) for value in out]


class WeightedSampleIterDataPipe(IterDataPipe):
    r"""``samples`` weighted draws with replacement (see :func:`distshard.weighted_sample`)."""

    def __init__(
        self, source: IterDataPipe, weights: Sequence[float], *, samples: int, seed: int | None = None
    ) -> None:
        if not isinstance(source, IterDataPipe):
            raise OptionTypeError(f"source must be an IterDataPipe, got {type(source).__name__}")
        if isinstance(samples, bool) or not isinstance(samples, int):
            raise OptionTypeError(f"samples={samples!r} must be an int (draws per epoch), got {type(samples).__name__}")
        if samples < 0:
            raise OptionError(f"samples={samples} must be non-negative (draws per epoch)")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise OptionTypeError(f"seed={seed!r} must be None or an int, got {type(seed).__name__}")
        if seed is not None and seed < 0:
            raise OptionError(f"seed={seed} must be non-negative")
        plan = plan_pushdown(source, True)
        if plan.sequence is None:
            raise UnsupportedError(
                f"weighted_sample needs random access to its source, but {type(source).__name__} is a "
                "stream: use IterableWrapper over a list/tensor/distshard.positional(...) or a distshard "
                "file source, with only .map() in between"
            )
        self.source = source
        self._reader = SequenceReader(plan.sequence, plan.copy_elements)
        self._apply = plan.apply if plan.maps else None
        scaled = _check_weights(weights, self._reader.length())
        self.cumulative = list(accumulate(scaled))
        self.samples, self.seed = samples, seed
        self._epoch = 0
        self._received: int | None = None
        # every weight enters the identity (exactly: the scaled floats' bytes)
        weights_digest = blake2b_hex(array("d", scaled).tobytes(), 8)
        self._identity = f"weighted_sample seed={seed or 0} samples={samples} n={len(scaled)} weights={weights_digest}"

    def distshard_identity(self) -> str:
        return self._identity

    def set_seed(self, seed: int) -> "WeightedSampleIterDataPipe":
        """Called by ``dist_shard`` (or torch's DataLoader, or a ``mix`` for each pass)
        with a seed that is the same on every slot."""
        self._received = int(seed)
        return self

    def set_epoch(self, epoch: int) -> "WeightedSampleIterDataPipe":
        self._epoch = int(epoch)
        return self

    def draw(self, t: int, received: int | None = None) -> int:
        """The element index of draw ``t``: a pure function of ``(seed, received,
        epoch, t)``, ``received`` being the last value given to ``set_seed`` unless given."""
        if received is None:
            received = self._received
        base = mix_seed(self.seed or 0, received or 0, self._epoch)
        u = mix_seed(base, t) / float(1 << 63)  # uniform in [0, 1)
        index = bisect.bisect_right(self.cumulative, u * self.cumulative[-1])
        return min(index, len(self.cumulative) - 1)

    def __len__(self) -> int:
        return self.samples

    def __distshard_sequence__(self) -> "_Draws":
        return _Draws(self)

    def __iter__(self) -> Iterator[Any]:
        draws = _Draws(self)
        for t in range(self.samples):
            yield draws[t]

    def describe(self) -> str:
        return f"{self.samples} weighted draws with replacement from {len(self.cumulative)} elements"


class _Draws:
    """The epoch's draws as a positional sequence (seeded by the pipe's seeds at
    each access; :meth:`element` reads them for another ``received`` seed)."""

    distshard_blocks = False

    def __init__(self, pipe: WeightedSampleIterDataPipe) -> None:
        self.pipe = pipe
        self._identity = f"{pipe.distshard_identity()} source={pipe._reader.identity()}"

    def __len__(self) -> int:
        return self.pipe.samples

    def __getitem__(self, t: int) -> Any:
        return self.element(t, None)

    def element(self, t: int, received: int | None) -> Any:
        """Draw ``t`` when the pipe was handed ``received`` by ``set_seed`` (``None``:
        what it holds now)."""
        if not 0 <= t < self.pipe.samples:
            raise IndexError(f"draw {t} is outside [0, {self.pipe.samples})")
        element = next(self.pipe._reader.read([self.pipe.draw(t, received)]))
        return self.pipe._apply(element) if self.pipe._apply is not None else element

    def distshard_identity(self) -> str:
        return self._identity

    def describe(self) -> str:
        return self.pipe.describe()


def weighted_sample(
    source: IterDataPipe, weights: Sequence[float], *, samples: int, seed: int | None = None
) -> WeightedSampleIterDataPipe:
    r"""``samples`` draws with replacement from ``source``, element ``i`` with
    probability ``weights[i] / sum(weights)``: a distributed weighted random sampler.

    The draws are a pure function of ``(seed, epoch, draw)``: identical on every
    rank and worker without communication. Put ``.dist_shard()`` after it: every
    draw is delivered by exactly one slot, each slot computes only its own draws,
    and checkpoints resume exactly, also elastically.

    Args:
        source: a random-access source (positional container, distshard file source).
        weights: one non-negative weight per element, as a sequence aligned with the
            source's positions (a mapping is refused: it is not positional).
        samples: draws per epoch.
        seed: base seed (``None``: 0), mixed with the seed ``dist_shard`` hands over.

    Example:
        >>> dp = distshard.weighted_sample(IterableWrapper(records), weights, samples=10_000)  # doctest: +SKIP
        >>> dp = dp.dist_shard(even="drop").batch(32)  # doctest: +SKIP
    """
    return WeightedSampleIterDataPipe(source, weights, samples=samples, seed=seed)
