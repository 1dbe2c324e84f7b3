"""Downpour's variables: ps variables that can read as a replica's cache.

`enable(strategy)` installs `DistBeliefStrategy`'s `variable_wrapper` hook so
that every ps variable created afterwards under the strategy's scope is a
`DownpourVariable`: a `tf.distribute` `CachingVariable` (what
`ParameterServerStrategy` already wraps its variables in) whose reads return a
given tensor while `substitute` is active in the tracing thread. Downpour runs
the model's forward pass under `substitute`, with the replica's cached values
watched by a `tf.GradientTape`, so the gradient is taken at the cache (Dean et
al. 2012, section 4.1) and the model code is unchanged.

Sharded variables (`ShardedVariable`) are wrapped shard by shard: each shard
has its own cache, and the optimizer (which sees shards too) updates each on its
ps task.

A variable can also be substituted by a `RowSource` (Downpour's row-sparse
tables, e.g. embeddings): its row lookups (`sparse_read`, which
`tf.nn.embedding_lookup` and `tf.gather` use) then read rows from the source,
and reading it whole is an error.

While `local_steps` is active, writes to non-trainable `DownpourVariable`s
(Keras metrics, loss trackers, BatchNorm statistics) are dropped: Downpour's
local steps between two ps exchanges then touch no ps variable at all.
"""

from __future__ import annotations

import abc
import contextlib
import threading

import tensorflow as tf

from tf_distbelief import _tf_internals

__all__ = [
    "DownpourVariable",
    "RowSource",
    "DownpourUnsupportedError",
    "RowSparseReadError",
    "enable",
    "leaf_variables",
    "local_steps",
    "substitute",
]

_local = threading.local()


def _substitutions() -> dict:
    return getattr(_local, "values", None) or {}


class RowSparseReadError(RuntimeError):
    """A row-sparse variable was read whole during a Downpour step.

    A RuntimeError rather than a ValueError: TensorFlow's op construction
    replaces a ValueError raised while converting a list input (e.g. the shards
    of a `ShardedVariable` being concatenated) with a generic TypeError that no
    longer names the variable.
    """

    # Autograph re-raises an error from traced code as its own type only if
    # that type takes the message alone through `Exception.__init__`.
    __init__ = Exception.__init__


class DownpourUnsupportedError(TypeError):
    """A variable kind Downpour cannot keep a per-worker cache of."""


class RowSource(abc.ABC):
    """What a row-sparse variable reads as under `substitute`: rows on demand."""

    @abc.abstractmethod
    def read_rows(self, indices: tf.Tensor) -> tf.Tensor:
        """Returns `[*indices.shape, *row_shape]`: the rows at `indices`.

        Args:
          indices: int32 or int64 row indices of the variable (a shard's own
            rows for a shard), any shape.
        """


@contextlib.contextmanager
def substitute(pairs):
    """Within the block, each `DownpourVariable` in `pairs` reads as its tensor.

    Args:
      pairs: `(DownpourVariable, tensor or RowSource)` pairs, the tensor of the
        variable's shape and dtype. Only reads traced in this thread are
        redirected.
    """
    previous = _substitutions()
    _local.values = {**previous, **{id(v): t for v, t in pairs}}
    try:
        yield
    finally:
        _local.values = previous


@contextlib.contextmanager
def local_steps():
    """Within the block, writes to non-trainable `DownpourVariable`s are dropped.

    For the steps between a replica's fetches and pushes
    (`Downpour.run_steps`): Keras metrics and loss trackers, BatchNorm moving
    statistics and counters created under the strategy's scope are ps
    variables, and a write to one would contact the ps at every step. A
    dropped `assign`, `assign_add` or `assign_sub` returns a no-op `Operation`
    (fine as a control dependency; using it as a value fails). Trainable
    variables are written as usual. Only writes traced in this thread are
    dropped.
    """
    previous = getattr(_local, "drop_writes", False)
    _local.drop_writes = True
    try:
        yield
    finally:
        _local.drop_writes = previous


