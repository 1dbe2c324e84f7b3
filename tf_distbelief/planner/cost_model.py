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
* **queueing at the ps NICs** (`queueing.queue_secs`): the workers' exchanges fall at
  independent times, so a worker's fetch or push may share a ps NIC's
  direction with other workers' transfers. A direction of one ps NIC carries
  `k = num_ps * ps_rate / worker_rate` flows at a worker's full rate (a
  worker's transfer is spread over the ps tasks); mean-field processor
  sharing: with `m = (W - 1) * t / T` other workers' transfers expected
  beside one of `t` seconds (`T` the step time), it takes `t * max(1, (1 +
  m) / k)`. `T = a + sum over the two directions of t * max(0, (1 + m) / k -
  1)`, `a` compute plus transfer. This holds for exchanges every step
  (stock, `n_fetch` or `n_push` 1) too: a NIC that shares its rate fairly
  (small packets first, as a host's flow queueing sends them) keeps the
  offset between two workers' transfers as it is, so nothing locks them
  into alternation, one worker's fetch beside another's push (measured:
  stock behind 1 Gbit/s NICs, 2 workers, ran at 228 to 235 ex/s, where
  alternation would allow 313 and this term gives 253).
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
otherwise. Each exchange with the ps (every step, or every segment of
`min(n_fetch, n_push)` steps when both exceed 1) adds `overhead_bytes` each
way per ps. Not modelled: latency, CPU spent on serialization (the bound
is optimistic where two resources are close).

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
from tf_distbelief.planner import queueing

__all__ = [
    "ACCUMULATORS",
    "BYTES_PER_PARAM",
    "Cluster",
    "Prediction",
    "Setting",
    "Traffic",
    "chief_steps_per_execution",
    "parse_count",
    "plan",
    "predict",
    "smallest_n",
    "smallest_ps",
    "standard_settings",
    "step_traffic",
]

BYTES_PER_PARAM = 4  # float32.
# `DownpourConfig.adagrad_accumulator`: only "squares" pushes a second copy.
ACCUMULATORS = ("squares", "mean", "sum")
# Fixed bytes of one exchange with one ps, each way (step ids, loop control,
# gRPC framing), measured on the speech model's sockets.
DEFAULT_OVERHEAD_BYTES = 2048
# tf_keras's chief CPU per scheduled function, measured on 2 cores.
DEFAULT_FUNCTION_SECS = 0.010
DEFAULT_STEPS_PER_EXECUTION = 10
DEFAULT_BATCH_SIZE = 32
# The planner's rows: n = n_fetch = n_push.
STANDARD_NS = (1, 4, 16, 64)
_SEARCH_NS = tuple(2**k for k in range(11))  # 1 ... 1024.
_MAX_PS = 4096
_COUNT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_SETTING_RE = re.compile(r"^n=(\d+)(\+outer)?$")

WORKER_CPU = "worker CPU"
WORKER_NIC = "worker NIC"
PS_NIC = "ps NIC"
PS_QUEUE = "ps NIC queueing"
CHIEF = "chief scheduling"


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


@dataclasses.dataclass(frozen=True)
class Setting:
    """Stock training (`n_fetch` None) or a Downpour setting.

    Attributes:
      n_fetch: steps between fetches; None: stock parameter-server training.
      n_push: steps between pushes; None with `n_fetch`.
      outer: the outer Nesterov rule (a push is the parameter delta).
      accumulator: `DownpourConfig.adagrad_accumulator`.
    """

    n_fetch: int | None = None
    n_push: int | None = None
    outer: bool = False
    accumulator: str = "squares"

    def __post_init__(self):
        if (self.n_fetch is None) != (self.n_push is None):
            raise ValueError(
                "Arguments `n_fetch` and `n_push` are both None (stock) or both "
                f"set. Received: n_fetch={self.n_fetch!r}, n_push={self.n_push!r}"
            )
        if self.n_fetch is not None:
            checks.check_int("n_fetch", self.n_fetch, 1)
            checks.check_int("n_push", self.n_push, 1)
        elif self.outer:
            raise ValueError("Argument `outer` needs Downpour (n_fetch, n_push).")
        if self.accumulator not in ACCUMULATORS:
            raise checks.argument_error(
                "accumulator", f"one of {ACCUMULATORS}", self.accumulator
            )

    @classmethod
    def parse(cls, name: str, accumulator: str = "squares") -> Setting:
        """`"stock"`, `"n=16"` or `"n=16+outer"` (n = n_fetch = n_push)."""
        if name == "stock":
            return cls(accumulator=accumulator)
        match = _SETTING_RE.match(str(name))
        if not match or int(match.group(1)) < 1:
            raise checks.argument_error("name", "stock, n=<n> or n=<n>+outer", name)
        n = int(match.group(1))
        return cls(n, n, bool(match.group(2)), accumulator)

    @property
    def name(self) -> str:
        if self.n_fetch is None:
            return "stock"
        if self.n_fetch == self.n_push:
            base = f"n={self.n_fetch}"
        else:
            base = f"fetch={self.n_fetch},push={self.n_push}"
        return base + ("+outer" if self.outer else "")

    @property
    def push_copies(self) -> int:
        """Model copies in one push: 2 with pushed squares, else 1."""
        if self.n_fetch is None or self.outer:
            return 1
        return 2 if self.accumulator == "squares" and self.n_push > 1 else 1

    @property
    def exchanges_per_step(self) -> float:
        """Exchanges with every ps per step: 1, or 1 per segment."""
        if self.n_fetch is None or min(self.n_fetch, self.n_push) == 1:
            return 1.0
        return 1.0 / min(self.n_fetch, self.n_push)


def standard_settings(accumulator: str = "squares") -> list[Setting]:
    """Stock, then n = 1, 4, 16, 64 without and (n > 1) with the outer rule."""
    rows = [Setting(accumulator=accumulator)]
    for n in STANDARD_NS:
        rows.append(Setting(n, n, False, accumulator))
        if n > 1:
            rows.append(Setting(n, n, True, accumulator))
    return rows


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one worker step moves on average, summed over the ps tasks.

    Attributes:
      to_worker_bytes: fetched (ps to worker).
      to_ps_bytes: pushed (worker to ps).
    """

    to_worker_bytes: float
    to_ps_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.to_worker_bytes + self.to_ps_bytes


def step_traffic(
    setting: Setting,
    num_params: int,
    num_ps: int = 1,
    overhead_bytes: float = DEFAULT_OVERHEAD_BYTES,
) -> Traffic:
    """The bytes a worker step moves, each way (see the module docstring).

    Args:
      setting: stock or Downpour.
      num_params: trainable parameters (float32).
      num_ps: ps tasks, each paying `overhead_bytes` per exchange.
      overhead_bytes: fixed bytes per exchange per ps, each way.

    Returns:
      The step's `Traffic`.
    """
    checks.check_int("num_params", num_params, 1)
    checks.check_int("num_ps", num_ps, 1)
    checks.check_nonnegative("overhead_bytes", overhead_bytes)
    model_bytes = num_params * BYTES_PER_PARAM
    fixed = overhead_bytes * num_ps * setting.exchanges_per_step
    if setting.n_fetch is None:
        return Traffic(model_bytes + fixed, model_bytes + fixed)
    return Traffic(
        model_bytes / setting.n_fetch + fixed,
        setting.push_copies * model_bytes / setting.n_push + fixed,
    )


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The cluster and model the prediction is for.

    Attributes:
      num_params: trainable parameters (float32, `BYTES_PER_PARAM` each).
      num_workers: model replicas, one worker task each.
      num_ps: ps tasks; the parameters are sharded evenly over them.
      worker_bits_per_sec: each worker's NIC, in and out; None: unlimited.
      ps_bits_per_sec: each ps task's NIC, in and out; None: unlimited.
      compute_secs: one worker's compute of one step (forward, backward,
        local update), without any transfer.
      batch_size: examples per step.
      steps_per_execution: steps per scheduled function.
      function_secs: the chief's cost per scheduled function.
      overhead_bytes: fixed bytes per exchange per ps, each way.
      steps_between_joins: steps each worker runs between two joins of the
        coordinator (`model.fit` joins at every epoch's end: its
        `steps_per_epoch` over the workers); None: no joins (epochs far
        longer than an exchange's segment). All workers start the interval
        after a join together, so its first exchange falls on every worker
        at once: each direction of a ps NIC then carries all `W` transfers,
        and a worker waits `t * max(0, W / k - 1)` beyond its own. The later
        exchanges spread as `step_jitter_secs` says. Not modelled: a
        worker's idle time at the join itself.
      step_jitter_secs: the standard deviation of one worker step's time
        (`benchmarks/step_jitter.py` measures it); used with
        `steps_between_joins`. Exchange `j` of an interval (`j = 0` right
        after the join, `s` steps per exchange) finds two workers apart by
        `d ~ N(0, 2 j s sigma^2)`, and a transfer of `t` seconds overlaps
        another's for `E[max(0, 1 - |d| / t)]` of its time (at least the
        `t / T` of independent times, `T` the step). None: only the first
        exchange of an interval is in step, the later ones are independent
        (a variation far larger than any transfer); 0: every exchange is in
        step. Past the first `queueing.MAX_TRACKED_EXCHANGES` of an interval,
        exchanges are taken as independent.
    """

    num_params: int
    num_workers: int
    num_ps: int
    worker_bits_per_sec: float | None
    ps_bits_per_sec: float | None
    compute_secs: float
    batch_size: int = DEFAULT_BATCH_SIZE
    steps_per_execution: int = DEFAULT_STEPS_PER_EXECUTION
    function_secs: float = DEFAULT_FUNCTION_SECS
    overhead_bytes: float = DEFAULT_OVERHEAD_BYTES
    steps_between_joins: int | None = None
    step_jitter_secs: float | None = None

    def __post_init__(self):
        for name in ("num_params", "num_workers", "num_ps", "batch_size"):
            checks.check_int(name, getattr(self, name), 1)
        checks.check_int("steps_per_execution", self.steps_per_execution, 1)
        if self.steps_between_joins is not None:
            checks.check_int("steps_between_joins", self.steps_between_joins, 1)
        for name in ("worker_bits_per_sec", "ps_bits_per_sec"):
            value = getattr(self, name)
            if value is not None and not (
                checks.is_number(value) and math.isfinite(value) and value > 0
            ):
                raise checks.argument_error(
                    name, "a positive number of bits/s or None (unlimited)", value
                )
        jitter = self.step_jitter_secs
        if jitter is not None and not (
            checks.is_number(jitter) and math.isfinite(jitter) and jitter >= 0
        ):
            raise checks.argument_error(
                "step_jitter_secs", "a finite number >= 0 or None", jitter
            )
        for name in ("compute_secs", "function_secs", "overhead_bytes"):
            value = getattr(self, name)
            if not (checks.is_number(value) and math.isfinite(value) and value >= 0):
                raise checks.argument_error(name, "a finite number >= 0", value)

    def replace(self, **changes) -> Cluster:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What `predict` finds for one setting.

    Attributes:
      setting: the setting.
      examples_per_sec: the bound, all workers together.
      bottleneck: the resource that sets it: `"worker CPU"`, `"worker NIC"`,
        `"ps NIC queueing"` (the workers' bound, mostly waiting for other
        workers' transfers), `"ps NIC"` or `"chief scheduling"`.
      bounds: examples/s each resource allows (`"workers"`, `"ps NIC"`,
        `"chief scheduling"`); inf where unlimited.
      traffic: the bytes of one worker step.
      transfer_secs: one worker's own transfer time per step.
      queue_secs: one worker's wait per step for the other workers'
        transfers at the ps NICs.
    """

    setting: Setting
    examples_per_sec: float
    bottleneck: str
    bounds: dict
    traffic: Traffic
    transfer_secs: float
    queue_secs: float = 0.0


def predict(cluster: Cluster, setting: Setting) -> Prediction:
    """Examples/s of `setting` on `cluster`: the smallest bound of the resources.

    Args:
      cluster: the cluster, model and step cost.
      setting: stock or Downpour.

    Returns:
      The `Prediction`; ties go to the workers, then the ps NIC.
    """
    c = cluster
    traffic = step_traffic(setting, c.num_params, c.num_ps, c.overhead_bytes)
    worker_rate = min(
        queueing.bits_per_sec(c.worker_bits_per_sec),
        c.num_ps * queueing.bits_per_sec(c.ps_bits_per_sec),
    )
    transfer_secs = 8 * traffic.total_bytes / worker_rate
    queue_secs = queueing.queue_secs(c, setting, traffic, worker_rate)
    step_secs = c.compute_secs + transfer_secs + queue_secs
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
        if c.compute_secs >= transfer_secs + queue_secs:
            bottleneck = WORKER_CPU
        else:
            bottleneck = WORKER_NIC if transfer_secs >= queue_secs else PS_QUEUE
    return Prediction(
        setting, bounds[best], bottleneck, bounds, traffic, transfer_secs, queue_secs
    )


def _busy(cluster: Cluster, setting: Setting, busy_fraction: float) -> bool:
    """The network keeps the workers at `busy_fraction` of their compute rate.

    Both the workers' bound (compute plus their own transfers) and the ps
    NIC's are at least `busy_fraction * num_workers * batch / compute_secs`;
    the chief is left out (`chief_steps_per_execution` sizes it).
    """
    if cluster.compute_secs == 0:
        return False
    limit = cluster.num_workers * cluster.batch_size / cluster.compute_secs
    bounds = predict(cluster, setting).bounds
    return min(bounds["workers"], bounds[PS_NIC]) >= busy_fraction * limit


def chief_steps_per_execution(cluster: Cluster) -> int | None:
    """The fewest steps per scheduled function with which the chief keeps up
    with the workers' compute-only rate (`num_workers / compute_secs` steps/s
    at `function_secs` each); None without a compute time."""
    if cluster.compute_secs == 0:
        return None
    steps_per_sec = cluster.num_workers / cluster.compute_secs
    return max(1, math.ceil(steps_per_sec * cluster.function_secs - 1e-9))


def _check_fraction(busy_fraction) -> None:
    if not (checks.is_number(busy_fraction) and 0 < busy_fraction <= 1):
        raise checks.argument_error("busy_fraction", "in (0, 1]", busy_fraction)


def smallest_ps(
    cluster: Cluster,
    setting: Setting,
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
    cluster: Cluster,
    outer: bool = False,
    accumulator: str = "squares",
    busy_fraction: float = 0.9,
) -> int | None:
    """The smallest n = n_fetch = n_push (a power of 2, <= 1024) keeping the
    workers busy at the cluster's own `num_ps`, or None."""
    _check_fraction(busy_fraction)
    for n in _SEARCH_NS:
        if _busy(cluster, Setting(n, n, outer, accumulator), busy_fraction):
            return n
    return None


def plan(
    cluster: Cluster,
    outer: bool = False,
    accumulator: str = "squares",
    busy_fraction: float = 0.9,
    max_ps: int = _MAX_PS,
) -> tuple[int, int] | None:
    """`(n_push, num_ps)`: the smallest n, then the fewest ps, keeping the
    workers busy (n = n_fetch = n_push, powers of 2 up to 1024); None if
    none does (the worker NIC is the limit)."""
    for n in _SEARCH_NS:
        setting = Setting(n, n, outer, accumulator)
        count = smallest_ps(cluster, setting, busy_fraction, max_ps)
        if count is not None:
            return n, count
    return None
