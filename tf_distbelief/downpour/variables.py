"""Downpour's variables: ps variables that can read as a replica's cache.

`enable(strategy)` installs `DistBeliefStrategy`'s `variable_wrapper` hook so
that every ps variable created afterwards under the strategy's scope is a
`DownpourVariable`: a `tf.distribute` `CachingVariable` (what
`ParameterServerStrategy` already wraps its variables in) whose reads return a
given tensor while `tf_distbelief.substitution.substitute` is active in the
tracing thread. Downpour runs the model's forward pass under `substitute`, with
the replica's cached values watched by a `tf.GradientTape`, so the gradient is
taken at the cache (Dean et al. 2012, section 4.1) and the model code is
unchanged.

Sharded variables (`ShardedVariable`) are wrapped shard by shard: each shard
has its own cache, and the optimizer (which sees shards too) updates each on its
ps task.

A variable can also be substituted by a `substitution.RowSource` (Downpour's
row-sparse tables, e.g. embeddings, `row_sparse.RowReader`): its row lookups
then read rows from the source, and reading it whole raises
`RowSparseReadError`.

While `local_steps` is active, writes to non-trainable `DownpourVariable`s
(Keras metrics, loss trackers, BatchNorm statistics) are dropped: Downpour's
local steps between two ps exchanges then touch no ps variable at all.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import tensorflow as tf

from tf_distbelief import checks, errors, substitution
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = [
    "DownpourUnsupportedError",
    "DownpourVariable",
    "RowSparseReadError",
    "enable",
    "leaf_variables",
    "local_steps",
]

_local = threading.local()


class RowSparseReadError(errors.DistBeliefError, RuntimeError):
    """A row-sparse variable was read whole during a Downpour step.

    A RuntimeError rather than a ValueError: TensorFlow's op construction
    replaces a ValueError raised while converting a list input (e.g. the shards
    of a `ShardedVariable` being concatenated) with a generic TypeError that no
    longer names the variable.
    """

    # Autograph re-raises an error from traced code as its own type only if
    # that type takes the message alone through `Exception.__init__`.
    __init__ = Exception.__init__


class DownpourUnsupportedError(errors.DistBeliefError, TypeError):
    """A variable kind Downpour cannot keep a per-worker cache of."""


@contextlib.contextmanager
def local_steps() -> Iterator:
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


class DownpourVariable(substitution.Substitutable, tf_variables.CachingVariable):
    """A ps variable whose reads can be redirected to a replica's cache.

    Reads follow `substitution.substitute`; writes to a non-trainable one are
    dropped inside `local_steps`.
    """

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


def _wrap_variable(variable, **kwargs):
    """The `variable_wrapper` hook: wraps ps variables, leaves per-worker ones."""
    if kwargs.get("per_worker_variable") or isinstance(
        variable, tf_variables.PerWorkerVariable
    ):
        return variable
    if isinstance(variable, tf_variables.ShardedVariable):
        # Each shard becomes its own cached slice; the optimizer sees shards too.
        for i, shard in enumerate(variable.variables):
            tf_variables.replace_shard(variable, i, _wrap_variable(shard))
        return variable
    if isinstance(variable, tf_variables.AggregatingVariable):
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
    if isinstance(variable, tf_variables.CachingVariable):
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
        raise checks.argument_error(
            "strategy",
            "a tf_distbelief.DistBeliefStrategy (it needs the `variable_wrapper` hook)",
            strategy,
        )
    strategy.variable_wrapper = _wrap_variable


def leaf_variables(variables: Iterable) -> list:
    """`variables` with each `ShardedVariable` replaced by its shards, in order."""
    leaves = []
    for v in variables:
        if isinstance(v, tf_variables.ShardedVariable):
            leaves.extend(v.variables)
        else:
            leaves.append(v)
    return leaves
