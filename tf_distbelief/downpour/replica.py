"""Downpour SGD on `DistBeliefStrategy` (Dean et al. 2012, section 4.1).

The step order is defined in `tf_distbelief.downpour.schedule` (with a NumPy
reference); this module runs it on a parameter-server cluster:

* every ps variable is a `downpour_variables.DownpourVariable` (see `enable`),
  which reads as the replica's cache during the forward pass;
* each worker keeps its cache, its accumulator and its counters in
  `per_worker_variable=True` variables, so the cadence is counted by the worker
  that runs the step, whichever worker the coordinator hands it to;
* the ps keeps an update counter (one per push), for staleness;
* a push runs the user's tf_keras optimizer (`update_step`, on each variable's
  ps shard) inside `tf.cond`, so a non-push step sends no gradient;
  `tf_distbelief.adagrad.Adagrad` grows its accumulator by the squared
  gradients of the pushed steps, sent along (`apply_gradient_and_squares`,
  `DownpourConfig.adagrad_accumulator`);
* the local step on the cache is AdaGrad with a per-worker accumulator
  (`DownpourConfig.local_optimizer`);
* under `fit` with `n_fetch, n_push > 1`, the local steps between two ps
  exchanges run in a loop with no ps op at all (`Downpour.run_steps`): a ps op
  in a step, even in a branch not taken, costs messages at every step;
* row-sparse variables (embedding tables, see `Downpour`'s `row_sparse`) are
  not cached whole: a step fetches the rows it looks up (once between two
  fetches) and a push sends the rows touched since the last one, so such a
  model's steps each exchange its looked-up rows with the ps.

Example with `fit`:
  ```
  strategy = tfdb.DistBeliefStrategy(resolver)
  downpour.enable(strategy)  # before any variable is created
  with strategy.scope():
    model = digits.build_model()
    model.compile(tfdb.Adagrad(0.1), loss=..., metrics=["accuracy"])
    replicas = downpour.install(model, downpour.DownpourConfig(4, 4))
  model.fit(dataset, epochs=5, steps_per_epoch=100)
  print(replicas.stats())
  ```
"""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import tensorflow as tf
import tf_keras

from tf_distbelief import _tf_internals
from tf_distbelief.adagrad import optimizer as adagrad
from tf_distbelief.downpour import variables as downpour_variables
from tf_distbelief.downpour.schedule import DownpourConfig, ReplicaStats
from tf_distbelief.downpour.variables import enable

__all__ = [
    "Downpour",
    "DownpourConfig",
    "DownpourMetrics",
    "DownpourTrainer",
    "ReplicaStats",
    "embedding_tables",
    "enable",
    "install",
]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name.split(":")[0])


_STAT_NAMES = (
    "steps",
    "fetches",
    "pushes",
    "dropped_pushes",
    "staleness_sum",
    "max_staleness_seen",
    "row_bytes_fetched",
    "row_bytes_pushed",
)


def _read(handle, dtype):
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def _assign(handle, value):
    return tf.raw_ops.AssignVariableOp(resource=handle, value=value)


def _add(handle, value):
    return tf.raw_ops.AssignAddVariableOp(resource=handle, value=value)


def _pack(tensors):
    """One flat tensor of `tensors` (a single tensor is only flattened)."""
    flat = [tf.reshape(x, [-1]) for x in tensors]
    return flat[0] if len(flat) == 1 else tf.concat(flat, 0)


def _unpack(packed, indices, variables):
    """Splits `_pack`'s output back into tensors of `variables[i]`'s shapes."""
    shapes = [variables[i].shape for i in indices]
    if len(shapes) == 1:
        return [tf.reshape(packed, shapes[0])]
    sizes = [s.num_elements() for s in shapes]
    return [tf.reshape(x, s) for x, s in zip(tf.split(packed, sizes), shapes)]


def _scatter(kind, handle, indices, updates):
    """`ResourceScatter{kind}` of `updates` rows at `indices` of a variable."""
    op = getattr(tf.raw_ops, f"ResourceScatter{kind}")
    return op(resource=handle, indices=indices, updates=updates)


def _gather(handle, indices, dtype):
    return tf.raw_ops.ResourceGather(resource=handle, indices=indices, dtype=dtype)


def _tensors(values):
    """The tensors of `values` (tensors or `IndexedSlices`), for control edges."""
    return [v.values if isinstance(v, tf.IndexedSlices) else v for v in values]


def _after(ops, value):
    """`value` as a tensor that runs after `ops` (a `tf.cond` branch output)."""
    with tf.control_dependencies(ops):
        return tf.identity(value)


class _Handles(NamedTuple):
    """Resource handles of one scheduled function (see `Downpour._handles`)."""

    caches: list  # Per-worker caches, one per variable.
    accs: list  # Per-worker accumulators, one per variable.
    squares: list  # Per-worker, one per variable: the local AdaGrad
    # accumulator at the last push (a local AdaGrad step), else the sum of
    # squared gradients since the last push; None without `push_squares`.
    local_accs: list  # Per-worker AdaGrad accumulators of the local step, one
    # per variable; None with a local SGD step.
    valid: list  # Row-sparse variables: per-worker rows fetched (1) since a
    # fetch; None for the others.
    touched: list  # Row-sparse: per-worker rows touched (1) since a push.
    seen: tf.Tensor  # Per-worker: the ps update count the cache accounts for.
    refetch: tf.Tensor  # Per-worker: 1 after a dropped push.
    stats: dict  # Per-worker counters, by name.
    dtypes: list  # The variables' dtypes.
    ps: list  # The ps variables (shards), one per variable.
    count: tf.Tensor  # On the ps: pushes applied.


