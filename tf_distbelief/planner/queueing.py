"""Where the workers' exchanges meet at the ps NICs: the planner's queueing.

`cost_model.predict` adds to a worker's step the time its transfers wait
for the other workers' at the ps NICs (`step_parts`, which also stretches
the step's compute where the workers share a host's cores, `host`). A
direction of one ps NIC carries `k` flows at a worker's full rate and
shares its rate fairly; a transfer of `t` seconds that another worker's
overlaps for a share `p` of its time takes `t * max(1, (1 + (W - 1) p) /
k)`. At independent times `p = t / T` (`T` the step); right after a join of
the coordinator every worker starts together (`p = 1`), and the fair NIC
keeps them so: only the variation of their step times
(`Cluster.step_jitter_secs`) moves them apart, a random walk. No TensorFlow.

`k = num_ps * ps_rate / worker_rate` (a worker's transfer is spread over the
ps tasks), and with `m = (W - 1) * t / T` the step is `T = a + sum over the
two directions of t * max(0, (1 + m) / k - 1)`, `a` compute plus transfer
(mean-field processor sharing). This holds for exchanges every step (stock,
`n_fetch` or `n_push` 1) too: a NIC that shares its rate fairly (small
packets first, as a host's flow queueing sends them) keeps the offset
between two workers' transfers as it is, so nothing locks them into
alternation, one worker's fetch beside another's push (measured: stock
behind 1 Gbit/s NICs, 2 workers, ran at 228 to 235 ex/s, where alternation
would allow 313 and this term gives 253).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from tf_distbelief.planner import records

__all__ = ["MAX_TRACKED_EXCHANGES", "bits_per_sec", "step_parts"]

# Exchanges of a join interval whose offsets `step_parts` follows; the later
# ones are taken as independent.
MAX_TRACKED_EXCHANGES = 4096


def bits_per_sec(value: float | None) -> float:
    """A NIC's rate in bits/s; None (unlimited) is infinite."""
    return math.inf if value is None else float(value)


def step_parts(
    c: records.Cluster,
    setting: records.Setting,
    traffic: records.Traffic,
    worker_rate: float,
    compute_at: Callable[[float], float] | None = None,
) -> tuple[float, float]:
    """A worker's compute per step and its wait behind the others' transfers.

    See the module docstring: `T = x + a + sum_d t_d * mean_j max(0, (1 +
    (W - 1) p_dj) / k - 1)` with `x` the step's compute, `a` its own transfer
    time, `k` the flows a ps NIC direction carries at a worker's full rate
    and `p_dj` the share of a transfer of direction `d` that another worker's
    overlaps at exchange `j` of a join interval (`_overlaps`; `t_d / T`
    without joins); solved by bisection (the right side falls as `T` grows).

    Args:
      c: the cluster.
      setting: stock or Downpour.
      traffic: the step's bytes.
      worker_rate: a worker's transfer rate, bits/s.
      compute_at: the compute as a function of `T` (`host.compute_at`: the
        workers share the host's cores), non-increasing; None:
        `c.compute_secs` whatever `T`.

    Returns:
      `(compute_secs, queue_secs)` at the solved step, seconds; the wait is
      0 for one worker or unlimited ps NICs.
    """
    own = [
        8 * nbytes / worker_rate  # This worker's transfer, seconds a step.
        for nbytes in (traffic.to_worker_bytes, traffic.to_ps_bytes)
    ]
    ps_rate = bits_per_sec(c.ps_bits_per_sec)
    queues = not (c.num_workers == 1 or math.isinf(ps_rate))
    if queues:
        slots = c.num_ps * ps_rate / worker_rate  # >= 1: worker_rate is the min.
        others = c.num_workers - 1
        segment = 1.0 / setting.exchanges_per_step  # Steps per exchange.
        directions = [(t, _Interval(*_overlaps(c, segment, t))) for t in own]

    def wait(step_secs: float) -> float:
        if not queues:
            return 0.0
        return sum(
            t * interval.mean_wait(t / step_secs, others, slots)
            for t, interval in directions
        )

    if compute_at is None:
        a = c.compute_secs + sum(own)
        if not queues or a == 0:
            return c.compute_secs, 0.0
        low, high = a, a + wait(a)  # wait(T) <= wait(a) for T >= a.
        for _ in range(64):
            mid = (low + high) / 2
            if mid - a - wait(mid) < 0:
                low = mid
            else:
                high = mid
        return c.compute_secs, high - a

    def excess(step_secs: float) -> float:  # Increasing in T.
        return step_secs - compute_at(step_secs) - sum(own) - wait(step_secs)

    low = compute_at(math.inf) + sum(own)  # The step without contention.
    if low == 0:
        return 0.0, 0.0
    high = 2 * low
    while excess(high) < 0:
        low, high = high, 2 * high
    for _ in range(64):
        mid = (low + high) / 2
        if excess(mid) < 0:
            low = mid
        else:
            high = mid
    compute = compute_at(high)
    return compute, max(0.0, high - compute - sum(own))


