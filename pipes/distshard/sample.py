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
from itertools import accumulate
from typing import Any, Iterator, Sequence

from torch.utils.data.datapipes.datapipe import IterDataPipe

from .graph import plan_pushdown
from .plan import mix_seed
from .readers import SequenceReader, stable_digest

__all__ = ["WeightedSampleIterDataPipe", "weighted_sample"]


class WeightedSampleIterDataPipe(IterDataPipe):
    r"""``samples`` weighted draws with replacement (see :func:`distshard.weighted_sample`)."""

    def __init__(self, source: IterDataPipe, weights: Sequence[float], *, samples: int,
                 seed: int | None = None) -> None:
        if not isinstance(source, IterDataPipe):
            raise TypeError(f"source must be an IterDataPipe, got {type(source).__name__}")
        plan = plan_pushdown(source, True)
        if plan.sequence is None:
            raise ValueError(
                f"weighted_sample needs random access to its source, but {type(source).__name__} is a "
                "stream: use IterableWrapper over a list/tensor/distshard.positional(...) or a distshard "
                "file source, with only .map() in between"
            )
        self.source = source
        self._reader = SequenceReader(plan.sequence, plan.copy_elements)
        self._apply = plan.apply if plan.maps else None
        n = self._reader.length()
        weights = list(weights)
        if len(weights) != n:
            raise ValueError(f"weights has {len(weights)} entries but the source has {n} elements; "
                             "give one weight per element")
        for index, weight in enumerate(weights):
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise TypeError(f"weights[{index}]={weight!r} is not a number")
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"weights[{index}]={weight!r} must be finite and non-negative")
        self.cumulative = list(accumulate(float(w) for w in weights))
        if not self.cumulative or self.cumulative[-1] <= 0:
            raise ValueError("the weights sum to 0: at least one element needs a positive weight")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples={samples!r} must be a non-negative int (draws per epoch)")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r} must be None or a non-negative int")
        self.samples, self.seed = samples, seed
        self._epoch = 0
        self._received: int | None = None
        self._digest = stable_digest(weights[:64], len(weights))

    def set_seed(self, seed: int) -> "WeightedSampleIterDataPipe":
        """Called by ``dist_shard`` (or torch's DataLoader) with a seed that is the
        same on every slot."""
        self._received = int(seed)
        return self

    def set_epoch(self, epoch: int) -> "WeightedSampleIterDataPipe":
        self._epoch = int(epoch)
        return self

    def draw_seed(self) -> int:
        """The seed of this epoch's draws, from the seeds as they are now."""
        return mix_seed(self.seed or 0, self._received or 0, self._epoch)

    def draw(self, t: int, seed: int | None = None) -> int:
        """The element index of draw ``t`` (of the draws seeded by ``seed``, by default now's)."""
        base = self.draw_seed() if seed is None else seed
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
    """The epoch's draws as a positional sequence, seeded when created: seeding the
    pipe again (another epoch) changes the views made after, never this one, so
    ``dist_shard(even="carry")`` can read an earlier epoch's draws next to the current's."""

    distshard_blocks = False

    def __init__(self, pipe: WeightedSampleIterDataPipe) -> None:
        self.pipe = pipe
        self._seed = pipe.draw_seed()
        self._identity = (f"weighted:{pipe.samples}:{len(pipe.cumulative)}:{pipe._digest}:"
                          + pipe._reader.identity())

    def __len__(self) -> int:
        return self.pipe.samples

    def __getitem__(self, t: int) -> Any:
        if not 0 <= t < self.pipe.samples:
            raise IndexError(f"draw {t} is outside [0, {self.pipe.samples})")
        element = next(self.pipe._reader.read([self.pipe.draw(t, self._seed)]))
        return self.pipe._apply(element) if self.pipe._apply is not None else element

    def distshard_identity(self) -> str:
        return self._identity

    def describe(self) -> str:
        return self.pipe.describe()


def weighted_sample(source: IterDataPipe, weights: Sequence[float], *, samples: int,
                    seed: int | None = None) -> WeightedSampleIterDataPipe:
    r"""``samples`` draws with replacement from ``source``, element ``i`` with
    probability ``weights[i] / sum(weights)``: a distributed weighted random sampler.

    The draws are a pure function of ``(seed, epoch, draw)``: identical on every
    rank and worker without communication. Put ``.dist_shard()`` after it: every
    draw is delivered by exactly one slot, each slot computes only its own draws,
    and checkpoints resume exactly, also elastically.

    Args:
        source: a random-access source (positional container, distshard file source).
        weights: one non-negative weight per element.
        samples: draws per epoch.
        seed: base seed (``None``: 0, or the seed ``dist_shard`` hands over).

    Example:
        >>> dp = distshard.weighted_sample(IterableWrapper(records), weights, samples=10_000)  # doctest: +SKIP
        >>> dp = dp.dist_shard(even="drop").batch(32)  # doctest: +SKIP
    """
    return WeightedSampleIterDataPipe(source, weights, samples=samples, seed=seed)
