"""A value fed to each worker's call of a function traced once for all workers.

Used by `fit.shards`: each worker is sent its own shard of in-memory arrays,
not all of them. `ClusterCoordinator.create_per_worker_dataset` traces the
dataset function once (`PerWorkerDatasetFromDatasetFunction`) and calls that
one function on every worker. A NumPy array the function reads becomes a
constant of its graph, and the graph goes to every task: each worker then
receives every record though it reads only its shard. A value given by
`per_worker_input` is a placeholder of the graph instead, fed when the
coordinator calls the function for worker `i` with `values_of(i)`: the call
sends worker `i` its value and nothing of the other workers'. A worker that
rejoins has its per-worker resources created anew (TensorFlow's
`Worker._on_worker_recovery` runs the function again), so it is fed again.

The worker index is the one
`tf.distribute.coordinator.experimental_get_current_worker_index` reads: the
coordinator's dispatch context, set while a worker's closure runs. Public
route checked: that function gives the index only as a tensor inside the
graph, after the graph is sent; a tf.function's captures and arguments are
the same for every worker, and `create_per_worker_dataset` passes the
dataset function no argument. Internals: `FuncGraph.capture_call_time_value`
(TensorFlow's own route for the worker index) and
`coordinator_context.get_current_dispatch_context`.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf
from tensorflow.python.distribute.coordinator import coordinator_context
from tensorflow.python.framework import func_graph

from tf_distbelief import checks
from tf_distbelief.tf_internals import _shapes

__all__ = ["check", "per_worker_input"]


def per_worker_input(values_of: Callable[[int], object], spec: tf.TensorSpec):
    """A placeholder fed with `values_of(worker index)` at each worker's call.

    Call it while tracing a function that the coordinator runs on its
    workers (a dataset function of `create_per_worker_dataset`, a scheduled
    function). `values_of` runs on the coordinator, at each call, and what it
    returns is sent to that call's worker only.

    One tensor per call: TensorFlow counts a nest of call-time values as one
    capture when it sets a concrete function's flat signature, and the
    coordinator's call of a dataset function (no arguments) goes through
    that signature.

    Args:
      values_of: `values_of(worker_index)`, an array or tensor compatible
        with `spec` (the worker index as
        `experimental_get_current_worker_index` gives it).
      spec: the value's dtype and shape (`None` where workers' values differ).

    Returns:
      A graph tensor of `spec`.

    Raises:
      ArgumentError: `spec` is not a `tf.TensorSpec`.
      RuntimeError: not inside a function being traced; or (at call time)
        the function is called outside a worker's closure, as
        `experimental_get_current_worker_index` raises.
    """
    if not isinstance(spec, tf.TensorSpec):
        raise checks.argument_error(
            "spec", "a tf.TensorSpec (one tensor per call)", spec
        )
    graph = tf.compat.v1.get_default_graph()
    if not isinstance(graph, func_graph.FuncGraph):
        raise RuntimeError(
            "per_worker_input must be called while tracing a function the "
            "ClusterCoordinator runs on its workers (a dataset function of "
            "create_per_worker_dataset, or a scheduled function)."
        )

    def call_time_values():
        context = coordinator_context.get_current_dispatch_context()
        if context is None:
            raise RuntimeError(
                "A function with per-worker inputs was called outside a "
                "worker's closure of the ClusterCoordinator; call it through "
                "create_per_worker_dataset or ClusterCoordinator.schedule."
            )
        return values_of(context.worker_index)

    return graph.capture_call_time_value(call_time_values, spec)


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc

    capture = getattr(func_graph.FuncGraph, "capture_call_time_value", None)
    dispatch = coordinator_context.DispatchContext
    _shapes.expect(
        "worker_inputs",
        [
            (
                "FuncGraph.capture_call_time_value (the worker index's own route: "
                "get_current_worker_index)",
                callable(capture)
                and "capture_call_time_value"
                in _shapes.code_names(coordinator_context.get_current_worker_index),
            ),
            (
                "coordinator_context.get_current_dispatch_context().worker_index, "
                "set by Closure.execute_on (with_dispatch_context)",
                callable(
                    getattr(coordinator_context, "get_current_dispatch_context", None)
                )
                and isinstance(getattr(dispatch, "worker_index", None), property)
                and "with_dispatch_context"
                in _shapes.code_names(cc.Closure.execute_on),
            ),
        ],
    )
