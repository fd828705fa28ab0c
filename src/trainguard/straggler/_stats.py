"""Fixed-size window summaries: median, MAD, p90 and count of one metric, in milliseconds."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["Summary", "median", "summarize"]

# (median_ms, mad_ms, p90_ms, count); NaN medians when count == 0.
Summary = tuple[float, float, float, int]

_NAN = float("nan")


def median(values: Sequence[float]) -> float:
    """Median of ``values`` ignoring NaN (mean of the two middle values); NaN when empty."""
    data = sorted(v for v in values if not math.isnan(v))
    n = len(data)
    if n == 0:
        return _NAN
    mid = n // 2
    return data[mid] if n % 2 else 0.5 * (data[mid - 1] + data[mid])


def summarize(values_ns: Sequence[int | float]) -> Summary:
    """Summarise durations given in nanoseconds as ``(median, MAD, p90, count)`` in ms.

    MAD is the median absolute deviation from the median (unscaled); p90 is the nearest-rank
    90th percentile. Non-finite inputs are dropped and not counted.
    """
    data = sorted([v for v in values_ns if math.isfinite(v)])
    n = len(data)
    if n == 0:
        return (_NAN, _NAN, _NAN, 0)
    mid = n // 2
    med = data[mid] if n % 2 else 0.5 * (data[mid - 1] + data[mid])
    dev = sorted([abs(v - med) for v in data])
    mad = dev[mid] if n % 2 else 0.5 * (dev[mid - 1] + dev[mid])
    p90 = data[min(n - 1, max(0, math.ceil(0.9 * n) - 1))]
    return (med / 1e6, mad / 1e6, p90 / 1e6, n)
