"""How a `tf.cond`'s branch runs in a `tf.function`: `whole_cond`, `called_cond`.

`whole_cond`: a `tf.cond` whose branch, once begun, runs to its end.

Used by `faults.exactly_once.gate`, whose branch applies a step's update on
the ps and then writes the step's token: the two must both happen or neither.
Inside a `tf.function`, TensorFlow lowers a `tf.cond` into switch and merge
nodes of the enclosing graph ("lowering", the If op's
`_lower_using_switch_merge` attribute), so the branch's nodes run in the
step's executor on the ps, beside its transfers from the worker. When the
worker is lost mid-step those transfers fail, and the ps's executor left the
branch cut between the update and the token's write in about one run in
three of `tests/faults/test_exactly_once.py` (4 worker SIGKILLs: the
optimizer's step count 501 of 500, every token written once; the retry
applied the step again). Left as a functional `If` op, the branch runs as a
function of its own, whose ps-local, straight-line ops end once begun: 8 runs
of 8 then counted exactly.

Public route checked: none. `tf.cond` has no argument for it; the attribute
is what `tf.function`'s own control flow sets (`control_flow_util_v2.
maybe_set_lowering_attr`), read by TensorFlow's lowering pass.

`called_cond`: a `tf.cond` whose branches are function calls that TensorFlow
does not inline. A lowered branch's nodes are partitioned with the enclosing
graph, and every edge of the branch between two tasks becomes a send and a
receive that run at every step, taken or not: a branch not taken sends a dead
tensor over each (about 300 bytes on the sockets per edge and step, gRPC's
request and reply). A call op not taken is skipped whole: its body's edges
move only when it runs, and what crosses at every step is the call's inputs
from other tasks (each ps variable's resource handle: the call op is placed
on the worker, apart from its resource inputs). Used by the Downpour fetch
and push with update-stream fetches (`downpour.exchange`), whose branches
hold more edges between the worker and the ps tasks than variables. The If
op cannot be kept whole instead (`whole_cond`): its resources are on several
tasks.

Public route checked: `tf.function`'s `experimental_attributes` takes the
attribute, but `_noinline` (read by TensorFlow's function inlining, which
inlines every call in a `tf.function` without it) is private.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

__all__ = [
    "LOWERING_ATTR",
    "NO_INLINE_ATTR",
    "called_cond",
    "check",
    "resource_devices",
    "whole_cond",
]

# The If op's attribute naming whether TensorFlow lowers it to switch and
# merge nodes of the enclosing graph.
LOWERING_ATTR = "_lower_using_switch_merge"

# The function attribute telling TensorFlow's inlining not to inline calls of
# the function.
NO_INLINE_ATTR = "_noinline"

_IF_OPS = ("If", "StatelessIf")
_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def called_cond(pred, true_fn: Callable, false_fn: Callable):
    """`tf.cond(pred, true_fn, false_fn)`, each branch a call not inlined.

    Inside a `tf.function` each branch is traced as a function of its own
    (`tf.function`, without autograph: the branches are traced as given) and
    called from the cond's branch: of the branch not taken only the call's
    inputs from other tasks cross, not its body's edges (see the module).
    Eagerly, a plain `tf.cond`.

    Args:
      pred: a bool scalar tensor.
      true_fn: the branch for True; returns tensors (a nest).
      false_fn: the branch for False; the same structure.

    Returns:
      The branch's outputs, as `tf.cond` returns them.
    """
    if tf.executing_eagerly():
        return tf.cond(pred, true_fn, false_fn)
    return tf.cond(pred, _not_inlined(true_fn), _not_inlined(false_fn))


def _not_inlined(fn: Callable) -> Callable:
    return tf.function(
        fn, autograph=False, experimental_attributes={NO_INLINE_ATTR: True}
    )


def whole_cond(pred, true_fn: Callable, false_fn: Callable):
    """`tf.cond(pred, true_fn, false_fn)`, its If op kept whole (see the module).

    Inside a `tf.function` the If op this makes is not lowered when every
    resource (variable) its branches use lives on one device: the branch
    taken runs as one function call there. With resources on several devices
    (variables on several ps tasks) it is lowered as usual: TensorFlow places
    a functional If with its resource inputs, and cannot place one whose
    resources are on two tasks. Eagerly, a plain `tf.cond`.

    Args:
      pred: a bool scalar tensor.
      true_fn: the branch for True; returns tensors (a nest).
      false_fn: the branch for False; the same structure.

    Returns:
      The branch's outputs, as `tf.cond` returns them.
    """
    if tf.executing_eagerly():
        return tf.cond(pred, true_fn, false_fn)
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    outputs = tf.cond(pred, true_fn, false_fn)
    # The branches' own ops live in their function graphs: the new ops here
    # hold this cond's If op only.
    ops = [op for op in graph.get_operations()[before:] if op.type in _IF_OPS]
    if len(ops) != 1:
        raise AssertionError(
            f"tf.cond made {len(ops)} If ops in the calling graph, not 1: "
            "tf_internals.control_flow.whole_cond needs updating"
        )
    devices = resource_devices(ops[0])
    if len(devices) == 1 and None not in devices:
        ops[0]._set_attr(LOWERING_ATTR, attr_value_pb2.AttrValue(b=False))
    return outputs


@tf.autograph.experimental.do_not_convert
def resource_devices(op) -> set:
    """The devices of the resources `op` takes, found through the captures
    of the function graphs it is traced in (None for one not found).

    Args:
      op: an op in a `tf.function`'s graph, or in a graph nested in it.

    Returns:
      A set of device strings (and None).
    """
    devices = set()
    for tensor in op.inputs:
        if tensor.dtype != tf.resource:
            continue
        graph = op.graph
        while graph is not None and not hasattr(tensor, "numpy"):
            # `captures`: (outer tensor, this graph's placeholder) pairs.
            outer = {id(inner): t for t, inner in getattr(graph, "captures", ())}
            tensor = outer.get(id(tensor))
            graph = getattr(graph, "outer_graph", None)
        devices.add(tensor.device if hasattr(tensor, "numpy") else None)
    return devices


def check() -> None:
    """Fails if `tf.cond` in a `tf.function` no longer makes one If op with
    the lowering attribute set, or `whole_cond` does not clear it.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    from tf_distbelief.tf_internals import _shapes

    def lowering(fn) -> list:
        graph = tf.function(fn).get_concrete_function(tf.TensorSpec([], tf.bool)).graph
        return [
            op.get_attr(LOWERING_ATTR)
            for op in graph.get_operations()
            if op.type in _IF_OPS
        ]

    with tf.init_scope():
        variable = tf.Variable(0)

    def branches(make):
        return lambda pred: make(
            pred, lambda: variable.assign_add(1), lambda: tf.constant(2)
        )

    _shapes.expect(
        "control_flow",
        [
            (
                "tf.cond's If op with _lower_using_switch_merge=True",
                lowering(branches(tf.cond)) == [True],
            ),
            (
                "a FuncGraph's captures leading to the variable's handle",
                _captured_devices(variable) == {variable.handle.device},
            ),
            (
                "an If op's _lower_using_switch_merge set to False",
                lowering(branches(whole_cond)) == [False],
            ),
            (
                "a tf.function's experimental_attributes _noinline on its calls",
                _called_attrs(variable) == [True, True],
            ),
        ],
    )


