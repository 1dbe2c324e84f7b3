"""Sandblaster L-BFGS on a parameter-server cluster (Dean et al. 2012, §4.2).

The coordinator (this process, the `chief`) runs `sandblaster.lbfgs.minimize`
on vectors that live sharded on the ps tasks (`sandblaster.ps_vectors`): it
holds python floats only, never a parameter-sized vector. One objective
evaluation at a point `x`:

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
   cached vector, `tf_distbelief.sandblaster.flat_params`), writes the gradient into a
   gradient *slot* on the ps and returns the scalar loss share.
4. Backup tasks: once no portion is queued (a worker is idle) and portions are
   still running, the coordinator schedules one more copy of each outstanding
   portion, oldest first, onto the idle workers.
5. When every portion has an accepted copy, the ps shards sum the accepted
   slots in portion order into the gradient vector; the coordinator sums the
   accepted loss shares. The result does not depend on which worker ran what.

Exactly once, by construction: every copy (primary or backup) writes into a
slot of its own, lent to it by the coordinator until the copy has finished, and
only the coordinator, a single thread, decides which copy counts: the first
whose `RemoteValue` it sees finished (`sandblaster_schedule.PortionLedger`).
The reduction reads exactly one slot per portion, that of the accepted copy; a
copy finishing later (even during a later evaluation) only writes its own slot,
which nobody reads, and is counted in `copies_discarded`. Nothing is ever added
into a shared accumulator by a worker, so no race can count a portion twice.

Cost of this design: `portions + 2 * num_workers` parameter-sized slots on the
ps (the paper's replicas instead add several portions into one local
accumulator before sending it; with the coordinator unable to direct a
function to a given worker, per-copy slots are what makes exactly-once cheap to
prove). Each portion sends its gradient once; parameters are fetched once per
worker and evaluation.

Example:

```python
strategy = tf_distbelief.DistBeliefStrategy(resolver)
model = tf_keras.Sequential([...])     # built outside `strategy.scope()`
trainer = sandblaster.SandblasterTrainer(
    strategy, model, "sparse_categorical_crossentropy", x_train, y_train,
    portions=32, history=10, backup_tasks=True)
result = trainer.fit(max_iters=100)    # the trained weights are in `model`
print(result.loss, trainer.stats)
```
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time

import numpy as np
import tensorflow as tf

from tf_distbelief.sandblaster import flat_params, lbfgs, ps_vectors
from tf_distbelief.sandblaster import portion as portion_lib
from tf_distbelief.sandblaster import schedule as schedule_lib

__all__ = ["SandblasterObjective", "SandblasterStats", "SandblasterTrainer"]

_F64 = tf.float64
_I64 = tf.int64


@dataclasses.dataclass
class SandblasterStats:
    """Counters of a `SandblasterObjective`, summed over its evaluations.

    Attributes:
      evaluations: objective evaluations (calls).
      portions_scheduled: primary copies, `portions` per evaluation.
      backup_copies_scheduled: backup copies.
      copies_accepted: copies counted, exactly one per portion and evaluation.
      copies_discarded: copies that finished after another copy of their portion
        had been accepted; their gradient was never added.
      accepted_by_worker: accepted copies per worker index (load balancing).
      evaluation_secs: wall time of each evaluation.
    """

    evaluations: int = 0
    portions_scheduled: int = 0
    backup_copies_scheduled: int = 0
    copies_accepted: int = 0
    copies_discarded: int = 0
    accepted_by_worker: dict[int, int] = dataclasses.field(default_factory=dict)
    evaluation_secs: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Copy:
    eval_id: int
    ledger: schedule_lib.PortionLedger
    portion: int
    slot: int


def _job(device: str) -> str:
    return device.split("/job:")[1].split("/")[0] if "/job:" in device else ""


def _check_made_after_connecting(layout, coordinator_device):
    # Connecting to a cluster resets the eager context: a variable made before
    # belongs to the old one (`/job:localhost`) and can no longer be read.
    for v in layout.variables:
        if _job(v.device) != _job(coordinator_device):
            raise ValueError(
                "Argument `model` must be built after the strategy is created "
                "(creating it connects this process to the cluster and drops "
                f"earlier variables). Received weight {v.name!r} on {v.device!r}, "
                f"while this process is {coordinator_device!r}"
            )


class SandblasterObjective:
    """`fun_and_grad` for `lbfgs.minimize`, evaluated in portions on the workers.

    See the module docstring for the protocol. The objective is the mean loss
    over the training set plus the model's regularisation losses
    (`model.losses`), at the flat float64 parameters (`flat_params.FlatLayout`).
    The model is evaluated with `training=False`, so it is deterministic.

    Args:
      strategy: a `DistBeliefStrategy` (or ParameterServerStrategy); this
        process is its coordinator.
      model: a tf_keras model, built after `strategy` was created (connecting
        to the cluster drops earlier variables) and outside `strategy.scope()`.
      loss_fn: see `sandblaster_portion.per_example_loss`.
      x: training features, `[num_examples, ...]`.
      y: training targets, `[num_examples, ...]`.
      portions: work portions per evaluation, in `[1, num_examples]`; the paper
        uses far more than workers (default 32).
      backup_tasks: schedule copies of outstanding portions at the end of an
        evaluation.
      num_shards: ps shards of every vector; None means one per ps task.
      straggler_worker: for tests and benchmarks, a worker index whose portions
        are slowed down, or None.
      straggler_slowdown: a slowed portion takes this many times its compute
        time (it sleeps `(slowdown - 1) * compute time`), >= 1.
      straggler_delay_secs: extra sleep of each slowed portion, >= 0.

    Attributes:
      ops: the `ps_vectors.PsVectorOps` of the vectors.
      layout: the model's `flat_params.FlatLayout`.
      grad: the gradient vector each call returns (overwritten by the next).
      stats: a `SandblasterStats`.

    Raises:
      ValueError: `x` and `y` differ in length or are empty, `portions` is out
        of range, bad straggler settings, no loss for an uncompiled model, or
        the model was built before the strategy connected.
      TypeError: a bad `loss_fn`, or the model's weights are not plain
        variables (built under `strategy.scope()`).
    """

    def __init__(
        self,
        strategy,
        model,
        loss_fn,
        x: np.ndarray,
        y: np.ndarray,
        portions: int = 32,
        backup_tasks: bool = True,
        num_shards: int | None = None,
        straggler_worker: int | None = None,
        straggler_slowdown: float = 1.0,
        straggler_delay_secs: float = 0.0,
    ):
        x, y = np.asarray(x), np.asarray(y)
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(
                "Arguments `x` and `y` must hold the same, non-zero number of "
                f"examples. Received: {len(x)} and {len(y)}"
            )
        self.bounds = schedule_lib.portion_bounds(len(x), portions)
        if not (straggler_slowdown >= 1.0 and straggler_delay_secs >= 0.0):
            raise ValueError(
                "Arguments `straggler_slowdown` >= 1 and `straggler_delay_secs` >= 0 "
                f"required. Received: {straggler_slowdown!r}, {straggler_delay_secs!r}"
            )
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
        self._slots = []
        for shard in self._x_eval.shards:
            with tf.device(shard.device):
                self._slots.append(
                    tf.Variable(
                        lambda n=int(shard.shape[0]): tf.zeros([num_slots, n], _F64),
                        dtype=_F64,
                        trainable=False,
                    )
                )
        with strategy.scope():
            size = self.layout.size
            self._cache = tf.Variable(
                initial_value=lambda: tf.zeros([size], _F64),
                shape=[size],
                dtype=_F64,
                trainable=False,
                name="sandblaster/cache",
                per_worker_variable=True,
            )
            self._cached_eval = tf.Variable(
                initial_value=lambda: tf.constant(-1, _I64),
                shape=[],
                dtype=_I64,
                trainable=False,
                name="sandblaster/cached_eval",
                per_worker_variable=True,
            )
        self._eval_id = 0
        self._in_flight: dict[concurrent.futures.Future, _Copy] = {}
        # One thread per copy in flight waits on its RemoteValue (`fetch`), so the
        # coordinator can wait for the first of any copies with public APIs.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=num_slots)
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
            straggler_worker,
            float(straggler_slowdown),
            float(straggler_delay_secs),
        )

    # ------------------------------------------------------- coordinator side

    def _launch(self, ledger, portion, eval_id_tensor, backup):
        while self._slot_pool.num_free == 0:
            self._wait_any()
        slot = self._slot_pool.acquire()
        ledger.scheduled(portion)
        remote = self.coordinator.schedule(
            self.portion_function,
            args=(
                tf.constant(portion, _I64),
                tf.constant(slot, _I64),
                eval_id_tensor,
            ),
        )
        future = self._executor.submit(remote.fetch)
        self._in_flight[future] = _Copy(self._eval_id, ledger, portion, slot)
        if backup:
            self.stats.backup_copies_scheduled += 1
        else:
            self.stats.portions_scheduled += 1

    def _wait_any(self, timeout_secs=None) -> None:
        """Waits for at least one copy to finish (or the timeout) and books it."""
        done, _ = concurrent.futures.wait(
            list(self._in_flight),
            timeout=timeout_secs,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        for future in done:
            copy = self._in_flight.pop(future)
            share, worker = future.result()
            current = copy.eval_id == self._eval_id
            if current and copy.ledger.finish(copy.portion, (copy.slot, float(share))):
                self.stats.copies_accepted += 1
                worker = int(worker)
                by_worker = self.stats.accepted_by_worker
                by_worker[worker] = by_worker.get(worker, 0) + 1
            else:
                self.stats.copies_discarded += 1
                self._slot_pool.release(copy.slot)

    def __call__(self, x: ps_vectors.PsVector) -> tuple[float, ps_vectors.PsVector]:
        """Returns `(loss, grad)` at `x`; `grad` is `self.grad`, overwritten later."""
        start = time.monotonic()
        self._eval_id += 1
        if x is not self._x_eval:
            self.ops.assign(x, self._x_eval)
        eval_id = tf.constant(self._eval_id, _I64)
        ledger = schedule_lib.PortionLedger(
            self.portions, max_copies=2 if self.backup_tasks else 1
        )
        for portion in range(self.portions):
            self._launch(ledger, portion, eval_id, backup=False)
        while not ledger.complete:
            if self.backup_tasks:
                idle = self.num_workers - len(self._in_flight)
                for portion in ledger.backups_wanted(idle):
                    if self._slot_pool.num_free == 0:
                        break
                    self._launch(ledger, portion, eval_id, backup=True)
            self._wait_any()
        slots, shares = zip(*ledger.accepted)
        portion_lib.reduce_slots(
            self.grad.devices,
            self._slots,
            self.grad.shards,
            tf.constant(slots, tf.int32),
        )
        for slot in slots:
            self._slot_pool.release(slot)
        self.stats.evaluations += 1
        self.stats.evaluation_secs.append(time.monotonic() - start)
        return math.fsum(shares), self.grad

    def join(self) -> None:
        """Waits for every copy still running (late backups) and books it."""
        while self._in_flight:
            self._wait_any()

    def close(self) -> None:
        """Waits for the copies still running and stops the waiting threads."""
        self.join()
        self._executor.shutdown(wait=True)


class SandblasterTrainer:
    """Trains a tf_keras model with Sandblaster L-BFGS (Dean et al. 2012, §4.2).

    Full-batch L-BFGS (`lbfgs.minimize`, strong Wolfe line search) on the mean
    training loss plus the model's regularisation losses; the parameters and the
    L-BFGS history live on the ps (`ps_vectors.PsVectorOps`), objective
    evaluations run in portions on the workers (`SandblasterObjective`).

    The model may be compiled or not (only its loss is used: `loss_fn=None`
    takes the compiled one); build it after creating the strategy (connecting
    drops earlier variables) and outside `strategy.scope()`. `fit` starts
    from the model's current weights and writes the result back into them: the
    only two parameter-sized transfers through the coordinator.

    Example:
      ```
      with tfdb.LocalCluster(num_workers=2, num_ps=2) as local:
        strategy = tfdb.DistBeliefStrategy(local.resolver)
        model = models.digits.build_model()
        trainer = sandblaster.SandblasterTrainer(
            strategy, model,
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            x_train, y_train, portions=32, history=10)
        result = trainer.fit(max_iters=200)
      ```

    Args:
      strategy, model, loss_fn, x, y, portions, backup_tasks, num_shards,
      straggler_worker, straggler_slowdown, straggler_delay_secs: see
        `SandblasterObjective`.
      history: `m`, the `(s, y)` pairs L-BFGS keeps (on the ps); Nocedal &
        Wright suggest 3 to 20 (default 10, as SciPy's L-BFGS-B).
    """

    def __init__(
        self,
        strategy,
        model,
        loss_fn=None,
        x=None,
        y=None,
        portions: int = 32,
        history: int = 10,
        backup_tasks: bool = True,
        num_shards: int | None = None,
        straggler_worker: int | None = None,
        straggler_slowdown: float = 1.0,
        straggler_delay_secs: float = 0.0,
    ):
        if x is None or y is None:
            raise ValueError("Arguments `x` and `y` (the training set) are required.")
        self.model = model
        self.history = history
        self.objective = SandblasterObjective(
            strategy,
            model,
            loss_fn,
            x,
            y,
            portions=portions,
            backup_tasks=backup_tasks,
            num_shards=num_shards,
            straggler_worker=straggler_worker,
            straggler_slowdown=straggler_slowdown,
            straggler_delay_secs=straggler_delay_secs,
        )

    @property
    def stats(self) -> SandblasterStats:
        return self.objective.stats

    def fit(
        self,
        max_iters: int = 100,
        gtol: float = 1e-5,
        ftol: float = 2.220446049250313e-09,
        record_iterates: bool = False,
    ) -> lbfgs.LbfgsResult:
        """Runs L-BFGS from the model's weights; leaves the result in the model.

        Args:
          max_iters, gtol, ftol, record_iterates: see `lbfgs.minimize` (the
            defaults are SciPy L-BFGS-B's stopping rules).

        Returns:
          The `lbfgs.LbfgsResult`; its `x` is a `PsVector` on the ps.
        """
        ops, layout = self.objective.ops, self.objective.layout
        x0 = ops.from_numpy(layout.read())
        result = lbfgs.minimize(
            self.objective,
            x0,
            ops,
            m=self.history,
            max_iters=max_iters,
            gtol=gtol,
            ftol=ftol,
            record_iterates=record_iterates,
        )
        layout.write(ops.to_numpy(result.x))
        # Late backup losers still hold gradient slots; let them finish so the
        # counters are final and nothing runs after `fit` returns.
        self.objective.join()
        return result