class _RowReader(downpour_variables.RowSource):
    """A row-sparse variable's reads during one step's forward pass.

    Each lookup fetches, from the variable's ps task, the rows of its ids not
    fetched since the replica's last fetch, writes them into the replica's
    cache, and returns the rows from the cache, watched by the step's tape.
    Args are the `Downpour`, the variable's index, the step's handles, ops the
    reads must follow, and `active` (None, or a bool scalar: False fetches
    nothing, for a replica waiting for the warm start).
    """

    def __init__(self, replicas, index, h, after, active=None):
        self.replicas, self.index, self.h = replicas, index, h
        self.after, self.active = list(after), active
        self.tape = None  # Set by `Downpour._gradient`.
        self.reads = []  # (flat int64 ids, rows [n, *row_shape]) per lookup.
        self.bytes_fetched = []  # int64 scalars, one per lookup.

    def read_rows(self, indices):
        d, i, h = self.replicas, self.index, self.h
        v = d.variables[i]
        row_shape = v.shape[1:]
        # `tf.nn.embedding_lookup` colocates its gathers with the variable: the
        # cache's ops stay on the worker, only the missing rows' gather on the ps.
        with tf.compat.v1.colocate_with(None, ignore_existing=True):
            ids = tf.cast(tf.reshape(indices, [-1]), tf.int64)
            with tf.control_dependencies(self.after):
                unique, _ = tf.unique(ids)
                missing = tf.equal(_gather(h.valid[i], unique, tf.int32), 0)
                if self.active is not None:
                    missing &= self.active
                missing = tf.boolean_mask(unique, missing)
                with tf.device(v.device):
                    rows = _gather(h.ps[i], missing, v.dtype)
                nbytes = tf.size(missing, out_type=tf.int64) * d.row_bytes[i]
                ops = [
                    _scatter("Update", h.caches[i], missing, rows),
                    _scatter(
                        "Update", h.valid[i], missing, tf.ones_like(missing, tf.int32)
                    ),
                    _add(h.stats["row_bytes_fetched"], nbytes),
                ]
            with tf.control_dependencies(ops):
                out = _gather(h.caches[i], ids, v.dtype)
            self.after = [out]
            self.tape.watch(out)
            self.reads.append((ids, out))
            self.bytes_fetched.append(nbytes)
            shape = tf.concat([tf.shape(indices), row_shape.as_list()], 0)
            return tf.reshape(out, shape)

    def gradient(self, row_grads):
        """The step's gradient as `IndexedSlices` with unique int64 indices."""
        v = self.replicas.variables[self.index]
        row_shape = v.shape[1:].as_list()
        if not self.reads:
            ids = tf.zeros([0], tf.int64)
            grads = tf.zeros([0, *row_shape], v.dtype)
        else:
            ids = tf.concat([ids for ids, _ in self.reads], 0)
            grads = tf.concat([tf.reshape(g, [-1, *row_shape]) for g in row_grads], 0)
        unique, position = tf.unique(ids)
        summed = tf.math.unsorted_segment_sum(grads, position, tf.size(unique))
        return tf.IndexedSlices(
            summed, unique, tf.constant(v.shape.as_list(), tf.int64)
        )


