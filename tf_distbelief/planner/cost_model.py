"""A cost model of parameter-server training: where the network is the limit.

Dean et al. 2012, section 4.1: Downpour SGD fetches the parameters every
`n_fetch` steps and pushes every `n_push`, trading staleness for bandwidth.
This model predicts examples per second of stock parameter-server training
and of each Downpour setting from the bytes a step moves, the NIC rates, the
numbers of workers and ps tasks, a step's compute time and the chief's cost
per scheduled function. No TensorFlow.

The bound (each resource alone, the slowest one wins):

* **workers**: `W * batch / (compute_secs + transfer_secs + queue_secs)`: a
  worker does not overlap its compute with its own transfers (stock reads the
  parameters, computes, sends the gradient; Downpour fetches, runs its local
  steps, pushes), at `min(worker NIC, num_ps * ps NIC)`. Named `worker CPU`
  when compute is the larger part, else `worker NIC`, or `ps NIC queueing` when the
  queueing is larger than the transfer.
* **queueing at the ps NICs** (`queueing.step_parts`, which holds the
  rule and its reasons): the workers' exchanges fall at independent times,
  so a worker's fetch or push may share a ps NIC's direction with other
  workers' transfers, and waits.
* **a shared host** (`Cluster.host_cores`, `host`): in a local emulation
  the workers' compute shares the host's cores and stretches (`host cores`
  when that is the larger part of the step); default: a host per worker.
* **joins** (`Cluster.steps_between_joins`): all workers start together
  after a join, so the first exchange of each interval meets all the others
  at the ps NIC. The fair NIC keeps them together; only the variation of
  their step times (`Cluster.step_jitter_secs`) moves them apart, a random
  walk, so behind a slow NIC (transfers long against that variation) they
  stay in step for the whole interval (the attributes say how).

Bytes per step, `M` the model's float32 bytes: stock moves `M` in and `M`
out. Downpour fetches `M` every `n_fetch` steps and pushes every `n_push`:
`2M` with the AdaGrad accumulator mode `squares` and `n_push > 1` (gradient
sums and squared sums), `M` with the outer rule (the parameter delta) or
otherwise; a compressed push what its push rules code, and with the outer
rule its fetches the update stream (`push_bytes`). Each exchange with the
ps (every step, or every segment of `min(n_fetch, n_push)` steps when both
exceed 1) adds `overhead_bytes` each way per ps. Not modelled: latency, CPU
spent on serialization (the bound is optimistic where two resources are
close).

Example:
  ```
  cluster = Cluster(num_params=42_000_000, num_workers=200, num_ps=8,
                    worker_bits_per_sec=10**10, ps_bits_per_sec=10**10,
                    compute_secs=0.1)
  predict(cluster, Setting.parse("n=16+outer")).examples_per_sec
  ```
"""

from __future__ import annotations

import dataclasses
import math
import re

from tf_distbelief import checks
from tf_distbelief.planner import host, push_bytes, queueing, records

__all__ = [
    "Prediction",
    "chief_steps_per_execution",
    "compute_only_rate",
    "parse_count",
    "plan",
    "predict",
    "smallest_n",
    "smallest_ps",
    "standard_settings",
    "step_traffic",
]

# The planner's rows: n = n_fetch = n_push.
STANDARD_NS = (1, 4, 16, 64)
_SEARCH_NS = tuple(2**k for k in range(11))  # 1 ... 1024.
_MAX_PS = 4096
_COUNT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}

WORKER_CPU = "worker CPU"
WORKER_NIC = "worker NIC"
PS_NIC = "ps NIC"
PS_QUEUE = "ps NIC queueing"
CHIEF = "chief scheduling"
HOST = "host cores"


def parse_count(value, name: str = "params") -> int:
    """An int from `"42M"`, `"2.4m"`, `"500k"`, `"1G"` or a positive int.

    Raises:
      ValueError: naming `name` and the value.
    """
    count = None
    if checks.is_int(value):
        count = int(value)
    elif isinstance(value, str):
        match = _COUNT_RE.match(value)
        if match:
            count = round(float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()])
    if count is None or count < 1:
        raise checks.argument_error(
            name, "a positive count such as 42M, 2.4M or 500k", value
        )
    return count


def standard_settings(accumulator: str = "squares") -> list[records.Setting]:
    """Stock, then n = 1, 4, 16, 64 without and (n > 1) with the outer rule."""
    rows = [records.Setting(accumulator=accumulator)]
    for n in STANDARD_NS:
        rows.append(records.Setting(n, n, False, accumulator))
        if n > 1:
            rows.append(records.Setting(n, n, True, accumulator))
    return rows