class _Interval:
    """One direction's exchanges of a join interval, for `mean_wait`.

    Args:
      weights, overlaps: per tracked exchange (`_overlaps`).
      untracked: the share of exchanges at independent times.
    """

    def __init__(self, weights: list, overlaps: list, untracked: float):
        pairs = sorted(zip(overlaps, weights), reverse=True)
        self._negated = [-p for p, _ in pairs]  # Ascending, for `bisect`.
        self._weights, self._weighted = [0.0], [0.0]  # Prefix sums: w, w * p.
        for p, w in pairs:
            self._weights.append(self._weights[-1] + w)
            self._weighted.append(self._weighted[-1] + w * p)
        self._untracked = untracked

    def mean_wait(self, spread: float, others: int, slots: float) -> float:
        """The mean over the exchanges of `max(0, (1 + others * max(spread,
        p)) / slots - 1)`, in transfers' time: exchanges overlapped for less
        than `spread` (the independent share) count as `spread`; the others
        wait only above `p* = (slots - 1) / others`, where the wait is linear
        in `p` (prefix sums: O(log n) a call, for the bisection)."""

        def above(x: float) -> int:  # Tracked exchanges with p > x.
            return bisect.bisect_left(self._negated, -x)

        def waits(p: float) -> float:
            return max(0.0, (1 + others * p) / slots - 1)

        k, m = above(spread), above(max(spread, (slots - 1) / others))
        linear = (
            self._weights[m] * (1 / slots - 1) + (others / slots) * self._weighted[m]
        )
        rest = self._weights[-1] - self._weights[k] + self._untracked
        return linear + rest * waits(spread)


def _overlaps(c: records.Cluster, segment: float, transfer_secs: float):
    """`(weights, overlaps, untracked)` of the exchanges of a join interval.

    Exchange `j` (weight its share of the interval's exchanges: `J / s` of
    them, `s` steps each, the last one partial) overlaps another worker's
    for `E[max(0, 1 - |d| / t)]` of its `t` seconds, `d ~ N(0, 2 j s
    sigma^2)` (`Cluster.step_jitter_secs`; None: 1 for `j = 0`, then
    independent). `untracked`: the share taken as independent (all of it
    without joins).
    """
    joins, sigma = c.steps_between_joins, c.step_jitter_secs
    if joins is None or transfer_secs == 0:
        return [], [], 1.0
    count = max(1.0, joins / segment)  # Exchanges per interval.
    weights, overlaps = [], []
    j = 0
    while j < min(count, MAX_TRACKED_EXCHANGES) and (sigma is not None or j == 0):
        weights.append(min(1.0, count - j) / count)
        spread = 0.0 if sigma is None else sigma * math.sqrt(2 * j * segment)
        overlap = _mean_overlap(transfer_secs, spread)
        if overlaps and overlap == overlaps[-1]:  # In step still (sigma 0).
            weight = weights.pop()
            weights[-1] += weight
        else:
            overlaps.append(overlap)
        j += 1
    return weights, overlaps, 1.0 - sum(weights)


def _mean_overlap(t: float, sd: float) -> float:
    """`E[max(0, 1 - |d| / t)]` for `d ~ N(0, sd^2)`."""
    if sd == 0:
        return 1.0
    x = t / sd
    density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    return math.erf(x / math.sqrt(2)) - (2 / x) * (1 / math.sqrt(2 * math.pi) - density)