class Downpour:
    """The per-replica state of Downpour SGD and its step.

    Create it under the strategy's scope, after the model's variables (created
    with `enable` in effect); call `step` inside a function the coordinator
    schedules on a worker (as `fit` does, or `DownpourTrainer`).

    Args:
      strategy: the `DistBeliefStrategy` the variables live on.
      variables: the trained ps variables (`model.trainable_variables`).
      optimizer: a tf_keras optimizer (e.g. `tf_distbelief.Adagrad`) applied on
        the ps to each push; it is built here if it is not yet.
      config: a `DownpourConfig`.
      row_sparse: variables among `variables` (e.g. embedding tables, whole or
        sharded) that the model only reads by row lookups
        (`tf.nn.embedding_lookup`; `tf.gather` only on an unsharded table, as
        TensorFlow's gather from a `ShardedVariable` returns rows in shard
        order): they are not fetched whole.
        Each step fetches the rows its batch looks up that the replica has not
        fetched since its last fetch, and a push sends only the rows touched
        since the last push, as `tf.IndexedSlices` to the optimizer's sparse
        update (see `downpour_schedule` for the exact order). The replica
        still holds a cache and an accumulator of the table's shape (worker
        memory), but the traffic is rows only.

    Raises:
      TypeError: a variable was not created with `enable(strategy)` in effect,
        `config` is not a `DownpourConfig`, or `row_sparse` holds something
        other than variables.
      ValueError: a `row_sparse` variable is not among `variables`, or is a
        scalar; or `config.local_learning_rate` is None with a local AdaGrad
        step and an optimizer whose learning rate is a schedule.

    A step that reads a row-sparse variable whole raises
    `downpour_variables.RowSparseReadError` (a RuntimeError) naming it.

    Worker memory, per replica: the cache and the gradient accumulator, plus
    the local AdaGrad accumulator (`config.local_optimizer == "adagrad"`) and,
    with `push_squares`, that accumulator's value at the last push (the
    pushed squares are its growth since; with a local SGD step, a sum of
    squared gradients instead): up to 4 copies of the model. The local step
    size is `config.local_learning_rate_for` the optimizer's learning rate
    (`local_learning_rate`); the local AdaGrad takes
    the optimizer's `initial_accumulator_value` and `epsilon` (0.1 and 1e-7
    for an optimizer without them).
    """

    def __init__(
        self, strategy, variables, optimizer, config: DownpourConfig, row_sparse=()
    ):
        if not isinstance(config, DownpourConfig):
            raise TypeError(
                f"Argument `config` must be a DownpourConfig. Received: {config!r}"
            )
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
        sharded = _tf_internals.ShardedVariable
        if isinstance(row_sparse, (tf.Variable, sharded)):
            row_sparse = [row_sparse]
        for v in row_sparse:
            if not isinstance(v, (tf.Variable, sharded)):
                raise TypeError(
                    "Argument `row_sparse` must be a list of variables (e.g. "
                    f"`[layer.embeddings]`), not names or layers. Received: {v!r}"
                )
        known = {id(v) for v in self.variables}
        sparse = {id(v) for v in downpour_variables.leaf_variables(row_sparse)}
        for v in downpour_variables.leaf_variables(row_sparse):
            if id(v) not in known or not v.shape.rank:
                raise ValueError(
                    "Argument `row_sparse` must hold trained variables of rank >= 1 "
                    f"(tables of rows). Received: {v.name} of shape {v.shape}"
                )
        # Per variable: row-sparse or not, and the bytes of one row.
        self.row_sparse = [id(v) in sparse for v in self.variables]
        self.row_bytes = [
            v.shape[1:].num_elements() * v.dtype.size if v.shape.rank else 0
            for v in self.variables
        ]
        # Bytes moved by one fetch or one push: every variable but the
        # row-sparse ones, once.
        self.dense_bytes = sum(
            v.shape.num_elements() * v.dtype.size
            for v, rows in zip(self.variables, self.row_sparse)
            if not rows
        )
        # A push sends the squared gradients too (as many bytes again) only
        # where AdaGrad on the ps can use them.
        self.push_squares = config.pushes_squares and isinstance(
            optimizer, adagrad.Adagrad
        )
        self.push_copies = 2 if self.push_squares else 1
        # With a local AdaGrad step the squares to push are the growth of its
        # accumulator since the last push: no per-step work of their own.
        self.squares_from_local = (
            self.push_squares and config.local_optimizer == "adagrad"
        )
        self.local_learning_rate = config.local_learning_rate_for(
            _numeric_learning_rate(optimizer)
        )
        # The local AdaGrad step starts and guards as the ps AdaGrad does.
        self.local_initial_accumulator = float(
            getattr(optimizer, "initial_accumulator_value", 0.1)
        )
        self.local_epsilon = float(getattr(optimizer, "epsilon", 1e-7))
        with strategy.scope():
            if not getattr(optimizer, "_built", False):
                optimizer.build(variables)

            def per_worker(name, shape, dtype, fill=0):
                return tf.Variable(
                    initial_value=lambda: tf.fill(shape, tf.cast(fill, dtype)),
                    shape=shape,
                    dtype=dtype,
                    trainable=False,
                    name=name,
                    per_worker_variable=True,
                )

            def copies(what, fill=0, enabled=True):
                """A per-worker variable of each variable's shape, or Nones."""
                return [
                    per_worker(
                        f"downpour/{what}/{_slug(v.name)}", v.shape, v.dtype, fill
                    )
                    if enabled
                    else None
                    for v in self.variables
                ]

            self._caches = copies("cache")
            self._accumulators = copies("accumulator")
            self._squares = copies(
                "squares",
                self.local_initial_accumulator if self.squares_from_local else 0,
                self.push_squares,
            )
            self._local_accumulators = copies(
                "local_accumulator",
                self.local_initial_accumulator,
                config.local_optimizer == "adagrad",
            )
            self._valid, self._touched = [
                [
                    per_worker(
                        f"downpour/{what}/{_slug(v.name)}", v.shape[:1], tf.int32
                    )
                    if rows
                    else None
                    for v, rows in zip(self.variables, self.row_sparse)
                ]
                for what in ("valid", "touched")
            ]
            # Per worker, int64 scalars: `seen` is the ps update count the cache
            # accounts for; `refetch` is 1 after a dropped push.
            self._seen = per_worker("downpour/seen", [], tf.int64)
            self._refetch = per_worker("downpour/refetch", [], tf.int64)
            self._stats = {
                name: per_worker(f"downpour/{name}", [], tf.int64)
                for name in _STAT_NAMES
            }
            # On the ps, int64 scalars: pushes applied, and replica 0's steps
            # during the warm start.
            self.update_count = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="downpour/update_count"
            )
            self.warm_steps = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="downpour/warm_steps"
            )

    @property
    def runs_segments(self) -> bool:
        """True when `run_steps` applies: `n_fetch, n_push > 1`, no warm start."""
        cfg = self.config
        return cfg.n_fetch > 1 and cfg.n_push > 1 and not cfg.warmstart_steps

    def _handles(self) -> _Handles:
        # Per-worker handles are taken at the top of the scheduled function:
        # taken inside a `tf.cond` branch or a loop body they would not resolve
        # to the running worker.
        return _Handles(
            caches=[c.handle for c in self._caches],
            accs=[a.handle for a in self._accumulators],
            squares=[None if x is None else x.handle for x in self._squares],
            local_accs=[
                None if x is None else x.handle for x in self._local_accumulators
            ],
            valid=[None if x is None else x.handle for x in self._valid],
            touched=[None if x is None else x.handle for x in self._touched],
            seen=self._seen.handle,
            refetch=self._refetch.handle,
            stats={name: v.handle for name, v in self._stats.items()},
            dtypes=[v.dtype for v in self.variables],
            ps=[v.get().handle for v in self.variables],
            count=self.update_count.get().handle,
        )

    def _fetch(self, h: _Handles, pack: bool):
        """`(values, ops)` of a fetch: worker-side parameters and bookkeeping."""
        values = self._pull(h.ps, h.dtypes, pack)
        ops = [
            _assign(h.seen, _read(h.count, tf.int64)),
            _assign(h.refetch, tf.constant(0, tf.int64)),
            _add(h.stats["fetches"], tf.constant(1, tf.int64)),
        ]
        # Row-sparse variables: every row is stale now, fetched when read.
        ops += [
            self._clear_rows(valid, i)
            for i, valid in enumerate(h.valid)
            if valid is not None
        ]
        return values, ops

    def _clear_rows(self, handle, i):
        """Zeroes a per-row int32 mask (`valid`, `touched`) of variable `i`."""
        return _assign(handle, tf.zeros(self.variables[i].shape[:1], tf.int32))

    def _fetch_into_cache(self, h: _Handles):
        """A fetch into the cache, as a `tf.cond` branch (returns True)."""
        values, ops = self._fetch(h, pack=True)
        ops += [_assign(c, v) for c, v in zip(h.caches, values) if v is not None]
        return _after(ops, True)

    def _cached_values(self, h: _Handles, after, active=None):
        """What the forward pass reads: the cache, after `after` ops.

        A tensor per variable, a `_RowReader` per row-sparse one.
        """
        with tf.control_dependencies(after):
            return [
                _RowReader(self, i, h, after, active)
                if rows
                else _read(h.caches[i], h.dtypes[i])
                for i, rows in enumerate(self.row_sparse)
            ]

    def _accumulated(self, h: _Handles):
        """`(grads, squares)` to push: tensors, `IndexedSlices` if row-sparse.

        `squares` is None without `push_squares`.
        """
        grads, squares = [], []
        for i, v in enumerate(self.variables):
            handles = [h.accs[i]]
            if self.push_squares:
                handles.append(h.squares[i])
            if self.squares_from_local:
                handles.append(h.local_accs[i])
            if not self.row_sparse[i]:
                values = [_read(x, h.dtypes[i]) for x in handles]
            else:
                rows = tf.where(_read(h.touched[i], tf.int32) > 0)[:, 0]
                values = [_gather(x, rows, v.dtype) for x in handles]
            if self.squares_from_local:
                # The local accumulator's growth since the last push.
                values = [values[0], values[2] - values[1]]
            if self.row_sparse[i]:
                shape = tf.constant(v.shape.as_list(), tf.int64)
                values = [tf.IndexedSlices(x, rows, shape) for x in values]
            grads.append(values[0])
            squares.append(values[-1])
        return grads, squares if self.push_squares else None

    def _gradient(self, forward_fn, values):
        """`(loss, outputs, grads)` of `forward_fn` at the parameter `values`.

        A `_RowReader` in `values` gives its gradient as `IndexedSlices`.
        """
        readers = [v for v in values if isinstance(v, _RowReader)]
        dense = [v for v in values if not isinstance(v, _RowReader)]
        with tf.GradientTape() as tape:
            tape.watch(dense)
            for reader in readers:
                reader.tape = tape
            with downpour_variables.substitute(zip(self.variables, values)):
                loss, outputs = forward_fn()
        rows = [out for reader in readers for _, out in reader.reads]
        grads = tape.gradient(
            loss, dense + rows, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        dense_grads, row_grads = iter(grads[: len(dense)]), grads[len(dense) :]
        out = []
        for v in values:
            if isinstance(v, _RowReader):
                out.append(v.gradient(row_grads[: len(v.reads)]))
                row_grads = row_grads[len(v.reads) :]
            else:
                # A lookup in a cached table gives `IndexedSlices`: made dense,
                # since the cache and accumulator are.
                out.append(tf.convert_to_tensor(next(dense_grads)))
        return loss, outputs, out

    @staticmethod
    def _row_bytes_fetched(values):
        """Row bytes the readers in `values` fetched, an int64 scalar."""
        counts = [
            n for v in values if isinstance(v, _RowReader) for n in v.bytes_fetched
        ]
        return tf.add_n(counts) if counts else tf.constant(0, tf.int64)

    def _local_ops(self, h: _Handles, grads, accumulate: bool, update_cache: bool):
        """Accumulates `grads` (and their squares) and takes the local step.

        The local step on the cache is AdaGrad with the replica's own
        accumulator, or SGD (`DownpourConfig.local_optimizer`).
        """
        lr = self.local_learning_rate
        adagrad_step = self.config.local_optimizer == "adagrad"
        step = bool(lr) and update_cache
        ops = []
        for i, g in enumerate(grads):
            sparse = isinstance(g, tf.IndexedSlices)
            dtype = g.values.dtype if sparse else g.dtype
            alpha, epsilon = tf.cast(lr, dtype), tf.cast(self.local_epsilon, dtype)
            # Where this step's squared gradient goes: the squares to push, or
            # the local accumulator when no local AdaGrad step grows it.
            squares_into = None
            if accumulate and self.push_squares and not self.squares_from_local:
                squares_into = h.squares[i]
            elif accumulate and self.squares_from_local and not step:
                squares_into = h.local_accs[i]
            if sparse:
                if accumulate:
                    ones = tf.ones_like(g.indices, tf.int32)
                    ops += [
                        _scatter("Add", h.accs[i], g.indices, g.values),
                        _scatter("Update", h.touched[i], g.indices, ones),
                    ]
                if squares_into is not None:
                    squared = g.values * g.values
                    ops.append(_scatter("Add", squares_into, g.indices, squared))
                if step and adagrad_step:
                    ops.append(
                        tf.raw_ops.ResourceSparseApplyAdagradV2(
                            var=h.caches[i],
                            accum=h.local_accs[i],
                            lr=alpha,
                            epsilon=epsilon,
                            grad=g.values,
                            indices=g.indices,
                        )
                    )
                elif step:
                    ops.append(
                        _scatter("Sub", h.caches[i], g.indices, alpha * g.values)
                    )
                continue
            if accumulate:
                ops.append(_add(h.accs[i], g))
            if squares_into is not None:
                ops.append(_add(squares_into, g * g))
            if step and adagrad_step:
                ops.append(
                    tf.raw_ops.ResourceApplyAdagradV2(
                        var=h.caches[i],
                        accum=h.local_accs[i],
                        lr=alpha,
                        epsilon=epsilon,
                        grad=g,
                    )
                )
            elif step:
                ops.append(
                    tf.raw_ops.ResourceApplyGradientDescent(
                        var=h.caches[i], alpha=alpha, delta=g
                    )
                )
        return ops

    def _push(self, h: _Handles, pushed, zero_accumulators: bool, pack: bool):
        """Pushes `pushed`, `(grads, squares)` (`_accumulated`), unless too stale.

        Returns `(staleness, applied, row_bytes)`: `row_bytes` is what the
        push sent of row-sparse variables (rows, their squares with
        `push_squares`, and int64 indices), 0 if dropped.

        Staleness is the number of pushes by other replicas between this
        replica's fetch and its push. Without `max_staleness` it is read back
        with the update, in the same round trip: the ps update count after
        this push's increment, less 1, less the count at the fetch (a push
        landing between the increment and the read is counted too). With
        `max_staleness` it is read before the push, which then waits for it.
        """
        int64, one = tf.int64, tf.constant(1, tf.int64)
        values, squares = pushed
        row_bytes = [
            tf.size(g.indices, out_type=int64)
            * (self.push_copies * self.row_bytes[i] + 8)
            for i, g in enumerate(values)
            if isinstance(g, tf.IndexedSlices)
        ]
        row_bytes = tf.add_n(row_bytes) if row_bytes else tf.constant(0, int64)
        if self.config.max_staleness is None:
            arrived = self._apply(values, squares, pack)
            # Counted once the push has reached the ps, not before: a control
            # edge on a tensor already there costs no message (one per ps
            # task otherwise).
            with tf.control_dependencies(arrived[:1]):
                increment = _add(h.count, one)
            with tf.control_dependencies([increment]):
                count = _read(h.count, int64)
            staleness = count - one - _read(h.seen, int64)
            ops = [
                _add(h.seen, one),
                _add(h.stats["pushes"], one),
                _add(h.stats["row_bytes_pushed"], row_bytes),
            ]
            applied = _after(ops, True)
        else:
            staleness = _read(h.count, int64) - _read(h.seen, int64)

            def apply_push():
                self._apply(values, squares, pack)
                ops = [
                    _add(h.count, one),
                    _add(h.seen, one),
                    _add(h.stats["pushes"], one),
                    _add(h.stats["row_bytes_pushed"], row_bytes),
                ]
                return _after(ops, True)

            def drop_push():
                ops = [_assign(h.refetch, one), _add(h.stats["dropped_pushes"], one)]
                return _after(ops, False)

            applied = tf.cond(
                staleness <= self.config.max_staleness, apply_push, drop_push
            )
        with tf.control_dependencies([applied]):
            ops = [
                _add(h.stats["staleness_sum"], staleness),
                _assign(
                    h.stats["max_staleness_seen"],
                    tf.maximum(staleness, _read(h.stats["max_staleness_seen"], int64)),
                ),
            ]
            if zero_accumulators:
                for i, v in enumerate(values):
                    ops += self._restart_accumulators(h, i, v)
        with tf.control_dependencies(ops):
            sent = tf.where(applied, row_bytes, tf.constant(0, int64))
            return tf.identity(staleness), tf.identity(applied), sent

    def _restart_accumulators(self, h: _Handles, i: int, pushed) -> list:
        """Ops that start variable `i`'s accumulators anew after a push.

        The gradient sum (and a sum of squares) go to 0; with
        `squares_from_local` the local accumulator's value is kept as the
        base of the next push's squares. `pushed` is the pushed gradient (its
        rows, if `IndexedSlices`).
        """
        handles = [h.accs[i]]
        if self.push_squares and not self.squares_from_local:
            handles.append(h.squares[i])
        dtype = h.dtypes[i]
        if isinstance(pushed, tf.IndexedSlices):
            rows = pushed.indices
            zeros = tf.zeros_like(pushed.values)
            ops = [_scatter("Update", x, rows, zeros) for x in handles]
            if self.squares_from_local:
                base = _gather(h.local_accs[i], rows, dtype)
                ops.append(_scatter("Update", h.squares[i], rows, base))
            return ops + [self._clear_rows(h.touched[i], i)]
        ops = [_assign(x, tf.zeros_like(pushed)) for x in handles]
        if self.squares_from_local:
            ops.append(_assign(h.squares[i], _read(h.local_accs[i], dtype)))
        return ops

    def _no_push(self):
        int64 = tf.int64
        return tf.constant(-1, int64), tf.constant(False), tf.constant(0, int64)

    def step(self, forward_fn):
        """One local Downpour step of the worker it runs on.

        Every op that touches the ps sits in a `tf.cond` branch that runs only
        on a fetch or push step, and such a fetch or push moves one packed
        tensor per ps task (`_pull`, `_push_values`): the branch not taken
        still exchanges a dead-tensor message per cross-device edge at every
        step, so fewer edges make the steps between fetches and pushes cheaper.
        With `n_fetch == 1` (and no warm start) the cache would be overwritten
        at every step, so the forward pass reads the fetched values directly
        and the local update is skipped; with `n_push == 1` the gradient is
        pushed without going through the accumulator. Both give the same
        parameters.

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
        t = _read(h.stats["steps"], int64)
        if cfg.warmstart_steps:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            is_first = tf.equal(worker, 0)
            warm = self.warm_steps.get().handle
            active = is_first | (_read(warm, int64) >= cfg.warmstart_steps)
            warm_op = tf.cond(
                is_first & (t < cfg.warmstart_steps),
                lambda: _after([_add(warm, one)], True),
                lambda: tf.constant(False),
            )
        else:
            active = None  # Every step is active: no `tf.cond` on it.
            warm_op = tf.constant(True)

        def gated(pred):
            return pred if active is None else active & pred

        # The cache is needed across steps unless every step fetches.
        use_cache = cfg.n_fetch > 1 or active is not None
        if use_cache:
            do_fetch = gated(
                tf.equal(t % cfg.n_fetch, 0) | (_read(h.refetch, int64) > 0)
            )
            fetched = tf.cond(
                do_fetch,
                lambda: self._fetch_into_cache(h),
                lambda: tf.constant(False),
            )
            values = self._cached_values(h, [fetched, warm_op], active)
        else:
            values, ops = self._fetch(h, pack=False)
            fetched = _after(ops, True)
            values = [
                _RowReader(self, i, h, [fetched]) if rows else values[i]
                for i, rows in enumerate(self.row_sparse)
            ]
        loss, outputs, grads = self._gradient(forward_fn, values)
        # The gradient is pushed as it is unless pushes gather several steps.
        use_accumulator = cfg.n_push > 1 or active is not None
        if active is None:
            # After the gradient even without local ops: the push (and, with
            # `max_staleness`, its staleness check) must not run before it.
            ops = self._local_ops(h, grads, use_accumulator, use_cache)
            updated = _after(ops + _tensors(grads), 1)
        else:
            updated = tf.cond(
                active,
                lambda: _after(self._local_ops(h, grads, use_accumulator, True), 1),
                lambda: tf.constant(0),
            )
        with tf.control_dependencies([updated]):
            if cfg.n_push == 1 and active is None:
                staleness, pushed, rows_pushed = self._push(
                    h, (grads, None), zero_accumulators=False, pack=False
                )
            else:
                staleness, pushed, rows_pushed = tf.cond(
                    gated(tf.equal((t + 1) % cfg.n_push, 0)),
                    lambda: self._push(
                        h, self._accumulated(h), zero_accumulators=True, pack=True
                    ),
                    self._no_push,
                )
        with tf.control_dependencies([staleness]):
            if active is None:
                counted = _after([_add(h.stats["steps"], one)], 1)
            else:
                counted = tf.cond(
                    active,
                    lambda: _after([_add(h.stats["steps"], one)], 1),
                    lambda: tf.constant(0),
                )
        with tf.control_dependencies([counted]):
            zero = tf.constant(0, int64)
            dense_bytes = tf.constant(self.dense_bytes, int64)
            push_bytes = tf.constant(self.push_copies * self.dense_bytes, int64)
            rows_fetched = self._row_bytes_fetched(values)
            metrics = {
                "staleness": tf.identity(staleness),
                "bytes_fetched": tf.where(fetched, dense_bytes, zero) + rows_fetched,
                "bytes_pushed": tf.where(pushed, push_bytes, zero) + rows_pushed,
            }
        return loss, outputs, metrics

    def run_steps(self, iterator, num_steps, forward_fn, last_step_fn=None):
        """Runs `num_steps` local steps on the running worker, in segments.

        What `fit` schedules when `runs_segments` (see `install`). The steps are
        cut into segments at fetch and push points: a segment starts with the
        fetch if one is due, runs its local steps, and ends with the push if
        one is due. Its steps but the last run in an inner loop that holds no
        ps op, so the ps takes part once per segment (of up to
        `min(n_fetch, n_push)` steps) instead of once per step: even a
        `tf.cond` branch not taken costs a message per step when it holds a ps
        op, and every write to a ps variable a round trip (row-sparse
        variables are the exception: each step gathers the rows it looks up
        and has not fetched since the segment's fetch). The parameters and
        counters are those of `step`, step for step.

        During those inner steps, writes to non-trainable ps variables (Keras
        metrics and loss trackers, BatchNorm statistics) are dropped
        (`downpour_variables.local_steps`); the last step of each segment makes
        them, so Keras metrics are computed on the last batch of each segment.

        Args:
          iterator: the per-worker dataset iterator.
          num_steps: steps to run, an int64 scalar >= 1.
          forward_fn: `data -> (loss, outputs)`, as for `step` with the batch.
          last_step_fn: optional `(data, outputs) -> None`, called (traced) for
            the last step of each segment, e.g. to update metrics.

        Returns:
          The steps run, an int64 scalar (`num_steps`).

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
                    values = self._cached_values(h, [])
                    loss, outputs, grads = self._gradient(
                        lambda: forward_fn(data), values
                    )
                    ops = self._local_ops(h, grads, True, True)
                    with tf.control_dependencies(ops):
                        ops.append(_add(h.stats["steps"], one))
                    if last and last_step_fn is not None:
                        with tf.control_dependencies(ops):
                            last_step_fn(data, outputs)
                return _after(ops, loss)

            return self.strategy.run(replica_fn, args=(data,))

        def segment(done):
            t = _read(h.stats["steps"], int64)
            do_fetch = tf.equal(t % cfg.n_fetch, 0) | (_read(h.refetch, int64) > 0)
            fetched = tf.cond(
                do_fetch,
                lambda: self._fetch_into_cache(h),
                lambda: tf.constant(False),
            )
            # Steps up to the next fetch or push point, or to the end.
            size = tf.minimum(
                tf.minimum(cfg.n_fetch - t % cfg.n_fetch, cfg.n_push - t % cfg.n_push),
                num_steps - done,
            )
            with tf.control_dependencies([fetched]):
                inner = tf.while_loop(
                    lambda i: i < size - 1,
                    lambda i: _after([local_step(next(iterator), False)], i + 1),
                    [tf.constant(0, int64)],
                )
            with tf.control_dependencies([inner]):
                last = local_step(next(iterator), True)
            with tf.control_dependencies([last]):
                staleness, _, _ = tf.cond(
                    tf.equal((t + size) % cfg.n_push, 0),
                    lambda: self._push(
                        h, self._accumulated(h), zero_accumulators=True, pack=True
                    ),
                    self._no_push,
                )
            return _after([staleness], done + size)

        (done,) = tf.while_loop(
            lambda done: done < num_steps, segment, [tf.constant(0, int64)]
        )
        return done

    def _groups(self):
        """`[(device, dtype, indices)]`: the variables moved as one tensor each."""
        groups = {}
        for i, v in enumerate(self.variables):
            if not self.row_sparse[i]:
                groups.setdefault((v.device, v.dtype), []).append(i)
        return [(device, dtype, idx) for (device, dtype), idx in groups.items()]

    def _pull(self, ps_handles, dtypes, pack: bool):
        """Reads every variable; returns worker-side values.

        With `pack` (a fetch in a `tf.cond` branch) each group's values are
        flattened and concatenated on its ps task and split again on the
        worker: one copy of the parameters on each side, traded for one
        transfer, and one dead-tensor message at every step without a fetch,
        per group instead of per variable. An unconditional fetch moves each
        variable as it is.
        """
        if not pack:
            return [
                None if rows else _read(p, d)
                for p, d, rows in zip(ps_handles, dtypes, self.row_sparse)
            ]
        values = [None] * len(self.variables)
        for device, _, idx in self._groups():
            with tf.device(device):
                reads = [_read(ps_handles[i], dtypes[i]) for i in idx]
                packed = _pack(reads)
            for i, part in zip(idx, _unpack(packed, idx, self.variables)):
                values[i] = part
        return values

    def _push_values(self, grads, pack: bool):
        """`grads` (worker tensors) as tensors on each variable's ps task.

        With `pack`, one message per group, as in `_pull`.
        """
        out = [None] * len(self.variables)
        for i, (g, v) in enumerate(zip(grads, self.variables)):
            if not pack or self.row_sparse[i]:
                with tf.device(v.device):
                    out[i] = tf.nest.map_structure(
                        tf.identity, g, expand_composites=True
                    )
        if not pack:
            return out
        for device, _, idx in self._groups():
            packed = _pack([grads[i] for i in idx])
            with tf.device(device):
                for i, part in zip(idx, _unpack(packed, idx, self.variables)):
                    out[i] = part
        return out

    def _apply(self, grads, squares, pack: bool) -> list:
        """Applies one push with the optimizer, variable by variable on its shard.

        The update ops (and the optimizer's casts of its hyperparameters) run
        on the variable's ps task, as `tf.distribute`'s `extended.update` would
        place them. With `n_push > 1`, `tf_distbelief.adagrad.Adagrad` grows
        its accumulator by the pushed `squares` (`apply_gradient_and_squares`)
        or counts the push as `n_push` updates (`apply_summed_gradient`), as
        `config.adagrad_accumulator` says. Gradient clipping, if the optimizer
        has it, applies to the gradients, not to their squares.

        Returns:
          The pushed gradients, as tensors on the variables' ps tasks.
        """
        opt = self.optimizer
        grads = self._push_values(_tf_internals.clip_gradients(opt, list(grads)), pack)
        if squares is not None:
            squares = self._push_values(squares, pack)
        mode = self.config.adagrad_accumulator
        steps = self.config.n_push if mode == "mean" else 1
        for i, (g, v) in enumerate(zip(grads, self.variables)):
            with tf.device(v.device):
                if squares is not None:
                    opt.apply_gradient_and_squares(g, squares[i], v)
                elif steps > 1 and isinstance(opt, adagrad.Adagrad):
                    opt.apply_summed_gradient(g, v, steps)
                else:
                    _tf_internals.update_step(opt, g, v)
        opt.iterations.assign_add(1)
        return grads

    def stats(self) -> list[ReplicaStats]:
        """Reads every replica's counters (blocking). Index = worker index."""
        if not _tf_internals.per_worker_values_exist(self._stats["steps"]):
            return []
        columns = {
            name: [int(x.numpy()) for x in v.read_all()]
            for name, v in self._stats.items()
        }
        result = []
        for i in range(len(columns["steps"])):
            s = ReplicaStats(**{name: columns[name][i] for name in _STAT_NAMES})
            s.bytes_fetched = s.fetches * self.dense_bytes + s.row_bytes_fetched
            s.bytes_pushed = (
                s.pushes * self.push_copies * self.dense_bytes + s.row_bytes_pushed
            )
            result.append(s)
        return result


def _numeric_learning_rate(optimizer) -> float | None:
    """The optimizer's learning rate as a float; None for a schedule."""
    lr = getattr(optimizer, "_learning_rate", None)
    if lr is None or isinstance(lr, tf_keras.optimizers.schedules.LearningRateSchedule):
        return None
    return float(tf_keras.backend.get_value(lr))


def _check_compiled(model):
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "Argument `model` must be compiled with an optimizer (the ps applies "
            "it to each push), e.g. `model.compile(tf_distbelief.Adagrad(0.1), "
            f"loss=...)`. Received an uncompiled model: {model.name!r}"
        )
    if not model.built:
        raise ValueError(
            f"Argument `model` must be built before Downpour can cache its "
            f"variables (give it an input shape). Received: {model.name!r}"
        )


def embedding_tables(model) -> list:
    """The tables of `model`'s trainable tf_keras `Embedding` layers.

    What `install` and `DownpourTrainer` treat as row-sparse by default.

    Args:
      model: a built tf_keras model.

    Returns:
      A list of variables (`ShardedVariable`s where the partitioner split them).
    """
    return [
        layer.embeddings
        for layer in model.submodules
        if isinstance(layer, tf_keras.layers.Embedding) and layer.trainable
    ]


def _make_downpour(model, config, row_sparse) -> Downpour:
    _check_compiled(model)
    return Downpour(
        model.distribute_strategy,
        model.trainable_variables,
        model.optimizer,
        config,
        row_sparse=embedding_tables(model) if row_sparse is None else row_sparse,
    )


def _make_train_step(model, replicas: Downpour, downpour_logs: bool):
    """A `train_step` running `Downpour.step`.

    Its logs are the model's metrics, plus, with `downpour_logs`, the step's
    `staleness`, `bytes_fetched` and `bytes_pushed` (for `DownpourTrainer`).
    Under `fit` they are left out: `fit` then replaces the last step's logs
    with the model's metrics at each epoch end, and the three are not sent
    back at every step (`DownpourMetrics` gives them per epoch).
    """
    import tf_keras

    def train_step(data):
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)

        def forward():
            y_pred = model(x, training=True)
            return model.compute_loss(x, y, y_pred, sample_weight), y_pred

        _, y_pred, metrics = replicas.step(forward)
        logs = dict(model.compute_metrics(x, y, y_pred, sample_weight))
        if downpour_logs:
            logs.update(metrics)
        return logs

    return train_step


