"""What a planner prediction is of: the cluster, the training setting, a step's bytes.

`Cluster` (the model's size, the workers and ps tasks, their NIC rates, a
step's compute, the chief's cost per scheduled function, the host's cores
where the tasks share one), `Setting` (stock
parameter-server training or a Downpour cadence) and `Traffic` (the bytes one
worker step moves each way) are plain records, checked when made; the cost
model (`cost_model.predict`) and the queueing at the ps NICs
(`queueing.step_parts`) both read them. No TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import re

from tf_distbelief import checks
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour.push_rules import rule

__all__ = [
    "ACCUMULATORS",
    "BYTES_PER_PARAM",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_FUNCTION_SECS",
    "DEFAULT_OVERHEAD_BYTES",
    "DEFAULT_STEPS_PER_EXECUTION",
    "Cluster",
    "Setting",
    "Traffic",
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
# The outer rule's settings in `Setting.downpour_config`: any valid ones.
_OUTER = {"outer_learning_rate": 0.7, "outer_momentum": 0.9}
# `+topk=`'s value is any float Python reads (`Setting`'s checks own its
# range, with their message); anything else is the grammar's error.
_SETTING_RE = re.compile(r"^n=(\d+)(\+outer)?(?:\+topk=([^+]+))?(?:\+q(\d+))?$")
_GRAMMAR = (
    "stock, n=<n> or n=<n>+outer (n >= 1), then optionally +topk=<f> (the "
    "fraction of entries a push sends) and +q<bits>, in that order"
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """Stock training (`n_fetch` None) or a Downpour setting.

    Attributes:
      n_fetch: steps between fetches; None: stock parameter-server training.
      n_push: steps between pushes; None with `n_fetch`.
      outer: the outer Nesterov rule (a push is the parameter delta).
      accumulator: `DownpourConfig.adagrad_accumulator`.
      top_k_fraction, quantize_bits: compressed pushes, as
        `DownpourConfig`'s fields of those names; None: not compressed. Their
        bytes come from the push rules (`push_bytes`).
    """

    n_fetch: int | None = None
    n_push: int | None = None
    outer: bool = False
    accumulator: str = "squares"
    top_k_fraction: float | None = None
    quantize_bits: int | None = None

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
        if self.compressed:
            if self.n_fetch is None:
                raise ValueError(
                    "Arguments `top_k_fraction` and `quantize_bits` need Downpour "
                    f"(n_fetch, n_push). Received: top_k_fraction="
                    f"{self.top_k_fraction!r}, quantize_bits={self.quantize_bits!r}"
                )
            rule.resolve(self.downpour_config())  # Its checks, its errors.
        if self.accumulator not in ACCUMULATORS:
            raise checks.argument_error(
                "accumulator", f"one of {ACCUMULATORS}", self.accumulator
            )

    @classmethod
    def parse(cls, name: str, accumulator: str = "squares") -> Setting:
        """`"stock"`, `"n=16"`, `"n=16+outer"` (n = n_fetch = n_push), each
        Downpour one optionally compressed: `"n=16+outer+topk=0.01+q2"`
        (`top_k_fraction` 0.01, `quantize_bits` 2), `+topk=<f>`, `+q<bits>`.

        Raises:
          ValueError: `name` is none of these; `Setting`'s own errors for
            values it refuses (`+topk=2`, `+q3`).
        """
        if name == "stock":
            return cls(accumulator=accumulator)
        match = _SETTING_RE.match(str(name))
        try:
            n = int(match.group(1)) if match else 0
            topk = match.group(3) if match else None
            fraction = None if topk is None else float(topk)
        except ValueError:  # A `+topk=` that is not a number.
            n = 0
        if n < 1:
            raise ValueError(f"A setting must be {_GRAMMAR}. Received: {name!r}")
        bits = None if match.group(4) is None else int(match.group(4))
        return cls(n, n, bool(match.group(2)), accumulator, fraction, bits)

    @property
    def name(self) -> str:
        if self.n_fetch is None:
            return "stock"
        if self.n_fetch == self.n_push:
            base = f"n={self.n_fetch}"
        else:
            base = f"fetch={self.n_fetch},push={self.n_push}"
        base += "+outer" if self.outer else ""
        if self.top_k_fraction is not None:
            base += f"+topk={self.top_k_fraction:g}"
        return base + ("" if self.quantize_bits is None else f"+q{self.quantize_bits}")

    @property
    def compressed(self) -> bool:
        """True when pushes are compressed (`quantize_bits` 0 or None: values
        not coded)."""
        return self.top_k_fraction is not None or bool(self.quantize_bits)

    def downpour_config(self) -> downpour_config.DownpourConfig:
        """The `DownpourConfig` of this Downpour setting: its cadence,
        accumulator and compression, and with `outer` the outer rule (at
        settings that do not change a push's bytes)."""
        outer = _OUTER if self.outer else {}
        return downpour_config.DownpourConfig(
            n_fetch=self.n_fetch,
            n_push=self.n_push,
            top_k_fraction=self.top_k_fraction,
            quantize_bits=self.quantize_bits or 0,
            adagrad_accumulator=self.accumulator,
            **outer,
        )

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
      host_cores: the cores of the one host every task shares (a local
        emulation: `LocalCluster` runs all tasks on this machine); the
        workers' steps then slow each other down (`host`), and
        `compute_secs` is the single process's step on the whole host.
        None: each worker on a host of its own (a real cluster).
      cores_per_worker: the most cores one worker task computes with on the
        shared host (its intra-op threads: 1 for `LocalCluster(
        intra_op_threads=1)`, the benchmarks' default); None: all
        `host_cores`. Needs `host_cores`.
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
    host_cores: int | None = None
    cores_per_worker: int | None = None

    def __post_init__(self):
        for name in ("num_params", "num_workers", "num_ps", "batch_size"):
            checks.check_int(name, getattr(self, name), 1)
        checks.check_int("steps_per_execution", self.steps_per_execution, 1)
        if self.steps_between_joins is not None:
            checks.check_int("steps_between_joins", self.steps_between_joins, 1)
        checks.check_optional_int(
            "host_cores", self.host_cores, 1, "a positive int or None (a host per task)"
        )
        checks.check_optional_int(
            "cores_per_worker",
            self.cores_per_worker,
            1,
            "a positive int or None (all host_cores)",
        )
        if self.cores_per_worker is not None and self.host_cores is None:
            raise ValueError(
                "Argument `cores_per_worker` needs `host_cores` (the workers "
                "share one host). Received: cores_per_worker="
                f"{self.cores_per_worker!r}, host_cores=None"
            )
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
