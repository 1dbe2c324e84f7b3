"""What Downpour keeps per variable on a worker, and the ops common to its kinds.

Dean et al. 2012, section 4.1. A replica keeps, per trained variable, a cache
of the parameters, the sum of its gradients since its last push, and as the
`Plan` says, the squares to push and the accumulator of its local AdaGrad
step, all in `per_worker_variable=True` variables (one copy per worker, made
by the strategy), so whichever worker runs a step uses its own.

`VariableKind` holds that state for the variables of one kind and writes the
local step, the accumulation, the push's read and the restart once, from
three primitives on a variable's rows that each kind defines: `_read`,
`_write` and `_add`, with `rows` None for the whole variable:

* `dense.DenseVariables`: ordinary variables, fetched and pushed whole;
* `row_sparse.RowSparseVariables`: tables read by row lookups, fetched and
  pushed by rows.

The kinds issue raw resource ops on handles taken at the top of the scheduled
function (`handles`): per-worker variables get no automatic control
dependencies and cannot be captured inside a `tf.cond` branch or a loop body.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Sequence
from typing import NamedTuple

import tensorflow as tf

from tf_distbelief.adagrad import ops as adagrad_ops
from tf_distbelief.adagrad import optimizer as adagrad
from tf_distbelief.downpour import plan as plan_lib
from tf_distbelief.tf_internals import optimizers as tf_optimizers

__all__ = [
    "Handles",
    "KindHandles",
    "KindOrder",
    "VariableKind",
]


def read(handle, dtype):
    """`ReadVariableOp`: the value of a variable by its handle."""
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def assign(handle, value):
    """`AssignVariableOp`: writes `value` to a variable by its handle."""
    return tf.raw_ops.AssignVariableOp(resource=handle, value=value)


def add(handle, value):
    """`AssignAddVariableOp`: adds `value` to a variable by its handle."""
    return tf.raw_ops.AssignAddVariableOp(resource=handle, value=value)


def scatter(kind: str, handle, indices, updates):
    """`ResourceScatter{kind}` of `updates` rows at `indices` of a variable."""
    op = getattr(tf.raw_ops, f"ResourceScatter{kind}")
    return op(resource=handle, indices=indices, updates=updates)


def gather(handle, indices, dtype):
    """`ResourceGather`: the rows at `indices` of a variable by its handle."""
    return tf.raw_ops.ResourceGather(resource=handle, indices=indices, dtype=dtype)


def after(ops, value):
    """`value` as a tensor that runs after `ops` (a `tf.cond` branch output)."""
    with tf.control_dependencies(ops):
        return tf.identity(value)


def per_worker(name: str, shape, dtype, fill=0) -> tf.Variable:
    """A `per_worker_variable=True` variable filled with `fill`.

    Create it under the strategy's scope; not trainable.
    """
    return tf.Variable(
        initial_value=lambda: tf.fill(shape, tf.cast(fill, dtype)),
        shape=shape,
        dtype=dtype,
        trainable=False,
        name=name,
        per_worker_variable=True,
    )


def per_worker_copies(variables, what: str, fill=0, enabled: bool = True) -> list:
    """A per-worker variable of each variable's shape and dtype, or Nones."""
    return [
        per_worker(f"downpour/{what}/{slug(v.name)}", v.shape, v.dtype, fill)
        if enabled
        else None
        for v in variables
    ]