def _make_segment_train_function(model, replicas: Downpour):
    """`model.make_train_function` running `Downpour.run_steps` under `fit`.

    It mirrors tf_keras's coordinator path (`Model.make_train_function`): one
    scheduled `tf.function` runs `steps_per_execution` steps. The model's
    train counter (a ps variable) grows once per scheduled function, by the
    steps it ran, rather than at every step; the function returns the model's
    metric results, which `fit` reads again at each epoch end.
    """
    import tf_keras

    unpack = tf_keras.utils.unpack_x_y_sample_weight

    def forward(data):
        x, y, sample_weight = unpack(data)
        y_pred = model(x, training=True)
        return model.compute_loss(x, y, y_pred, sample_weight), y_pred

    def update_metrics(data, y_pred):
        x, y, sample_weight = unpack(data)
        model.compute_metrics(x, y, y_pred, sample_weight)

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function

        @tf.function(reduce_retracing=True)
        def train_function(iterator, steps_per_execution):
            done = replicas.run_steps(
                iterator, steps_per_execution, forward, update_metrics
            )
            counter = _tf_internals.train_counter(model)
            with tf.control_dependencies(
                [counter.assign_add(tf.cast(done, counter.dtype))]
            ):
                return tf.nest.map_structure(tf.identity, model.get_metrics_result())

        coordinator = _tf_internals.cluster_coordinator(model)
        model.train_tf_function = train_function
        model.train_function = lambda iterator: coordinator.schedule(
            train_function,
            args=(iterator, _tf_internals.steps_per_execution(model).value()),
        )
        return model.train_function

    return make_train_function