def step_traffic(
    setting: records.Setting,
    num_params: int,
    num_ps: int = 1,
    overhead_bytes: float = records.DEFAULT_OVERHEAD_BYTES,
    num_workers: int = 1,
) -> records.Traffic:
    """The bytes a worker step moves, each way (see the module docstring).

    Args:
      setting: stock or Downpour.
      num_params: trainable parameters (float32).
      num_ps: ps tasks, each paying `overhead_bytes` per exchange.
      overhead_bytes: fixed bytes per exchange per ps, each way.
      num_workers: model replicas: a compressed setting with the outer rule
        fetches every replica's pushes (`push_bytes`).

    Returns:
      The step's `Traffic`.
    """
    checks.check_int("num_params", num_params, 1)
    checks.check_int("num_ps", num_ps, 1)
    checks.check_int("num_workers", num_workers, 1)
    checks.check_nonnegative("overhead_bytes", overhead_bytes)
    model_bytes = num_params * records.BYTES_PER_PARAM
    fixed = overhead_bytes * num_ps * setting.exchanges_per_step
    if setting.n_fetch is None:
        return records.Traffic(model_bytes + fixed, model_bytes + fixed)
    fetched = model_bytes / setting.n_fetch
    pushed = setting.push_copies * model_bytes / setting.n_push
    if setting.compressed:
        one_push = push_bytes.push_bytes(setting, num_params)
        pushed = one_push / setting.n_push
        if setting.outer:
            fetched = push_bytes.stream_fetch_bytes(setting, one_push, num_workers)
    return records.Traffic(fetched + fixed, pushed + fixed)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What `predict` finds for one setting.

    Attributes:
      setting: the setting.
      examples_per_sec: the bound, all workers together.
      bottleneck: the resource that sets it: `"worker CPU"`, `"host cores"`
        (the workers' bound, mostly compute slowed by the other workers' on
        their shared host), `"worker NIC"`, `"ps NIC queueing"` (the
        workers' bound, mostly waiting for other workers' transfers), `"ps
        NIC"` or `"chief scheduling"`.
      bounds: examples/s each resource allows (`"workers"`, `"ps NIC"`,
        `"chief scheduling"`); inf where unlimited.
      traffic: the bytes of one worker step.
      transfer_secs: one worker's own transfer time per step.
      queue_secs: one worker's wait per step for the other workers'
        transfers at the ps NICs.
      compute_secs: one worker's compute per step: `Cluster.compute_secs`,
        or on a shared host (`Cluster.host_cores`) as the others' compute
        stretches it (`host`).
    """

    setting: records.Setting
    examples_per_sec: float
    bottleneck: str
    bounds: dict
    traffic: records.Traffic
    transfer_secs: float
    queue_secs: float = 0.0
    compute_secs: float = 0.0


def predict(cluster: records.Cluster, setting: records.Setting) -> Prediction:
    """Examples/s of `setting` on `cluster`: the smallest bound of the resources.

    Args:
      cluster: the cluster, model and step cost.
      setting: stock or Downpour.

    Returns:
      The `Prediction`; ties go to the workers, then the ps NIC.
    """
    c = cluster
    traffic = step_traffic(
        setting, c.num_params, c.num_ps, c.overhead_bytes, c.num_workers
    )
    worker_rate = min(
        queueing.bits_per_sec(c.worker_bits_per_sec),
        c.num_ps * queueing.bits_per_sec(c.ps_bits_per_sec),
    )
    transfer_secs = 8 * traffic.total_bytes / worker_rate
    compute_secs, queue_secs = queueing.step_parts(
        c, setting, traffic, worker_rate, host.compute_at(c)
    )
    step_secs = compute_secs + transfer_secs + queue_secs
    workers = math.inf if step_secs == 0 else c.num_workers * c.batch_size / step_secs
    # One ps's share of the larger direction per example, in bits.
    per_ps_bits = 8 * max(traffic.to_worker_bytes, traffic.to_ps_bytes) / c.num_ps
    ps = (
        math.inf
        if per_ps_bits == 0
        else queueing.bits_per_sec(c.ps_bits_per_sec) * c.batch_size / per_ps_bits
    )
    chief = (
        math.inf
        if c.function_secs == 0
        else c.steps_per_execution * c.batch_size / c.function_secs
    )
    bounds = {"workers": workers, PS_NIC: ps, CHIEF: chief}
    best = min(bounds, key=lambda k: bounds[k])  # First of equals: workers.
    bottleneck = best
    if best == "workers":
        if compute_secs >= transfer_secs + queue_secs:
            # Stretched by the other workers' compute on a shared host.
            bottleneck = HOST if compute_secs > host.alone_secs(c) else WORKER_CPU
        else:
            bottleneck = WORKER_NIC if transfer_secs >= queue_secs else PS_QUEUE
    return Prediction(
        setting,
        bounds[best],
        bottleneck,
        bounds,
        traffic,
        transfer_secs,
        queue_secs,
        compute_secs,
    )


def compute_only_rate(cluster: records.Cluster) -> float:
    """Examples/s of the workers' compute alone (no transfer), all together.

    Args:
      cluster: the cluster.

    Returns:
      `num_workers * batch / compute_secs` with a host per worker; on a
      shared host (`host_cores`) what the workers compute there together
      (`host`); inf without a compute time.
    """
    if cluster.compute_secs == 0:
        return math.inf
    if cluster.host_cores is None:
        return cluster.num_workers * cluster.batch_size / cluster.compute_secs
    unlimited = cluster.replace(worker_bits_per_sec=None, ps_bits_per_sec=None)
    return predict(unlimited, records.Setting()).bounds["workers"]


def _busy(
    cluster: records.Cluster, setting: records.Setting, busy_fraction: float
) -> bool:
    """The network keeps the workers at `busy_fraction` of their compute rate.

    Both the workers' bound (compute plus their own transfers) and the ps
    NIC's are at least `busy_fraction * compute_only_rate`; the chief is
    left out (`chief_steps_per_execution` sizes it).
    """
    if cluster.compute_secs == 0:
        return False
    limit = compute_only_rate(cluster)
    bounds = predict(cluster, setting).bounds
    return min(bounds["workers"], bounds[PS_NIC]) >= busy_fraction * limit


def chief_steps_per_execution(cluster: records.Cluster) -> int | None:
    """The fewest steps per scheduled function with which the chief keeps up
    with the workers' compute-only rate (`compute_only_rate` over the batch,
    steps/s, at `function_secs` each); None without a compute time."""
    if cluster.compute_secs == 0:
        return None
    steps_per_sec = compute_only_rate(cluster) / cluster.batch_size
    return max(1, math.ceil(steps_per_sec * cluster.function_secs - 1e-9))


def _check_fraction(busy_fraction) -> None:
    if not (checks.is_number(busy_fraction) and 0 < busy_fraction <= 1):
        raise checks.argument_error("busy_fraction", "in (0, 1]", busy_fraction)


def smallest_ps(
    cluster: records.Cluster,
    setting: records.Setting,
    busy_fraction: float = 0.9,
    max_ps: int = _MAX_PS,
) -> int | None:
    """The fewest ps tasks that keep the workers busy, or None.

    Busy: the workers' bound (compute and their own transfers) and the ps
    NIC's are at least `busy_fraction` of what the workers' compute alone
    allows (`num_workers * batch / compute_secs`); the chief is not counted.

    Args:
      cluster: the cluster; its `num_ps` is replaced.
      setting: stock or Downpour.
      busy_fraction: in (0, 1].
      max_ps: the largest count tried.

    Returns:
      The smallest `num_ps` in `[1, max_ps]`, or None when none is enough
      (the worker NIC is the limit).
    """
    _check_fraction(busy_fraction)
    checks.check_int("max_ps", max_ps, 1)
    # No count does better than one ps of unlimited NIC (no ps NIC bound, no
    # queueing, the least overhead): if that is not busy, none is.
    if not _busy(
        cluster.replace(num_ps=1, ps_bits_per_sec=None), setting, busy_fraction
    ):
        return None
    for count in range(1, max_ps + 1):
        if _busy(cluster.replace(num_ps=count), setting, busy_fraction):
            return count
    return None


def smallest_n(
    cluster: records.Cluster,
    outer: bool = False,
    accumulator: str = "squares",
    busy_fraction: float = 0.9,
) -> int | None:
    """The smallest n = n_fetch = n_push (a power of 2, <= 1024) keeping the
    workers busy at the cluster's own `num_ps`, or None."""
    _check_fraction(busy_fraction)
    for n in _SEARCH_NS:
        if _busy(cluster, records.Setting(n, n, outer, accumulator), busy_fraction):
            return n
    return None


def plan(
    cluster: records.Cluster,
    outer: bool = False,
    accumulator: str = "squares",
    busy_fraction: float = 0.9,
    max_ps: int = _MAX_PS,
) -> tuple[int, int] | None:
    """`(n_push, num_ps)`: the smallest n, then the fewest ps, keeping the
    workers busy (n = n_fetch = n_push, powers of 2 up to 1024); None if
    none does (the worker NIC is the limit)."""
    for n in _SEARCH_NS:
        setting = records.Setting(n, n, outer, accumulator)
        count = smallest_ps(cluster, setting, busy_fraction, max_ps)
        if count is not None:
            return n, count
    return None