def slug(name: str) -> str:
    """`name` without its `:0` and characters a variable name cannot hold."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name.split(":")[0])


class KindHandles(NamedTuple):
    """Resource handles of one kind's variables in one scheduled function.

    Lists with one entry per variable of the kind, None where the `Plan`
    keeps no such variable.
    """

    ps: list  # The ps variables (shards).
    caches: list  # Per-worker caches.
    accs: list  # Per-worker sums of the gradients since the last push.
    squares: list  # Per-worker: `PushedSquares.SUMMED`'s sum or `LOCAL`'s base.
    local_accs: list  # Per-worker accumulators of the local AdaGrad step.
    valid: list | tuple = ()  # Row-sparse: per-worker rows fetched (1) since
    # a fetch.
    touched: list | tuple = ()  # Row-sparse: per-worker rows touched (1) since
    # a push.


class Handles(NamedTuple):
    """Resource handles of one scheduled function: both kinds', the counters."""

    dense: KindHandles
    rows: KindHandles
    seen: tf.Tensor  # Per-worker: the ps update count the cache accounts for.
    refetch: tf.Tensor  # Per-worker: 1 after a dropped push.
    stats: dict  # Per-worker int64 counters, by `ReplicaStats` field name.
    count: tf.Tensor  # On the ps: pushes applied.
    skipped: tf.Tensor  # On the ps: pushes refused for a NaN or inf.
    halted: tf.Tensor  # On the ps: 1 after a push refused with `raise`.
    worker: tf.Tensor  # The running worker's index (int64), for errors.
    # Per-worker residuals of compressed pushes, one per dense variable
    # (`push_rules.compression`); empty without compression.
    residuals: list | tuple = ()
    # Per-worker handles of sparse fetches (`sparse_fetch.SparseHandles`), or
    # None without them.
    sparse: object = None
    # Per-worker handles of update-stream fetches (`stream_fetch.StreamHandles`),
    # or None without them.
    stream: object = None


class KindOrder:
    """Where the variables of each kind sit among a replica's variables.

    Args:
      row_sparse: per variable, True where it is row-sparse.
    """

    def __init__(self, row_sparse: Sequence[bool]):
        self.row_sparse = list(row_sparse)

    def split(self, values: Sequence) -> tuple[list, list]:
        """`(dense, row-sparse)`: `values` (one per variable) split by kind."""
        return (
            [x for x, rows in zip(values, self.row_sparse) if not rows],
            [x for x, rows in zip(values, self.row_sparse) if rows],
        )

    def merge(self, dense: Sequence, rows: Sequence) -> list:
        """One value per variable, in variable order, from the kinds' lists."""
        dense, rows = iter(dense), iter(rows)
        return [next(rows) if sparse else next(dense) for sparse in self.row_sparse]


def _handle(variable):
    return None if variable is None else variable.handle


def ps_handle(variable):
    """The resource handle of a ps variable, wrapped (`DownpourVariable`) or not."""
    return variable.get().handle if hasattr(variable, "get") else variable.handle