def install(model, config: DownpourConfig, row_sparse=None) -> Downpour:
    """Makes `model.fit` train with Downpour SGD.

    The model must be built and compiled under the scope of a strategy on which
    `enable` was called before the model was created. With `n_fetch` or
    `n_push` 1, or a warm start, `fit` runs one local Downpour step
    (`Downpour.step`) per training step, on whichever worker the coordinator
    picks. Otherwise each scheduled function runs its steps in segments
    between fetches and pushes (`Downpour.run_steps`): the ps takes part once
    per segment, and Keras metrics are updated on the last batch of each
    segment. Either way the logs are the model's metrics; `DownpourMetrics`
    adds staleness and bytes moved per epoch.

    Args:
      model: a compiled, built tf_keras model.
      config: a `DownpourConfig`.
      row_sparse: the variables only read by row lookups, fetched and pushed
        by rows (see `Downpour`); None (default) means the tables of the
        model's trainable `Embedding` layers (`embedding_tables`), `[]` none.
        A list replaces the default: include `embedding_tables(model)` to add
        to it.

    Returns:
      The `Downpour` state; `.stats()` gives each replica's counters.

    Raises:
      ValueError: the model is not compiled or not built, or see `Downpour`.
      TypeError: see `Downpour`.
    """
    replicas = _make_downpour(model, config, row_sparse)
    # An instance attribute wins over `Model.train_step`; the cached train
    # function is dropped so that `fit` traces the new step.
    object.__setattr__(
        model, "train_step", _make_train_step(model, replicas, downpour_logs=False)
    )
    if replicas.runs_segments:
        object.__setattr__(
            model,
            "make_train_function",
            _make_segment_train_function(model, replicas),
        )
    model.train_function = None
    return replicas


