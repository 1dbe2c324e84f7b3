"""Sandblaster's objective, evaluated in work portions on the workers (§4.2).

Dean et al. 2012, section 4.2. The coordinator (this process, the `chief`) runs
`sandblaster.lbfgs.minimize` on vectors that live sharded on the ps tasks
(`sandblaster.ps_vectors`): it holds python floats only, never a
parameter-sized vector. `SandblasterObjective` is the `fun_and_grad` it calls;
one objective evaluation at a point `x`:

1. The coordinator copies `x` into the evaluation point `x_eval`, shard by shard
   on each ps (no data through the coordinator).
2. The batch (the whole training set) is cut into `portions` contiguous work
   portions, far more than workers. Each portion is one
   `ClusterCoordinator.schedule`d function, run by whichever worker is free, so
   fast workers do more portions (load balancing). A worker fetches `x_eval`
   into its own cache once per evaluation (a `per_worker_variable` tagged with
   the evaluation id); its later portions reuse the cache. The training set is
   a constant of the scheduled function, so it reaches each worker once and a
   portion costs only its index (data affinity at no cost).
3. A portion computes `sum_i loss_i / N + (n_p / N) * regularisation` over its
   `n_p` examples and the gradient of that with respect to the flat parameters
   (`tf.GradientTape` on the tf_keras model, its weights read as slices of the
   cached vector, `flat_params`), writes the gradient into a gradient *slot*
   of the worker's own slot variable (a local write) and returns the scalar
   loss share.
4. Backup tasks: once no portion is queued (a worker is idle) and portions are
   still running, the coordinator schedules one more copy of each outstanding
   portion, oldest first, onto the idle workers.
5. When every portion has an accepted copy, one reduction (a multi-device
   function the coordinator runs, `portion.build_slot_reduction`) has each
   worker send the rows of its accepted slots to the ps shards, which sum them
   in portion order into the gradient vector; the coordinator sums the
   accepted loss shares. The result does not depend on which worker ran what.

Exactly once, by construction: every copy (primary or backup) writes into a
slot of its own, lent to it by the coordinator until the copy has finished, and
only the coordinator, a single thread, decides which copy counts: the first
whose `RemoteValue` it sees finished (`schedule.PortionLedger`).
The reduction reads exactly one slot per portion, that of the accepted copy; a
copy finishing later (even during a later evaluation) only writes its own slot,
which nobody reads, and is counted in `copies_discarded`. Nothing is ever added
into a shared accumulator by a worker, so no race can count a portion twice.
A worker lost after its copies were accepted takes their slots with it: each
worker's slot variable carries a random incarnation number, drawn when the
variable is (re)built on the worker, that each copy returns and the reduction
reads back; on a mismatch, or a worker unreachable during the reduction, the
whole evaluation runs again (at most `EVALUATION_ATTEMPTS` times, each named in
a log line), never a gradient with a portion missing.

Cost of this design: `portions + 2 * num_workers` parameter-sized slots on each
worker, in float32 when every weight is float32 or narrower (the gradient of
such a model holds float32 values only, so this is exact: `portion.slot_dtype`),
else float64. The paper's replicas instead add several portions into one local
accumulator; per-copy slots are what makes exactly-once cheap to prove, and
sending each portion's rows lets the ps sum in portion order. A portion's
gradient crosses the network once, at the end of the evaluation, in one
transfer per worker and shard; parameters are fetched once per worker and
evaluation.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tf_keras
from absl import logging

from tf_distbelief import checks, console
from tf_distbelief.sandblaster import copies as copies_lib
from tf_distbelief.sandblaster import flat_params, ps_vectors
from tf_distbelief.sandblaster import portion as portion_lib
from tf_distbelief.sandblaster import schedule as schedule_lib
from tf_distbelief.sandblaster.config import DEFAULT_STALL_TIMEOUT_SECS
from tf_distbelief.sandblaster.schedule import SandblasterStats

__all__ = [
    "EVALUATION_ATTEMPTS",
    "LossFn",
    "SandblasterObjective",
]

# What `loss_fn` may be (`portion.per_example_loss`): a tf_keras `Loss`, a loss
# name, or `(y_true, y_pred) -> per-example losses`.
LossFn = tf_keras.losses.Loss | str | Callable[[tf.Tensor, tf.Tensor], tf.Tensor]

_F64 = tf.float64
_I64 = tf.int64
# Most runs of one evaluation when workers are lost holding accepted slots.
EVALUATION_ATTEMPTS = 3
# Longest wait, in seconds, for the copies still running when an evaluation
# fails, so that none is left running on the cluster after the error.
_SETTLE_SECS = 60.0
# What the reduction raises when a worker holding slots is gone.
_LOST_WORKER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.NotFoundError,
    tf.errors.FailedPreconditionError,
)


def _job(device: str) -> str:
    return device.split("/job:")[1].split("/")[0] if "/job:" in device else ""


def _check_made_after_connecting(layout, coordinator_device):
    # Connecting to a cluster resets the eager context: a variable made before
    # belongs to the old one (`/job:localhost`) and can no longer be read.
    for v in layout.variables:
        if _job(v.device) != _job(coordinator_device):
            raise checks.argument_error(
                "model",
                "built after the strategy is created (creating it connects this "
                "process to the cluster and drops earlier variables)",
                v.name,
                described=f"weight {v.name!r} on {v.device!r}, while this process "
                f"is {coordinator_device!r}",
            )


class SandblasterObjective:
    """`fun_and_grad` for `lbfgs.minimize`, evaluated in portions on the workers.

    See the module docstring for the protocol. The objective is the mean loss
    over the training set plus the model's regularisation losses
    (`model.losses`), at the flat float64 parameters (`flat_params.FlatLayout`).
    The model is evaluated with `training=False`, so it is deterministic.

    Example:

    ```python
    strategy = tf_distbelief.DistBeliefStrategy(resolver)
    model = tf_keras.Sequential([...])     # built outside `strategy.scope()`
    objective = sandblaster.SandblasterObjective(
        strategy, model, "sparse_categorical_crossentropy", x_train, y_train,
        portions=32)
    x0 = objective.ops.from_numpy(objective.layout.read())
    result = lbfgs.minimize(objective, x0, objective.ops, m=10)
    objective.close()
    print(result.loss, objective.stats)
    ```

    `sandblaster.trainer.SandblasterTrainer` does this and writes the result back
    into the model.

    Args:
      strategy: a `DistBeliefStrategy` (or ParameterServerStrategy); this
        process is its coordinator.
      model: a tf_keras model, built after `strategy` was created (connecting
        to the cluster drops earlier variables) and outside `strategy.scope()`.
      loss_fn: a tf_keras `Loss`, a loss name, a callable returning
        per-example losses, or None for the compiled loss
        (`portion.per_example_loss`).
      x: training features, `[num_examples, ...]`.
      y: training targets, `[num_examples, ...]`.
      portions: work portions per evaluation, in `[1, num_examples]`; the paper
        uses far more than workers (default 32).
      backup_tasks: schedule copies of outstanding portions at the end of an
        evaluation.
      num_shards: ps shards of every vector; None means one per ps task.
      portion_delay_fn: for tests and benchmarks, a `portion.PortionDelayFn`
        traced into every portion after its gradient is written (a test slows
        one worker down with it, making a straggler); None (default) adds
        nothing to the portion function.
      stall_timeout_secs: longest wait, in seconds (finite, > 0), for the next
        copy of a work portion to finish; past it a call raises `TimeoutError`
        naming the portions it waited for (default
        `DEFAULT_STALL_TIMEOUT_SECS`, 600). A lost worker's portions go to the
        other workers; this bounds the wait when no worker is left to run them.

    Attributes:
      ops: the `ps_vectors.PsVectorOps` of the vectors.
      layout: the model's `flat_params.FlatLayout`.
      grad: the gradient vector each call returns (overwritten by the next).
      stats: a `SandblasterStats`.

    Raises:
      ValueError: `x` and `y` differ in length or are empty, `portions` is out
        of range, `stall_timeout_secs` is not a finite number > 0, no loss for
        an uncompiled model, or the model was built before the strategy
        connected.
      TypeError: a bad `loss_fn` or `portion_delay_fn`, or the model's weights
        are not plain variables (built under `strategy.scope()`).
    """

    def __init__(
        self,
        strategy: tf.distribute.experimental.ParameterServerStrategy,
        model: tf_keras.Model,
        loss_fn: LossFn | None,
        x: np.ndarray,
        y: np.ndarray,
        portions: int = 32,
        backup_tasks: bool = True,
        num_shards: int | None = None,
        portion_delay_fn: portion_lib.PortionDelayFn | None = None,
        stall_timeout_secs: float = DEFAULT_STALL_TIMEOUT_SECS,
    ):
        x, y = np.asarray(x), np.asarray(y)
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(
                "Arguments `x` and `y` must hold the same, non-zero number of "
                f"examples. Received: {len(x)} and {len(y)}"
            )
        self.bounds = schedule_lib.portion_bounds(len(x), portions)
        checks.check_callable("portion_delay_fn", portion_delay_fn, allow_none=True)
        checks.check_positive_secs("stall_timeout_secs", stall_timeout_secs)
        self.stall_timeout_secs = float(stall_timeout_secs)
        self.strategy = strategy
        self.portions = portions
        self.backup_tasks = bool(backup_tasks)
        self.layout = flat_params.FlatLayout(model)
        self.ops = ps_vectors.PsVectorOps(strategy, num_shards=num_shards)
        _check_made_after_connecting(self.layout, self.ops.coordinator_device)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
            strategy
        )
        self.num_workers = getattr(strategy, "num_workers", None) or len(
            strategy.cluster_resolver.cluster_spec().as_dict()["worker"]
        )
        self.stats = SandblasterStats()

        self._x_eval = self.ops.from_numpy(np.zeros(self.layout.size))
        self.grad = self.ops.zeros_like(self._x_eval)
        # Each copy in flight holds one slot; `portions` primaries plus a backup
        # and a late loser per worker fit without waiting.
        num_slots = portions + 2 * self.num_workers
        self._slot_pool = schedule_lib.SlotPool(num_slots)
        self.slot_dtype = portion_lib.slot_dtype(self.layout)
        size = self.layout.size

        def per_worker(name, shape, dtype, initial_value):
            return tf.Variable(
                initial_value=initial_value,
                shape=shape,
                dtype=dtype,
                trainable=False,
                name=f"sandblaster/{name}",
                per_worker_variable=True,
            )

        with strategy.scope():
            self._cache = per_worker(
                "cache", [size], _F64, lambda: tf.zeros([size], _F64)
            )
            self._cached_eval = per_worker(
                "cached_eval", [], _I64, lambda: tf.constant(-1, _I64)
            )
            self._incarnation = per_worker(
                "incarnation", [], _I64, lambda: tf.random.uniform([], 1, 2**62, _I64)
            )
            self._slots = per_worker(
                "slots",
                [num_slots, size],
                self.slot_dtype,
                lambda: tf.zeros([num_slots, size], self.slot_dtype),
            )
        self._reduction = portion_lib.SlotReduction(
            self._slots, self._incarnation, self.grad.shards, self.num_workers
        )
        self._eval_id = 0
        # The ledger of the evaluation running, None between evaluations: a
        # copy of an ended (or failed) evaluation finishing later is discarded.
        self._ledger: schedule_lib.PortionLedger | None = None
        self._in_flight = copies_lib.CopiesInFlight()
        self.portion_function = portion_lib.build_portion_function(
            model,
            self.layout,
            portion_lib.per_example_loss(loss_fn, model),
            x,
            y,
            self.bounds,
            self._x_eval,
            self._slots,
            self._cache,
            self._cached_eval,
            self._incarnation,
            portion_delay_fn,
        )

    # ------------------------------------------------------- coordinator side

    def _launch(self, ledger, portion, backup):
        while self._slot_pool.num_free == 0:
            self._wait_any()
        slot = self._slot_pool.acquire()
        ledger.scheduled(portion)
        remote = self.coordinator.schedule(
            self.portion_function,
            args=(portion_lib.pack_call(portion, slot, self._eval_id),),
        )
        copy = copies_lib.Copy(self._eval_id, ledger, portion, slot)
        self._in_flight.add(remote, copy)
        if backup:
            self.stats.backup_copies_scheduled += 1
        else:
            self.stats.portions_scheduled += 1

    def _wait_any(self) -> None:
        """Waits for at least one copy to finish and books it.

        Raises:
          TimeoutError: none finished within `stall_timeout_secs`.
        """
        finished = self._in_flight.wait_first(self.stall_timeout_secs, self.num_workers)
        for copy, future in finished:
            if future.exception() is not None:
                # The portion function failed (not a lost worker, which the
                # coordinator retries): its slot is free again, the error the
                # caller's.
                self._slot_pool.release(copy.slot)
            share, worker, incarnation = portion_lib.unpack_result(future.result())
            current = copy.ledger is self._ledger
            accepted = (copy.slot, worker, incarnation, share)
            if current and copy.ledger.finish(copy.portion, accepted):
                self.stats.copies_accepted += 1
                by_worker = self.stats.accepted_by_worker
                by_worker[worker] = by_worker.get(worker, 0) + 1
            else:
                self.stats.copies_discarded += 1
                self._slot_pool.release(copy.slot)

    def __call__(self, x: ps_vectors.PsVector) -> tuple[float, ps_vectors.PsVector]:
        """Returns `(loss, grad)` at `x`; `grad` is `self.grad`, overwritten later.

        Raises:
          TimeoutError: no copy of a work portion finished within
            `stall_timeout_secs` (no worker left to run them).
          RuntimeError: `EVALUATION_ATTEMPTS` evaluations in a row lost
            gradient slots (workers restarting).
        """
        start = time.monotonic()
        if x is not self._x_eval:
            self.ops.assign(x, self._x_eval)
        # This objective bounds its own waits (`stall_timeout_secs`).
        watch = getattr(self.strategy, "step_watch", None)
        with watch.suspended() if watch else contextlib.nullcontext():
            try:
                loss = self._evaluate_with_attempts()
            except Exception:
                self._settle()
                raise
        self.stats.evaluations += 1
        self.stats.evaluation_secs.append(time.monotonic() - start)
        return loss, self.grad

    def _evaluate_with_attempts(self) -> float:
        """Evaluates at `_x_eval`, again while workers lose accepted slots."""
        for attempt in range(1, EVALUATION_ATTEMPTS + 1):
            lost = self._evaluate()
            if lost is None:
                break
            logging.warning(
                "Sandblaster: evaluation %d lost gradient slots (%s); evaluating "
                "again (attempt %d of %d)",
                self._eval_id,
                lost,
                attempt + 1,
                EVALUATION_ATTEMPTS,
            )
        else:
            raise RuntimeError(
                f"Sandblaster: {EVALUATION_ATTEMPTS} evaluations in a row lost "
                f"gradient slots, the last: {lost}. Check that the workers stay up "
                "(a worker restarting during every evaluation)."
            )
        return math.fsum(self._shares)

    def _settle(self) -> None:
        """After a failed evaluation, waits (bounded) for the copies still running."""
        secs = min(_SETTLE_SECS, self.stall_timeout_secs)
        for copy in self._in_flight.settle(secs):
            self._slot_pool.release(copy.slot)
            self.stats.copies_discarded += 1

    def _evaluate(self) -> str | None:
        """Runs every portion once and reduces; returns what was lost, or None."""
        self._eval_id += 1
        ledger = schedule_lib.PortionLedger(
            self.portions, max_copies=2 if self.backup_tasks else 1
        )
        self._ledger = ledger
        try:
            return self._run_and_reduce(ledger)
        finally:
            # Also when the evaluation failed (a `TimeoutError` with some
            # portions accepted): their slots come back, and a copy of this
            # evaluation finishing later is discarded, not accepted.
            self._ledger = None
            for accepted in ledger.accepted:
                if accepted is not None:
                    self._slot_pool.release(accepted[0])

    def _run_and_reduce(self, ledger) -> str | None:
        """`_evaluate` on its open `ledger`: schedules, waits, reduces."""
        for portion in range(self.portions):
            self._launch(ledger, portion, backup=False)
        while not ledger.complete:
            if self.backup_tasks:
                idle = self.num_workers - len(self._in_flight)
                for portion in ledger.backups_wanted(idle):
                    if self._slot_pool.num_free == 0:
                        break
                    self._launch(ledger, portion, backup=True)
            self._wait_any()
        slots, workers, incarnations, self._shares = zip(*ledger.accepted)
        try:
            now = self._reduce(slots, workers)
            gone = sorted({w for w, i in zip(workers, incarnations) if now[w] != i})
            return f"worker {gone} restarted" if gone else None
        except _LOST_WORKER_ERRORS as e:
            # The reduction runs on the ps, so its error names a ps task even
            # when a worker was lost: ask the ps shards themselves.
            if not self._reduction.ps_shards_answer():
                raise  # A lost ps: the job's ps recovery (`recovery`) handles it.
            return f"{type(e).__name__}: {console.shorten(str(e))}"

    def _reduce(self, slots, workers) -> list[int]:
        """Sets `self.grad` to the accepted slots' sum (`portion.SlotReduction`).

        Returns:
          Each worker's incarnation number, read in the same call.
        """
        return self._reduction(slots, workers)

    def join(self) -> None:
        """Waits for every copy still running (late backups) and books it.

        Raises:
          TimeoutError: no copy finished within `stall_timeout_secs`.
        """
        while self._in_flight:
            self._wait_any()

    def close(self) -> None:
        """Waits for the copies still running (`join`): none runs after it.

        Raises:
          TimeoutError: no copy finished within `stall_timeout_secs`.
        """
        self.join()
