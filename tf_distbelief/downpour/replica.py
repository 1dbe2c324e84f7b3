"""Downpour SGD on `DistBeliefStrategy` (Dean et al. 2012, section 4.1).

`Downpour` runs the step order of `tf_distbelief.downpour.schedule` (a NumPy
reference, and the cadence rules this module calls on its step counter) on a
parameter-server cluster:

* every ps variable is a `variables.DownpourVariable`, which reads as the
  replica's cache during the forward pass (`tf_distbelief.substitution`);
* each worker keeps its caches, accumulators and counters in
  `per_worker_variable=True` variables (the cadence is counted by the worker
  that runs the step; checkpointed by `replica_state`); each variable kind has
  its handler, `dense` and `row_sparse` (`base.VariableKind`); `exchange`
  fetches and pushes, applied by the optimizer or `push_rules.on_ps`, counted;
* under `fit` with `n_fetch, n_push > 1`, the local steps between two ps
  exchanges run in a loop with no ps op at all (`Downpour.run_steps`): a ps op
  in a step, even in a branch not taken, costs messages at every step. The
  Keras side (`install`, `DownpourTrainer`, `DownpourMetrics`) is `keras`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import tf_keras

from tf_distbelief import checks, substitution
from tf_distbelief.downpour import (
    base,
    final_round,
    push_guard,
    schedule,
    sparse_fetch,
    stream_fetch,
)
from tf_distbelief.downpour import plan as plan_lib
from tf_distbelief.downpour import variables as downpour_variables
from tf_distbelief.downpour.config import DownpourConfig
from tf_distbelief.downpour.dense import DenseVariables
from tf_distbelief.downpour.exchange import Exchange
from tf_distbelief.downpour.push_rules import compression, on_ps
from tf_distbelief.downpour.row_sparse import RowSparseVariables
from tf_distbelief.downpour.row_sparse import flags as row_sparse_flags
from tf_distbelief.downpour.schedule import ReplicaStats
from tf_distbelief.faults import exactly_once
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = ["Downpour"]

# The per-worker counters: `ReplicaStats`' fields but the two byte totals,
# which `stats` derives.
_STAT_NAMES = tuple(
    f.name
    for f in dataclasses.fields(ReplicaStats)
    if f.name not in ("bytes_fetched", "bytes_pushed")
)


class Downpour:
    """The per-replica state of Downpour SGD and its step.

    Create it under the strategy's scope, after the model's variables (created
    with `enable` in effect); call `step` inside a function the coordinator
    schedules on a worker (as `fit` does, or `DownpourTrainer`), or
    `run_steps` for several steps at once.

    Args:
      strategy: the `DistBeliefStrategy` the variables live on.
      variables: the trained ps variables (`model.trainable_variables`).
      optimizer: a tf_keras optimizer (e.g. `tf_distbelief.adagrad.Adagrad`) applied on
        the ps to each push; it is built here if it is not yet.
      config: a `DownpourConfig`.
      row_sparse: variables among `variables` (e.g. embedding tables, whole or
        sharded) that the model only reads by row lookups
        (`tf.nn.embedding_lookup`; `tf.gather` only on an unsharded table, as
        TensorFlow's gather from a `ShardedVariable` returns rows in shard
        order): they are fetched and pushed by rows
        (`row_sparse.RowSparseVariables`). A bare variable is a list of one.

    Attributes:
      variables: the trained variables, shards in place of sharded ones.
      row_sparse: per variable, True where it is row-sparse.
      update_count, warm_steps: ps int64 scalars: pushes, warm-start steps.
      nonfinite_skipped, halted: ps int64 scalars: pushes refused for a NaN
        or inf; 1 after a refusal with `raise` stopped the pushes
        (`push_guard`).
      step_delay_fn: for tests and benchmarks only, None (default) or a
        `(worker, compute_secs) -> tf.Tensor` run at the end of each `step`
        and each `run_steps` call (a heterogeneous cluster: one worker made a
        straggler, e.g. by `benchmarks/stragglers.slow_worker`, the
        signature of Sandblaster's `portion.PortionDelayFn`); `worker` is
        the running worker's index, `compute_secs` the float64 seconds the
        call took so far, fetch and push included. Set it before the first
        step is traced.

    Raises:
      TypeError: a variable was not created with `enable(strategy)` in effect,
        `config` is not a `DownpourConfig`, or `row_sparse` holds something
        other than variables.
      ValueError: a `row_sparse` variable is not among `variables`, is a
        scalar, or meets a push rule; or `config.local_learning_rate` is None
        with a local AdaGrad step and a learning-rate schedule. A step that
        reads a row-sparse variable whole raises `RowSparseReadError`.

    Worker memory, per replica: the cache and the gradient accumulator, plus
    the local AdaGrad accumulator (`config.local_optimizer == "adagrad"`) and,
    when pushes send the squared gradients (`plan.PushedSquares`), its value
    at the last push (local SGD: a sum of squared gradients instead), and
    with a compressing push rule the residual of what pushes have not sent
    (`push_rules.compression`): up to 4 copies of the model (5 with
    compression; `worker_variables`; checkpointed per replica by
    `replica_state`). With the outer rule, compression keeps no residual but
    a mirror of the ps values and one of its momentum (`stream_fetch`,
    checkpointed too): one more copy than with the residual. The local step
    size is `config.local_learning_rate_for` the optimizer's learning rate;
    the local AdaGrad takes the optimizer's `initial_accumulator_value` and
    `epsilon` (0.1 and 1e-7 without them).
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        variables: Sequence[tf.Variable],
        optimizer: tf_keras.optimizers.Optimizer,
        config: DownpourConfig,
        row_sparse: tf.Variable | Sequence[tf.Variable] = (),
    ):
        if not isinstance(config, DownpourConfig):
            raise checks.argument_error("config", "a DownpourConfig", config)
        self.strategy = strategy
        self.config = config
        self.optimizer = optimizer
        self.variables = downpour_variables.leaf_variables(variables)
        for v in self.variables:
            if not isinstance(v, downpour_variables.DownpourVariable):
                raise TypeError(
                    f"Variable {v.name} is not Downpour-capable ({type(v).__name__})."
                    " Call `tf_distbelief.downpour.enable(strategy)` before creating "
                    "the model under `strategy.scope()`."
                )
        self.row_sparse = row_sparse_flags(self.variables, row_sparse)
        self._order = base.KindOrder(self.row_sparse)
        self.plan = plan_lib.Plan.create(config, optimizer)
        with strategy.scope():
            if not getattr(optimizer, "_built", False):
                optimizer.build(variables)
            dense, rows = self._order.split(self.variables)
            rules = on_ps.create(config, optimizer, dense, rows, strategy)
            self._dense = DenseVariables(dense, self.plan)
            self._rows = RowSparseVariables(rows, self.plan)
            streams = stream_fetch.is_on(config)
            self._compression = compression.create(config, dense, not streams)
            self._sparse = sparse_fetch.create(
                config, dense, self._dense.groups(), strategy, optimizer
            )
            self.tokens = exactly_once.tokens_for(optimizer, strategy)
            self._stream = stream_fetch.create(
                config,
                dense,
                self._dense.groups(),
                strategy,
                rules,
                self._compression,
                self.tokens,
            )
            self._seen = base.per_worker("downpour/seen", [], tf.int64)
            self._refetch = base.per_worker("downpour/refetch", [], tf.int64)
            self._stats = {
                name: base.per_worker(f"downpour/{name}", [], tf.int64)
                for name in _STAT_NAMES
            }
            # On the ps: those two, pushes refused for a NaN or inf, and the
            # halt after a refusal with `raise` (`push_guard`; not saved).
            names = ("update_count", "warm_steps", "nonfinite_skipped", "halted")
            self.update_count, self.warm_steps, self.nonfinite_skipped, self.halted = (
                tf.Variable(0, dtype=tf.int64, trainable=False, name=f"downpour/{n}")
                for n in names
            )
        self.nonfinite = "raise"  # Or "skip": see `push_guard.install`.
        self.step_delay_fn = None
        self.guard = push_guard.Guard(self)
        self._exchange = Exchange(
            optimizer,
            config,
            self.variables,
            self._order,
            self._dense,
            self._rows,
            guard_context=self.guard,
            tokens=self.tokens,
            rules=rules,
            compression=self._compression,
            sparse=self._sparse,
            stream=self._stream,
        )

    @property
    def _caches(self) -> list[tf.Variable]:  # One per variable.
        return self._order.merge(self._dense.caches, self._rows.caches)

    @property
    def runs_segments(self) -> bool:
        """True when `run_steps` applies (`DownpourConfig.runs_segments`)."""
        return self.config.runs_segments

    def _handles(self) -> base.Handles:
        # Per-worker handles are taken at the top of the scheduled function:
        # taken inside a `tf.cond` branch or a loop body they would not resolve
        # to the running worker.
        return base.Handles(
            dense=self._dense.handles(),
            rows=self._rows.handles(),
            seen=self._seen.handle,
            refetch=self._refetch.handle,
            stats={name: v.handle for name, v in self._stats.items()},
            count=self.update_count.get().handle,
            skipped=self.nonfinite_skipped.get().handle,
            halted=self.halted.get().handle,
            worker=tf.distribute.coordinator.experimental_get_current_worker_index(),
            residuals=[] if self._compression is None else self._compression.handles(),
            sparse=None if self._sparse is None else self._sparse.handles(),
            stream=None if self._stream is None else self._stream.handles(),
        )

    def _cached_values(self, h: base.Handles, after: list, active=None):
        """What the forward pass reads, after `after` ops.

        Returns:
          `(dense values, row readers)`: the cached values of the dense
          variables, a `row_sparse.RowReader` per row-sparse one.
        """
        with tf.control_dependencies(after):
            dense = self._dense.cached(h.dense)
            row_bytes = h.stats["row_bytes_fetched"]
            return dense, self._rows.readers(h.rows, row_bytes, after, active)

    def _gradient(self, forward_fn, dense_values: list, readers: list):
        """`(loss, outputs, grads)` of `forward_fn` at the parameter values.

        `grads` is `(dense, rows)`: a tensor per dense variable, and the
        gradient of each reader as `IndexedSlices`.
        """
        with tf.GradientTape() as tape:
            tape.watch(dense_values)
            for reader in readers:
                reader.tape = tape
            values = self._order.merge(dense_values, readers)
            with substitution.substitute(zip(self.variables, values)):
                loss, outputs = forward_fn()
        rows = [out for reader in readers for _, out in reader.reads]
        grads = tape.gradient(
            loss,
            dense_values + rows,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        n = len(dense_values)
        # A lookup in a cached table gives `IndexedSlices`: made dense, since
        # the cache and accumulator are.
        dense = [tf.convert_to_tensor(g) for g in grads[:n]]
        return loss, outputs, (dense, self._rows.gradients(readers, grads[n:]))

    def _local_ops(self, h: base.Handles, grads, accumulate: bool, update_cache: bool):
        """Each kind's `local_ops` on its gradients (`base.VariableKind`)."""
        dense, rows = grads
        return self._dense.local_ops(
            h.dense, dense, accumulate, update_cache
        ) + self._rows.local_ops(h.rows, rows, accumulate, update_cache)

    def step(
        self, forward_fn: Callable[[], tuple[tf.Tensor, Any]]
    ) -> tuple[tf.Tensor, Any, dict[str, tf.Tensor]]:
        """One local Downpour step of the worker it runs on.

        Every op that touches the ps sits in a `tf.cond` branch that runs only
        on a fetch or push step, and such a fetch or push moves one packed
        tensor per ps task and dtype (`dense.DenseVariables`): the branch not
        taken still exchanges a dead-tensor message per cross-device edge at
        every step, so fewer edges make the steps between fetches and pushes
        cheaper. With `n_fetch == 1` (and no warm start) the cache would be
        overwritten at every step, so the forward pass reads the fetched
        values directly and the local update is skipped; with `n_push == 1`
        the gradient is pushed without going through the accumulator. Both
        give the same parameters.

        Args:
          forward_fn: `() -> (loss, outputs)`, run with the ps variables reading
            as this replica's cache; `loss` is a scalar to differentiate.

        Returns:
          `(loss, outputs, metrics)`: `metrics` maps `staleness` (this step's
          push, -1 without one), `bytes_fetched` and `bytes_pushed` (this step)
          to int64 scalars.
        """
        cfg = self.config
        h = self._handles()
        int64, one = tf.int64, tf.constant(1, tf.int64)
        start = self._start_clock()
        with tf.control_dependencies(start):
            t = base.read(h.stats["steps"], int64)
            # Bytes counted fetches (sparse or stream) moved, before this step's.
            counted_fetches = h.sparse or h.stream
            sparse_bytes = None
            if counted_fetches is not None:
                sparse_bytes = base.read(counted_fetches.nbytes, int64)
        if cfg.warmstart_steps:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            is_first = tf.equal(worker, 0)
            warm = self.warm_steps.get().handle
            active = is_first | (base.read(warm, int64) >= cfg.warmstart_steps)
            warm_op = tf.cond(
                is_first & (t < cfg.warmstart_steps),
                lambda: base.after([base.add(warm, one)], True),
                lambda: tf.constant(False),
            )
        else:
            active = None  # Every step is active: no `tf.cond` on it.
            warm_op = tf.constant(True)

        def gated(pred):
            return pred if active is None else active & pred

        def if_active(fn):
            return (
                fn() if active is None else tf.cond(active, fn, lambda: tf.constant(0))
            )

        # The cache is needed across steps unless every step fetches.
        use_cache = cfg.n_fetch > 1 or active is not None
        if use_cache:
            fetched = self._exchange.fetch_if(h, gated(self._exchange.fetch_due(h, t)))
            dense, readers = self._cached_values(h, [fetched, warm_op], active)
        else:
            dense, fetched = self._exchange.fetch_values(h)
            row_bytes = h.stats["row_bytes_fetched"]
            readers = self._rows.readers(h.rows, row_bytes, [fetched])
        loss, outputs, grads = self._gradient(forward_fn, dense, readers)
        # The gradient is pushed as it is unless pushes gather several steps.
        use_accumulator = cfg.n_push > 1 or active is not None
        # After the gradient even without local ops: the push (and, with
        # `max_staleness`, its staleness check) must not run before it.
        updated = if_active(
            lambda: base.after(
                self._local_ops(h, grads, use_accumulator, use_cache)
                + grads[0]
                + [g.values for g in grads[1]],
                1,
            )
        )
        with tf.control_dependencies([updated]):
            if cfg.n_push == 1 and active is None:
                pushed = ((grads[0], None), (grads[1], None))
                staleness, applied, rows_pushed = self._exchange.push(
                    h, pushed, zero_accumulators=False, pack=False, step=t + 1
                )
            else:
                staleness, applied, rows_pushed = self._exchange.push_if(
                    h, gated(schedule.is_push_step(t, cfg.n_push)), step=t + 1
                )
        with tf.control_dependencies([staleness]):
            counted = if_active(
                lambda: base.after([base.add(h.stats["steps"], one)], 1)
            )
        with tf.control_dependencies([counted]):
            zero = tf.constant(0, int64)
            dense_bytes = tf.constant(self._dense.nbytes, int64)
            push_bytes = tf.constant(self._exchange.push_nbytes, int64)
            rows_fetched = self._rows.bytes_fetched(readers)
            dense_fetched = tf.where(fetched, dense_bytes, zero)
            if sparse_bytes is not None:
                with tf.control_dependencies([fetched]):
                    dense_fetched = (
                        base.read(counted_fetches.nbytes, int64) - sparse_bytes
                    )
            metrics = {
                "staleness": tf.identity(staleness),
                "bytes_fetched": dense_fetched + rows_fetched,
                "bytes_pushed": tf.where(applied, push_bytes, zero) + rows_pushed,
            }
        delay = self._delay(start, list(metrics.values()))
        with tf.control_dependencies(delay):
            metrics = {k: tf.identity(v) for k, v in metrics.items()}
        return loss, outputs, metrics

    def _start_clock(self) -> list:
        """`[tf.timestamp()]` when `step_delay_fn` is set, else `[]`."""
        return [] if self.step_delay_fn is None else [tf.timestamp()]

    def _delay(self, start: list, after: list) -> list:
        """`[step_delay_fn(worker, seconds since start)]` after `after`, or `[]`."""
        if not start:
            return []
        with tf.control_dependencies(after):
            compute_secs = tf.timestamp() - start[0]
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return [self.step_delay_fn(worker, compute_secs)]

    def run_steps(
        self,
        iterator,
        num_steps: tf.Tensor | int,
        forward_fn: Callable[[Any], tuple[tf.Tensor, Any]],
        last_step_fn: Callable[[Any, Any], Any] | None = None,
        first_token: tf.Tensor | None = None,
        totals: Any = None,
    ) -> tf.Tensor | tuple[tf.Tensor, Any]:
        """Runs `num_steps` local steps on the running worker, in segments.

        What `fit` schedules when `runs_segments` (see `keras.install`). The
        steps are cut into segments at fetch and push points
        (`schedule.steps_to_fetch`, `schedule.steps_to_push`): a segment
        starts with the fetch if one is due, runs its local steps, and ends
        with the push if one is due. Its steps but the last run in an inner
        loop that holds no ps op, so the ps takes part once per segment (of up
        to `min(n_fetch, n_push)` steps) instead of once per step: even a
        `tf.cond` branch not taken costs a message per step when it holds a ps
        op, and every write to a ps variable a round trip (row-sparse
        variables are the exception: each step gathers the rows it looks up
        and has not fetched since the segment's fetch). The parameters and
        counters are those of `step`, step for step.

        During those inner steps, writes to non-trainable ps variables (Keras
        metrics and loss trackers, BatchNorm statistics) are dropped
        (`variables.local_steps`); the last step of each segment makes them,
        so Keras metrics are computed on the last batch of each segment.

        Args:
          iterator: the per-worker dataset iterator.
          num_steps: steps to run, an int64 scalar >= 1.
          forward_fn: `data -> (loss, outputs)`, as for `step` with the batch.
          last_step_fn: optional `(data, outputs) -> None`, called (traced) for
            the last step of each segment, e.g. to update metrics; with
            `totals`, it returns a nest of tensors of their structure.
          first_token: None, or the `exactly_once` token of the first step
            (int64): the push ending step `i` is gated by `first_token + i`.
          totals: None, or a nest of tensors (e.g. zeros) to which each
            segment's `last_step_fn` result is added, as a Keras 3 step sums
            its metric states.

        Returns:
          The steps run, an int64 scalar (`num_steps`); with `totals`,
          `(steps run, totals)` with every segment's `last_step_fn` result
          added to `totals`.

        Raises:
          ValueError: `runs_segments` is False (`n_fetch` or `n_push` is 1, or a
            warm start is set); use `step`.
        """
        if not self.runs_segments:
            raise ValueError(
                "`run_steps` needs n_fetch > 1, n_push > 1 and no warm start; "
                f"use `step`. Received: {self.config}"
            )
        cfg = self.config
        h = self._handles()
        int64, one = tf.int64, tf.constant(1, tf.int64)
        num_steps = tf.cast(num_steps, int64)

        def local_step(data, last):
            def replica_fn(data):
                context = (
                    contextlib.nullcontext()
                    if last
                    else downpour_variables.local_steps()
                )
                with context:
                    dense, readers = self._cached_values(h, [])
                    loss, outputs, grads = self._gradient(
                        lambda: forward_fn(data), dense, readers
                    )
                    ops = self._local_ops(h, grads, True, True)
                    with tf.control_dependencies(ops):
                        ops.append(base.add(h.stats["steps"], one))
                    added = None
                    if last and last_step_fn is not None:
                        with tf.control_dependencies(ops):
                            added = last_step_fn(data, outputs)
                loss = base.after(ops, loss)
                return loss if totals is None or not last else (loss, added)

            return self.strategy.run(replica_fn, args=(data,))

        def segment(done, summed):
            t = base.read(h.stats["steps"], int64)
            fetched = self._exchange.fetch_if(h, self._exchange.fetch_due(h, t))
            # Steps up to the next fetch or push point, or to the end.
            size = tf.minimum(
                tf.minimum(
                    schedule.steps_to_fetch(t, cfg.n_fetch),
                    schedule.steps_to_push(t, cfg.n_push),
                ),
                num_steps - done,
            )
            with tf.control_dependencies([fetched]):
                inner = tf.while_loop(
                    lambda i: i < size - 1,
                    lambda i: base.after([local_step(next(iterator), False)], i + 1),
                    [tf.constant(0, int64)],
                )
            with tf.control_dependencies([inner]):
                last = local_step(next(iterator), True)
            if totals is not None:
                last, added = last
                summed = tf.nest.map_structure(tf.add, summed, added)
            with tf.control_dependencies([last]):
                # The segment's last step, `t + size - 1`, may end with a push.
                last_t = t + size - 1
                pred = schedule.is_push_step(last_t, cfg.n_push)
                token = None if first_token is None else first_token + done + size - 1
                with exactly_once.scope(token):
                    staleness, _, _ = self._exchange.push_if(h, pred, step=last_t + 1)
            return base.after([staleness], done + size), summed

        start = self._start_clock()
        with tf.control_dependencies(start):
            done, summed = tf.while_loop(
                lambda done, _: done < num_steps,
                segment,
                [tf.constant(0, int64), () if totals is None else totals],
            )
        delay = self._delay(start, [done])
        done = base.after(delay, done) if delay else done
        return done if totals is None else (done, summed)

    def after_restore(self) -> None:
        """What the ps values' restore from a checkpoint needs: with sparse
        fetches, every replica's next fetch sends every entry, and with
        update-stream fetches it is whole (its mirror of the ps holds values
        from before the restore)."""
        if self._sparse is not None:
            self._sparse.flag_all()
        if self._stream is not None:
            self._stream.log.restart()

    def finish(self) -> list[str]:
        """The end of training (`final_round`): with the outer rule, the
        replicas' unsent progress averaged into the ps. Call it once, after
        the job's last step, with no step in flight (`fit` does; a custom
        loop calls it after its last `join`).

        Returns:
          Lines for the console (empty when there is no last round).
        """
        return final_round.finish(
            self.config,
            self.strategy.num_workers,
            self._dense,
            self._stream,
            self._refetch,
        )

    def worker_variables(self) -> dict[str, tf.Variable]:
        """Every per-worker variable (a replica's state) by key (position)."""
        named = {"seen": self._seen, "refetch": self._refetch}
        named.update({f"stats/{n}": v for n, v in self._stats.items()})
        if self._compression is not None:
            named.update(self._compression.worker_variables())
        if self._sparse is not None:
            named.update(self._sparse.worker_variables())
        if self._stream is not None:
            named.update(self._stream.worker_variables())
        return named | self._dense.worker_variables() | self._rows.worker_variables()

    def stats(self) -> list[ReplicaStats]:
        """Reads every replica's counters (blocking). Index = worker index.

        Empty before the replicas exist, and when a worker was lost since its
        last step (killed, or hung and given up): its counters went with it,
        and the coordinator recreates them, at zero, only once it is back.
        """
        if not tf_variables.per_worker_values_exist(self._stats["steps"]):
            return []
        try:
            columns = {
                name: [int(x.numpy()) for x in v.read_all()]
                for name, v in self._stats.items()
            }
            counted = self._sparse or self._stream
            if counted is not None:
                counter = counted.bytes_counter
                sparse_bytes = [int(x.numpy()) for x in counter.read_all()]
        except (
            tf.errors.CancelledError,
            tf.errors.UnavailableError,
            tf.errors.AbortedError,
        ):
            # "The corresponding function is aborted", the worker is gone, or
            # it was restarted and the coordinator has not reconnected yet
            # ("Unable to find a context_id").
            return []
        dense_bytes = self._dense.nbytes
        result = []
        for i in range(len(columns["steps"])):
            s = ReplicaStats(**{name: columns[name][i] for name in _STAT_NAMES})
            s.bytes_fetched = s.fetches * dense_bytes + s.row_bytes_fetched
            if counted is not None:  # What the fetches moved, counted.
                s.bytes_fetched = sparse_bytes[i] + s.row_bytes_fetched
            s.bytes_pushed = s.pushes * self._exchange.push_nbytes + s.row_bytes_pushed
            result.append(s)
        return result