def _called_attrs(variable) -> list:
    """The `_noinline` attribute of the functions `called_cond`'s branches
    call (None where absent)."""

    @tf.function
    def fn(pred):
        return called_cond(pred, lambda: variable.assign_add(1), lambda: variable)

    graph = fn.get_concrete_function(tf.TensorSpec([], tf.bool)).graph
    found = []
    for op in graph.get_operations():
        if op.type not in _IF_OPS:
            continue
        for branch in ("then_branch", "else_branch"):
            body = graph._functions[op.get_attr(branch).name].graph
            for call in body.get_operations():
                if call.type in _CALL_OPS:
                    called = body._functions[call.get_attr("f").name]
                    attr = called.cached_definition.attr.get(NO_INLINE_ATTR)
                    found.append(None if attr is None else attr.b)
    return found


def _captured_devices(variable) -> set:
    """`resource_devices` of the If op a cond on `variable` makes, traced in
    a loop (as a train function's steps are)."""
    found = []

    @tf.function
    def fn(pred):
        for _ in tf.range(1):
            graph = tf.compat.v1.get_default_graph()
            before = len(graph.get_operations())
            tf.cond(pred, lambda: variable.assign_add(1), lambda: tf.constant(2))
            found.extend(
                resource_devices(op)
                for op in graph.get_operations()[before:]
                if op.type in _IF_OPS
            )
        return pred

    fn.get_concrete_function(tf.TensorSpec([], tf.bool))
    return found[0] if len(found) == 1 else set()