class DownpourTrainer:
    """A custom training loop for Downpour SGD on a `ClusterCoordinator`.

    Example:
      ```
      trainer = downpour.DownpourTrainer(model, downpour.DownpourConfig(3, 2))
      iterator = iter(trainer.per_worker_dataset(dataset_fn))
      for _ in range(100):
        trainer.step(iterator)
      trainer.join()
      print(trainer.stats())
      ```

    Args:
      model: a compiled, built tf_keras model, as for `install`.
      config: a `DownpourConfig`.
      row_sparse: as for `install`.
    """

    def __init__(self, model, config: DownpourConfig, row_sparse=None):
        self.model = model
        self.strategy = model.distribute_strategy
        self.downpour = _make_downpour(model, config, row_sparse)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
            self.strategy
        )
        train_step = _make_train_step(model, self.downpour, downpour_logs=True)

        @tf.function
        def worker_fn(iterator):
            return self.strategy.run(train_step, args=(next(iterator),))

        self._worker_fn = worker_fn

    def per_worker_dataset(self, dataset_fn):
        """`ClusterCoordinator.create_per_worker_dataset` of this trainer."""
        return self.coordinator.create_per_worker_dataset(dataset_fn)

    def step(self, iterator):
        """Schedules one local step; returns the `RemoteValue` of its logs."""
        return self.coordinator.schedule(self._worker_fn, args=(iterator,))

    def join(self) -> None:
        """Waits for every scheduled step."""
        self.coordinator.join()

    def stats(self) -> list[ReplicaStats]:
        """Each replica's counters, after `join()`; see `Downpour.stats`."""
        return self.downpour.stats()