class DownpourVariable(_tf_internals.CachingVariable):
    """A ps variable whose reads can be redirected to a replica's cache."""

    def _write_dropped(self) -> bool:
        return getattr(_local, "drop_writes", False) and not self.trainable

    def assign(self, *args, **kwargs):
        if self._write_dropped():
            return tf.no_op()
        return super().assign(*args, **kwargs)

    def assign_add(self, *args, **kwargs):
        if self._write_dropped():
            return tf.no_op()
        return super().assign_add(*args, **kwargs)

    def assign_sub(self, *args, **kwargs):
        if self._write_dropped():
            return tf.no_op()
        return super().assign_sub(*args, **kwargs)

    def _substituted(self):
        value = _substitutions().get(id(self))
        if isinstance(value, RowSource):
            raise RowSparseReadError(
                f"Variable {self.name} is row-sparse under Downpour (only the rows "
                "a step looks up are fetched and pushed), but the model read it "
                "whole (e.g. a tied output layer, a regularizer, `tf.matmul`). "
                "Leave it out of `row_sparse` (e.g. `row_sparse=[]`)."
            )
        return value

    def value(self):
        value = self._substituted()
        return super().value() if value is None else value

    def read_value(self):
        value = self._substituted()
        return super().read_value() if value is None else value

    def sparse_read(self, indices, name=None):
        source = _substitutions().get(id(self))
        if isinstance(source, RowSource):
            return source.read_rows(indices)
        value = self._substituted()
        if value is None:
            return super().sparse_read(indices, name=name)
        return tf.gather(value, indices, name=name)

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        value = self._substituted()
        if value is None:
            return super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
        if dtype is not None and not dtype.is_compatible_with(value.dtype):
            raise ValueError(
                f"Variable {self.name} of dtype {value.dtype.name} was requested "
                f"as {dtype.name}."
            )
        return value


def _wrap_variable(variable, **kwargs):
    """The `variable_wrapper` hook: wraps ps variables, leaves per-worker ones."""
    if kwargs.get("per_worker_variable") or isinstance(
        variable, _tf_internals.PerWorkerVariable
    ):
        return variable
    if isinstance(variable, _tf_internals.ShardedVariable):
        # Each shard becomes its own cached slice; the optimizer sees shards too.
        for i, shard in enumerate(variable.variables):
            _tf_internals.replace_shard(variable, i, _wrap_variable(shard))
        return variable
    if isinstance(variable, _tf_internals.AggregatingVariable):
        raise DownpourUnsupportedError(
            f"Variable {variable.name} is an AggregatingVariable: TensorFlow "
            "wraps ps variables so when each worker has 2 or more GPUs (one "
            "replica per GPU). Downpour keeps one cache per worker, so it needs "
            "one replica per worker: give each worker task one GPU "
            "(CUDA_VISIBLE_DEVICES), or split the model over a worker's GPUs "
            "with model parallelism (`--devices_per_replica`)."
        )
    if isinstance(variable, DownpourVariable):
        return variable  # Already wrapped (a nested `strategy.scope()`).
    if isinstance(variable, _tf_internals.CachingVariable):
        return DownpourVariable(variable.get())
    return variable


def enable(strategy) -> None:
    """Makes variables later created under `strategy.scope()` Downpour-capable.

    Args:
      strategy: a `tf_distbelief.DistBeliefStrategy`.

    Raises:
      TypeError: `strategy` has no `variable_wrapper` hook.
    """
    if not hasattr(strategy, "variable_wrapper"):
        raise TypeError(
            "Argument `strategy` must be a tf_distbelief.DistBeliefStrategy (it "
            f"needs the `variable_wrapper` hook). Received: {strategy!r}"
        )
    strategy.variable_wrapper = _wrap_variable


def leaf_variables(variables) -> list:
    leaves = []
    for v in variables:
        if isinstance(v, _tf_internals.ShardedVariable):
            leaves.extend(v.variables)
        else:
            leaves.append(v)
    return leaves
