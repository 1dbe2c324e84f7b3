"""The object graph a checkpoint was saved from (its names, not only its ids).

Used by `faults.resume` to tell one optimizer's slots from another's.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tf_distbelief.tf_internals import _shapes

# The checkpoint key the object graph proto is saved under.
_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def saved_object_graph(path: str) -> list:
    """The object graph checkpoint `path` was saved from, node by node.

    Returns:
      `[(children, has_value)]` by node id (0 is the root): `children` maps
      each child's name to its node id; `has_value` is true for a variable.

    Restoring matches values to objects by their place in the graph only, so
    a slot of another optimizer at the same place and of the same shape
    (tf_keras SGD's momentums where AdaGrad's accumulators are expected)
    restores silently; the graph's containers (`optimizer/momentums`,
    `optimizer/_accumulators`) tell them apart. Public route checked:
    `tf.train.CheckpointView` gives node ids and matches against objects,
    not the saved graph's names; they are in its object graph proto
    (`_CHECKPOINTABLE_OBJECT_GRAPH`).
    """
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(tf.train.load_checkpoint(path).get_tensor(_OBJECT_GRAPH_KEY))
    return [
        (
            {child.local_name: child.node_id for child in node.children},
            any(a.name == "VARIABLE_VALUE" for a in node.attributes),
        )
        for node in graph.nodes
    ]


def _fields(message) -> set[str]:
    return set(message.DESCRIPTOR.fields_by_name)


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    graph = trackable_object_graph_pb2.TrackableObjectGraph
    node = graph.TrackableObject
    _shapes.expect(
        "saved_model",
        [
            (
                "TrackableObjectGraph nodes: children (local_name, node_id), "
                "attributes (name)",
                "nodes" in _fields(graph)
                and {"children", "attributes"} <= _fields(node)
                and {"local_name", "node_id"} <= _fields(node.ObjectReference)
                and "name" in _fields(node.SerializedTensor),
            ),
        ],
    )