class VariableKind(abc.ABC):
    """Downpour's per-worker state and ops for the variables of one kind.

    Create it under the strategy's scope. The lists the methods take and
    return hold one entry per variable of the kind, in `variables` order.

    Args:
      variables: the kind's `DownpourVariable`s (shards, not sharded
        variables).
      plan: the `Plan`.
    """

    def __init__(self, variables: list, plan: plan_lib.Plan):
        self.variables = list(variables)
        self.plan = plan
        squares = plan.squares
        self.caches = per_worker_copies(variables, "cache")
        self.accumulators = per_worker_copies(variables, "accumulator")
        self.squares = per_worker_copies(
            variables,
            "squares",
            plan.initial_accumulator if squares is plan_lib.PushedSquares.LOCAL else 0,
            squares is not plan_lib.PushedSquares.NONE,
        )
        self.local_accumulators = per_worker_copies(
            variables,
            "local_accumulator",
            plan.initial_accumulator,
            plan.local_optimizer == "adagrad",
        )

    kind = "kind"  # Prefixes the keys of `worker_variables`.

    def worker_variables(self) -> dict[str, tf.Variable]:
        """The per-worker variables (`replica_state` checkpoints them) by
        `kind/what/j`, `j` the variable's position in `variables` (layer
        names, `dense_1`, differ between two builds of one model)."""
        return {
            f"{self.kind}/{what}/{j}": x
            for what, kept in self._worker_lists()
            for j, x in enumerate(kept)
            if x is not None
        }

    def _worker_lists(self) -> list[tuple[str, list]]:
        names = ("cache", "accumulator", "squares", "local_accumulator")
        kept = (self.caches, self.accumulators, self.squares, self.local_accumulators)
        return list(zip(names, kept))

    def handles(self) -> KindHandles:
        """The handles; take them at the top of the scheduled function."""
        return KindHandles(
            ps=[v.get().handle for v in self.variables],
            caches=[c.handle for c in self.caches],
            accs=[a.handle for a in self.accumulators],
            squares=[_handle(x) for x in self.squares],
            local_accs=[_handle(x) for x in self.local_accumulators],
        )

    # The primitives: `rows` is None for the whole variable `j`, else int64
    # row indices; `grad` a tensor or `IndexedSlices`.

    @abc.abstractmethod
    def _read(self, handle, j: int, rows):
        """The value (or the rows) of a per-worker variable of variable `j`."""

    @abc.abstractmethod
    def _write(self, handle, rows, value):
        """Assigns `value` to a per-worker variable (or its rows)."""

    @abc.abstractmethod
    def _add(self, handle, grad):
        """Adds `grad` to a per-worker variable of a variable's shape."""

    @abc.abstractmethod
    def _sgd_step(self, cache, grad, alpha):
        """The local SGD step: `cache <- cache - alpha * grad`."""

    def _accumulate(self, kh: KindHandles, j: int, grad) -> list:
        """Ops adding `grad` to the sum to push (row-sparse: and its rows)."""
        return [self._add(kh.accs[j], grad)]

    def _pushed_rows(self, kh: KindHandles, j: int):
        """The rows a push of variable `j` sends; None for all of it."""
        return None

    def _restart_rows(self, kh: KindHandles, j: int) -> list:
        """Ops that start variable `j`'s row bookkeeping anew after a push."""
        return []

    def local_ops(
        self, kh: KindHandles, grads: list, accumulate: bool, update_cache: bool
    ) -> list:
        """Ops adding `grads` to the sums to push and taking the local step.

        Args:
          kh: the kind's handles.
          grads: one step's gradients.
          accumulate: add them to the sums to push (not when each step
            pushes its own gradient).
          update_cache: take the local step on the cache (not when each step
            fetches).

        Returns:
          The ops, in no particular order.
        """
        plan = self.plan
        step = bool(plan.learning_rate) and update_cache
        ops = []
        for j, g in enumerate(grads):
            dtype = self.variables[j].dtype
            alpha = tf.cast(plan.learning_rate, dtype)
            epsilon = tf.cast(plan.epsilon, dtype)
            if accumulate and not plan.pushes_deltas:
                ops += self._accumulate(kh, j, g)
            # Where this step's squared gradient goes: the squares to push,
            # or the local accumulator when no local AdaGrad step grows it.
            squares_into = None
            if accumulate and plan.squares is plan_lib.PushedSquares.SUMMED:
                squares_into = kh.squares[j]
            elif (
                accumulate and plan.squares is plan_lib.PushedSquares.LOCAL and not step
            ):
                squares_into = kh.local_accs[j]
            if squares_into is not None:
                ops.append(self._add(squares_into, _squared(g)))
            before = None
            if plan.pushes_deltas and accumulate:  # The cache's value before the step.
                before = self._read(kh.caches[j], j, None)
            with tf.control_dependencies([] if before is None else [before]):
                if step and plan.local_optimizer == "adagrad":
                    stepped = adagrad_ops.apply_adagrad(
                        kh.caches[j], kh.local_accs[j], g, alpha, epsilon
                    )
                elif step:
                    stepped = self._sgd_step(kh.caches[j], g, alpha)
                else:
                    stepped = tf.no_op()
            ops.append(stepped)
            if before is not None:
                # The outer optimizer's pseudo-gradient sums the local steps.
                with tf.control_dependencies([stepped]):
                    delta = before - self._read(kh.caches[j], j, None)
                ops.append(self._add(kh.accs[j], delta))
        return ops

    def accumulated(self, kh: KindHandles) -> tuple[list, list | None]:
        """`(grads, squares)` to push, read from the per-worker sums.

        Row-sparse variables give `IndexedSlices` of the rows touched since
        the last push. `squares` is None with `PushedSquares.NONE`.
        """
        mode = self.plan.squares
        grads, squares = [], []
        for j, v in enumerate(self.variables):
            rows = self._pushed_rows(kh, j)
            grads.append(self._read(kh.accs[j], j, rows))
            if mode is plan_lib.PushedSquares.SUMMED:
                squares.append(self._read(kh.squares[j], j, rows))
            elif mode is plan_lib.PushedSquares.LOCAL:
                # The local accumulator's growth since the last push.
                base = self._read(kh.squares[j], j, rows)
                squares.append(self._read(kh.local_accs[j], j, rows) - base)
            if rows is not None:
                shape = tf.constant(v.shape.as_list(), tf.int64)
                grads[-1] = tf.IndexedSlices(grads[-1], rows, shape)
                if squares:
                    squares[-1] = tf.IndexedSlices(squares[-1], rows, shape)
        return grads, None if mode is plan_lib.PushedSquares.NONE else squares

    def restart(self, kh: KindHandles, pushed: list) -> list:
        """Ops that start the sums to push anew after a push of `pushed`.

        The gradient sum (and `SUMMED` squares) go to 0; with `LOCAL` squares
        the local accumulator's value becomes the base of the next push's.

        Args:
          kh: the kind's handles.
          pushed: the pushed gradients (`accumulated`'s `grads`).
        """
        mode = self.plan.squares
        ops = []
        for j, g in enumerate(pushed):
            rows = g.indices if isinstance(g, tf.IndexedSlices) else None
            zeros = tf.zeros_like(g if rows is None else g.values)
            ops.append(self._write(kh.accs[j], rows, zeros))
            if mode is plan_lib.PushedSquares.SUMMED:
                ops.append(self._write(kh.squares[j], rows, zeros))
            elif mode is plan_lib.PushedSquares.LOCAL:
                base = self._read(kh.local_accs[j], j, rows)
                ops.append(self._write(kh.squares[j], rows, base))
            ops += self._restart_rows(kh, j)
        return ops

    def repair_local_accumulators(self, kh: KindHandles, restore_base: bool) -> list:
        """Ops that take the NaN of a refused push out of the local accumulators.

        Args:
          kh: the kind's handles.
          restore_base: with `PushedSquares.LOCAL`, set each local AdaGrad
            accumulator back to its value at the last push (the base of the
            pushed squares, kept while the push restarts the accumulators).
            Otherwise, or without that base, its non-finite entries go back
            to the initial accumulator value.
        """
        ops = []
        for j, acc in enumerate(kh.local_accs):
            if acc is None:
                continue
            dtype = self.variables[j].dtype
            if restore_base and self.plan.squares is plan_lib.PushedSquares.LOCAL:
                ops.append(assign(acc, read(kh.squares[j], dtype)))
            else:
                value = read(acc, dtype)
                start = tf.cast(self.plan.initial_accumulator, dtype)
                fixed = tf.where(tf.math.is_finite(value), value, start)
                ops.append(assign(acc, fixed))
        return ops


