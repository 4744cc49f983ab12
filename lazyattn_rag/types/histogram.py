"""Latency histograms: counts per bucket of observed seconds, in Prometheus' cumulative-ready form."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TIER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Chunk loads and stores of the storage tiers (sub-millisecond host reads to seconds-long Redis)."""
REQUEST_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     10.0, 20.0, 40.0, 80.0, 160.0)
"""Request latencies (TTFT, TPOT, end-to-end, queue): a decode step on a GPU to minutes-long CPU answers."""


@dataclass
class Histogram:
    """Counts of observed seconds per bucket upper bound (``buckets_s``, then +Inf).

    Attributes:
        buckets_s: the upper bounds, increasing.
        counts: observations per bucket (``len(buckets_s) + 1``, +Inf last; not cumulative).
        total_s: the sum of the observed seconds.
    """

    buckets_s: tuple[float, ...] = TIER_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total_s: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.buckets_s) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, seconds)] += 1  # the first bound >= seconds
        self.total_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict:
        """``{"buckets_s": upper bounds, "counts": per bucket (+Inf last), "count", "sum_s"}``."""
        return {"buckets_s": list(self.buckets_s), "counts": list(self.counts), "count": self.count,
                "sum_s": self.total_s}
