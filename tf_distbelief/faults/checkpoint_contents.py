"""What a `model_dir` checkpoint holds, and how its keys are named: one owner.

Every trainer that writes `model_dir/checkpoints/ckpt-<step>` (tf_keras
`fit.training.fit`, `keras3.fit`) builds its object graph here
(`Contents`): `model` (the weights), `optimizer` (its slots), `epoch` and
`step` (`int64` variables: the epochs and the global steps finished), and,
for an algorithm whose state lives on the workers, that state under the
algorithm's name (`hooks.FitHooks.name`: Downpour's replicas as
`downpour`). A reader of checkpoints (the evaluator, the exact restore,
Sandblaster's L-BFGS state) names a saved value by its key, built here:
`<object path>` + `VALUE_SUFFIX`, the object path escaped as TensorFlow
escapes it, the shortest path from the root, breadth first (`variable_keys`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief import paths
from tf_distbelief.faults import nonfinite
from tf_distbelief.tf_internals import variables as tf_variables

# What TensorFlow appends to a variable's object path in a checkpoint key.
VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


def value_key(object_path: str) -> str:
    """The checkpoint key of the variable at `object_path` (e.g. `step`)."""
    return object_path + VALUE_SUFFIX


def object_path(key: str) -> str:
    """The object path of checkpoint key `key` (`key` itself if not a value's)."""
    return key.partition("/.ATTRIBUTES")[0]


def is_value_key(key: str) -> bool:
    """Whether checkpoint key `key` holds a variable's value."""
    return key.endswith(VALUE_SUFFIX)


# The global step, in every checkpoint `Contents` writes.
STEP_KEY = value_key("step")
# Keys of the checkpoint's own bookkeeping, not of the objects restored.
OWN_KEYS = ("_CHECKPOINTABLE_OBJECT_GRAPH", value_key("save_counter"))


def _escape(name: str) -> str:
    # How TensorFlow escapes a name in a checkpoint key
    # (`trackable_utils.escape_local_name`).
    return name.replace(".", "..").replace("/", ".S")


def walk(root, children, key=id):
    """Shortest paths from `root`, breadth first, as checkpoints key them.

    Args:
      root: the root node.
      children: `node -> {name: child}`.
      key: a node's identity (`id` for objects; node ids are their own).

    Returns:
      `(paths, order)`: `{key(node): path}` and the nodes in visiting order.
    """
    found, order, queue = {key(root): ""}, [root], [root]
    while queue:
        node = queue.pop(0)
        for name, child in children(node).items():
            if key(child) not in found:
                parent = found[key(node)]
                found[key(child)] = (
                    f"{parent}/{_escape(name)}" if parent else _escape(name)
                )
                order.append(child)
                queue.append(child)
    return found, order


def _is_variable(obj) -> bool:
    return isinstance(obj, (tf.Variable, tf_variables.ShardedVariable))


def variable_keys(root) -> tuple[dict, dict]:
    """The checkpoint keys of the variables `root` would save, and their holders.

    The keys are those `tf.train.Checkpoint(root).save` writes: the shortest
    path from `root`, breadth first, as `tf.train.TrackableView` walks it (a
    `ShardedVariable` is one variable, saved whole).

    Returns:
      `({key: variable}, {holder path: [variable names]})`: a holder is an
      object with variables among its direct children (a layer, the
      optimizer's list of slots).
    """
    view = tf.train.TrackableView(root)

    def children(node):
        return {} if _is_variable(node) else view.children(node)

    found, order = walk(root, children)
    keys, holders = {}, {}
    for node in order:
        if _is_variable(node):
            keys[value_key(found[id(node)])] = node
            continue
        held = [
            nonfinite.variable_name(c)
            for c in children(node).values()
            if _is_variable(c)
        ]
        if held:
            holders[found[id(node)]] = held
    return keys, holders


class Contents:
    """The object graph of a training run's `model_dir` checkpoints.

    Args:
      model: what holds the weights (a tf_keras model, or `PsWeights`'
        `checkpoint_model`).
      optimizer: what holds the optimizer's slots.
      algorithm: None, or the `hooks.FitHooks` of the algorithm that trains:
        its `checkpoint_state()` (if any) is saved under its `name`.

    Attributes:
      step: the `int64` variable saved as the global step.
      epoch: the `int64` variable saved as the epochs finished.
      state: the algorithm's checkpointed state (Downpour's
        `replica_state.ReplicaState`), or None.
      roots: `{"model": model, "optimizer": optimizer}`.
    """

    def __init__(self, model, optimizer, algorithm=None):
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.roots = dict(model=model, optimizer=optimizer)
        self.state = None
        self._name = None
        if algorithm is not None and algorithm.checkpoint_state is not None:
            self.state = algorithm.checkpoint_state()
            self._name = algorithm.name

    def checkpoint(self) -> tf.train.Checkpoint:
        """The `tf.train.Checkpoint` every write saves."""
        extra = {} if self.state is None else {self._name: self.state}
        return tf.train.Checkpoint(
            **self.roots, epoch=self.epoch, step=self.step, **extra
        )

    def manager(self, model_dir: str) -> tf.train.CheckpointManager:
        """The manager of `model_dir`'s checkpoints (`paths.checkpoint_dir`)."""
        return tf.train.CheckpointManager(
            self.checkpoint(),
            paths.checkpoint_dir(model_dir),
            max_to_keep=paths.MAX_CHECKPOINTS_TO_KEEP,
        )

    def restoring(self, keys) -> tuple[tf.train.Checkpoint, object]:
        """What a checkpoint holding `keys` restores into.

        A checkpoint written before steps were recorded holds epochs only
        (no `step`); the algorithm's state is shaped as the checkpoint's
        (`state.restoring`).

        Returns:
          `(checkpoint, restored)`: the `tf.train.Checkpoint` to restore, and
          the algorithm's state it restores into (None: none saved or none
          kept), for `state.write_back`.
        """
        tracked = dict(**self.roots, epoch=self.epoch)
        if STEP_KEY in keys:
            tracked["step"] = self.step
        restored = None if self.state is None else self.state.restoring(keys)
        if restored is not None:
            tracked[self._name] = restored
        return tf.train.Checkpoint(**tracked), restored