def _squared(grad):
    """`grad * grad`, for a tensor or the rows of `IndexedSlices`."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * grad.values, grad.indices)
    return grad * grad


def apply_push(optimizer, grad, squares, variable, steps: int, scale=None) -> None:
    """Applies one pushed gradient to a ps variable with the ps optimizer.

    The one dispatch over the ps optimizers, for plain pushes (`Exchange`)
    and pushes through the push rules (`push_rules.on_ps`).

    Args:
      optimizer: the compiled optimizer (`adagrad.Adagrad` or any tf_keras
        optimizer), on the ps.
      grad: the pushed gradient (a sum over `steps` local steps), the
        variable's shape and dtype.
      squares: the pushed sum of squared gradients (AdaGrad's accumulator
        grows by it), or None.
      variable: the ps variable (a shard).
      steps: local steps summed in `grad`; with AdaGrad and no `squares`
        the accumulator grows by `grad^2 / steps` (`apply_summed_gradient`).
      scale: a factor of the step (not of AdaGrad's accumulator), or None.
    """
    if scale is not None and isinstance(optimizer, adagrad.Adagrad):
        if squares is None:
            squares = grad * grad / tf.cast(steps, variable.dtype)
        optimizer.apply_gradient_and_squares(grad * scale, squares, variable)
    elif scale is not None:
        tf_optimizers.update_step(optimizer, grad * scale, variable)
    elif squares is not None:
        optimizer.apply_gradient_and_squares(grad, squares, variable)
    elif steps > 1 and isinstance(optimizer, adagrad.Adagrad):
        optimizer.apply_summed_gradient(grad, variable, steps)
    else:
        tf_optimizers.update_step(optimizer, grad, variable)