class DownpourMetrics(tf_keras.callbacks.Callback):
    """Adds each epoch's Downpour figures to the `fit` logs (and so TensorBoard).

    At every epoch end it reads the replicas' counters (`Downpour.stats`) and
    writes the epoch's figures (replacing per-step `staleness`,
    `bytes_fetched` and `bytes_pushed` values, should the logs hold any):

    * `replica{i}/staleness`: mean staleness of replica i's pushes in the epoch
      (ps updates by other replicas between its fetch and its push);
    * `replica{i}/steps`: steps replica i ran in the epoch;
    * `bytes_fetched_per_step`, `bytes_pushed_per_step`: parameter bytes moved
      per step over all replicas (tensor sizes; `benchmarks/downpour_bench.py`
      checks them against socket counters).

    Put it before the callback that prints or writes the logs.

    Args:
      replicas: the `Downpour` object `install` returned.
    """

    def __init__(self, replicas: Downpour):
        super().__init__()
        self.replicas = replicas
        self._last: list[ReplicaStats] = []

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        now = self.replicas.stats()
        last = self._last or [ReplicaStats() for _ in now]
        self._last = now
        steps = fetched = pushed = 0
        for i, (a, b) in enumerate(zip(now, last)):
            d_steps, d_pushes = a.steps - b.steps, a.pushes - b.pushes
            d_dropped = a.dropped_pushes - b.dropped_pushes
            stale = a.staleness_sum - b.staleness_sum
            logs[f"replica{i}/steps"] = d_steps
            logs[f"replica{i}/staleness"] = stale / max(d_pushes + d_dropped, 1)
            steps += d_steps
            fetched += a.bytes_fetched - b.bytes_fetched
            pushed += a.bytes_pushed - b.bytes_pushed
        for key in ("staleness", "bytes_fetched", "bytes_pushed"):
            logs.pop(key, None)
        logs["bytes_fetched_per_step"] = fetched / max(steps, 1)
        logs["bytes_pushed_per_step"] = pushed / max(steps, 1)
