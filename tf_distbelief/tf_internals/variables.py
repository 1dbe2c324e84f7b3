"""tf.distribute's variable classes and the internals of their per-worker copies.

Used by Downpour (its ps variables and per-worker state), Sandblaster (its
plain weights, its sharded vectors) and `substitution` (its class swap).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute.coordinator import values as coordinator_values
from tensorflow.python.ops import resource_variable_ops

from tf_distbelief.tf_internals import _shapes

# `ParameterServerStrategy` wraps every ps variable in a `CachingVariable` and
# every `per_worker_variable=True` variable in a `PerWorkerVariable`; Downpour
# subclasses the first (reads redirected to a replica's cache) and must leave
# the second alone. Public route checked: `tf.distribute` exports neither class
# (`tf.distribute.experimental.coordinator.PerWorkerValues` is another type).
CachingVariable = ps_values.CachingVariable
PerWorkerVariable = ps_values.PerWorkerVariable
# What `ParameterServerStrategy` wraps ps variables in instead when each worker
# has 2+ GPUs (one replica per GPU); Downpour rejects it by name.
AggregatingVariable = ps_values.AggregatingVariable

# The type of a variable split by a partitioner. Public route checked:
# `tf.__internal__.distribute.ShardedVariable` is the only export (no
# `tf.distribute.ShardedVariable`).
ShardedVariable = tf.__internal__.distribute.ShardedVariable

# `tf.Variable`'s own resource variable class, to tell a plain model weight
# from a distributed one. Public route checked: `tf.Variable` is an abstract
# base that distributed variables also subclass.
ResourceVariable = resource_variable_ops.ResourceVariable

# The reads `substitution.Substitutable` overrides (and calls through `super()`)
# on a `ResourceVariable` and on a `CachingVariable`: a plain variable's reads
# go through `_read_variable_op`, its conversion to a tensor through
# `_dense_var_to_tensor`. Public route checked: none; `tf.Variable` has no hook
# on its reads.
_SUBSTITUTED_READS = (
    "_read_variable_op",
    "_dense_var_to_tensor",
    "value",
    "read_value",
    "sparse_read",
    "gather_nd",
)


def replace_shard(variable, index: int, shard) -> None:
    """Replaces shard `index` of a `ShardedVariable` in place.

    Downpour wraps each shard of a sharded ps variable as it is created, before
    Keras or the optimizer holds references to the shards. Public route
    checked: `ShardedVariable.variables` is a read-only copy.
    """
    variable._variables[index] = shard


def per_worker_values_exist(variable) -> bool:
    """True once a `per_worker_variable=True` variable has its per-worker copies.

    They are created lazily, on the first function the coordinator schedules;
    reading them before (`read_all`) fails. Public route checked: none.
    """
    return variable._per_worker_vars is not None


def worker_variable(variable, index: int, timeout_secs: float):
    """Worker `index`'s own variable of a `per_worker_variable=True` variable.

    Creates the per-worker copies first if no function was scheduled yet (as
    the first one would), then waits up to `timeout_secs` for worker
    `index`'s. The result is a variable whose handle lives on that worker:
    eager `assign` and `read_value` on the coordinator run there (what
    `downpour.replica_state` checkpoints and restores). Public route checked:
    `PerWorkerVariable.read_all` copies values to the coordinator (no handle
    to write through) and waits without a bound.

    Returns:
      The worker's variable, or None when it is not there within
      `timeout_secs` (the worker lost, its copy not yet rebuilt) or its
      creation failed.
    """
    variable._maybe_create_per_worker_vars()
    remote = variable._per_worker_vars._values[index]
    if not remote._status_available_event.wait(timeout_secs):
        return None
    return remote._values  # None when aborted or failed.


def swap_class(variable, cls: type) -> None:
    """Makes `variable` an instance of `cls` in place (sets its `__class__`).

    `substitution.substitutable` gives the weights of a tf_keras model, which
    code that knows nothing of substitution created, a subclass of their own
    class with the `Substitutable` mixin (reads redirected) for the length of
    a block, and swaps them back after. `cls` must be `type(variable)` or a
    subclass or base of it that adds no state (the instance's `__dict__` is
    kept as it is). Public route checked: `tf.variable_creator_scope` changes
    a variable's class only when it is created, before the model exists here.
    """
    variable.__class__ = cls


def _defines(cls: type, name: str) -> bool:
    return any(name in vars(k) for k in cls.__mro__)


def _swaps_back_and_forth() -> bool:
    variable = tf.Variable(1.0)
    cls = type(variable)
    swapped = type(f"Swapped{cls.__name__}", (cls,), {})
    swap_class(variable, swapped)
    ok = type(variable) is swapped and float(variable.read_value()) == 1.0
    swap_class(variable, cls)
    return ok and type(variable) is cls and float(variable.read_value()) == 1.0


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    remote_value = coordinator_values.RemoteValueImpl
    _shapes.expect(
        "variables",
        [
            ("ps_values.CachingVariable.get", hasattr(CachingVariable, "get")),
            ("ps_values.PerWorkerVariable", isinstance(PerWorkerVariable, type)),
            ("ps_values.AggregatingVariable", isinstance(AggregatingVariable, type)),
            (
                "ShardedVariable._variables",
                "_variables" in ShardedVariable.__init__.__code__.co_names,
            ),
            (
                "PerWorkerVariable._per_worker_vars",
                "_per_worker_vars" in PerWorkerVariable.__init__.__code__.co_names,
            ),
            (
                "PerWorkerVariable._maybe_create_per_worker_vars",
                callable(
                    getattr(PerWorkerVariable, "_maybe_create_per_worker_vars", None)
                ),
            ),
            (
                "RemoteValueImpl._status_available_event, _values",
                {"_status_available_event", "_values"}
                <= set(remote_value.__init__.__code__.co_names),
            ),
            (
                "ResourceVariable and CachingVariable reads (substitution)",
                all(
                    _defines(cls, name)
                    for cls in (ResourceVariable, CachingVariable)
                    for name in _SUBSTITUTED_READS
                ),
            ),
            ("ResourceVariable.__class__ swapped and back", _swaps_back_and_forth()),
        ],
    )
