"""Downpour's figures in words, for the console.

Two lines carry them: each epoch's line ends with the epoch's figures
(`epoch_words`: `staleness 0.40, fetched 19.2 kB/step, pushed 19.2 kB/step`)
and the run ends with one line over all replicas (`summary_line`). Every
figure is also a TensorBoard scalar (`DownpourMetrics`, `fit.progress`); the
console keeps what a person reads at a glance. No TensorFlow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tf_distbelief import console
from tf_distbelief.downpour.schedule import ReplicaStats

# The epoch figures of `keras.interval_figures`, by name.
_REPLICA_FIGURE = re.compile(r"^replica(\d+)/(steps|staleness)$")
_TOTALS = ("bytes_fetched_per_step", "bytes_pushed_per_step", "nonfinite_pushes")


def epoch_words(logs: Mapping[str, float]) -> tuple[str, dict]:
    """Downpour's figures among an epoch's `logs`, in words, and the other logs.

    Args:
      logs: an epoch's logs, with the figures `DownpourMetrics` added
        (`replica{i}/steps`, `replica{i}/staleness`, `bytes_fetched_per_step`,
        `bytes_pushed_per_step`, `nonfinite_pushes`).

    Returns:
      `("staleness 0.40, fetched 19.2 kB/step, pushed 19.2 kB/step", rest)`:
      the staleness is the replicas' mean weighted by their steps (the mean
      over pushes when each replica pushes every `n_push` steps); `N
      non-finite pushes dropped` is added when N > 0. `""` when `logs` holds
      none of the figures. `rest` is `logs` without them (the model's loss
      and metrics).
    """
    rest, replicas = {}, {}
    for key, value in logs.items():
        match = _REPLICA_FIGURE.match(key)
        if match:
            replicas.setdefault(int(match.group(1)), {})[match.group(2)] = value
        elif key not in _TOTALS:
            rest[key] = value
    words = []
    steps = sum(r.get("steps", 0) for r in replicas.values())
    if steps:
        stale = sum(
            r.get("steps", 0) * r.get("staleness", 0) for r in replicas.values()
        )
        words.append(f"staleness {stale / steps:.2f}")
    for key, verb in (
        ("bytes_fetched_per_step", "fetched"),
        ("bytes_pushed_per_step", "pushed"),
    ):
        if key in logs:
            words.append(f"{verb} {console.size(logs[key])}/step")
    if logs.get("nonfinite_pushes"):
        words.append(
            f"{console.count(logs['nonfinite_pushes'])} non-finite pushes dropped"
        )
    return ", ".join(words), rest


def summary_line(stats: Sequence[ReplicaStats]) -> str:
    """The run's Downpour figures over all replicas, in one line.

    Args:
      stats: each replica's counters (`Downpour.stats()`).

    Returns:
      `downpour: 2 replicas, 1,000 steps (500, 500), 250 pushes (125, 125),
      250 fetches, staleness mean 0.40 max 2, fetched 9.6 MB, pushed 9.6 MB`:
      the per-replica steps and pushes in parentheses; pushes dropped for
      staleness or a NaN or inf are added when there are any; no staleness
      before a push. For no replica (a worker lost and not rejoined), says so.
    """
    if not stats:
        return "downpour: no counters (a worker lost during training has not rejoined)"
    total = ReplicaStats(
        **{
            field: sum(getattr(s, field) for s in stats)
            for field in ReplicaStats.__dataclass_fields__
        }
    )

    def each(field):
        return ", ".join(console.count(getattr(s, field)) for s in stats)

    parts = [
        f"{len(stats)} replica{'s' if len(stats) > 1 else ''}",
        f"{console.count(total.steps)} steps ({each('steps')})",
        f"{console.count(total.pushes)} pushes ({each('pushes')})",
        f"{console.count(total.fetches)} fetches",
    ]
    if total.dropped_pushes:
        parts.append(f"{console.count(total.dropped_pushes)} stale pushes dropped")
    if total.nonfinite_pushes:
        parts.append(
            f"{console.count(total.nonfinite_pushes)} non-finite pushes dropped"
        )
    judged = total.pushes + total.dropped_pushes
    if judged:
        most = max(s.max_staleness_seen for s in stats)
        parts.append(f"staleness mean {total.staleness_sum / judged:.2f} max {most}")
    parts.append(f"fetched {console.size(total.bytes_fetched)}")
    parts.append(f"pushed {console.size(total.bytes_pushed)}")
    return "downpour: " + ", ".join(parts)
