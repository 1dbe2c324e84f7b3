"""`PsWeights`: the ps variables that hold a Keras 3 model's weights.

Keras 3 variables are not `tf.Variable`s and cannot be created under a
ParameterServerStrategy (Keras 3 has no parameter-server support), so the
model keeps its own variables on the coordinator and `PsWeights` creates a
`tf.Variable` on the ps for each of them, under `DistBeliefStrategy.scope()`:
the strategy's partitioner splits it into a `ShardedVariable` as it does a
tf_keras weight. A scheduled step reads these values and passes them to
`model.stateless_call`; at the end `write_to_model` copies them into the
model's own variables.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.tf_internals import variables as tf_variables


def shards_of(variable) -> list:
    """The per-ps `tf.Variable`s of a ps variable (one when it is whole)."""
    return list(getattr(variable, "variables", [variable]))


def read(variable) -> tf.Tensor:
    """The value of a ps variable, its shards concatenated along axis 0.

    Inside a `tf.GradientTape` each shard's read is recorded, so the gradient
    of a loss comes back per shard.
    """
    shards = shards_of(variable)
    if len(shards) == 1:
        return shards[0].value()
    return tf.concat([s.value() for s in shards], axis=0)


def _whole(shards: list):
    """One variable for a checkpoint: a `ShardedVariable` of `shards` (saved
    whole, so that it restores into any number of ps tasks), or the one."""
    if len(shards) == 1:
        return shards[0]
    return tf_variables.ShardedVariable(shards)


def _ps_name(keras_variable) -> str:
    # `dense/kernel`: a TensorFlow variable name may not hold every character
    # of a Keras 3 path.
    return keras_variable.path.replace("/", "_").replace(":", "_")


class PsWeights:
    """ps variables for each weight of a built Keras 3 model, with optimizer slots.

    Each `tf.Variable` is created under `strategy.scope()` from the Keras 3
    variable's current value, so the strategy's partitioner shards it
    (`ShardedVariable`, split along axis 0). Each trainable shard gets its
    optimizer's slot (AdaGrad's accumulator, SGD's momentum) of its shape on
    its ps task (`colocate_vars_with`), filled with the optimizer's
    `slot_initial_value`, as tf_keras optimizer slots are.

    Args:
      strategy: a `DistBeliefStrategy` (or any ParameterServerStrategy).
      model: a built Keras 3 model (its variables exist).
      optimizer: the `keras3.Adagrad` or `keras3.SGD` that updates them (its
        `slot_initial_value` None: no slots, as plain SGD), or None for no
        slots and no optimizer in checkpoints (Downpour's ps optimizer keeps
        its own).

    Attributes:
      trainable: ps variables in the order of `model.trainable_variables`.
      non_trainable: ps variables in the order of
        `model.non_trainable_variables`.
      accumulators: per trainable variable, the list of its shards' slots
        (`tf.Variable`s on their ps tasks); empty without slots.
      slot_name: the optimizer's `slot_name` (`"accumulators"`,
        `"momentums"`), or None for `optimizer=None`.
      checkpoint_model: a `tf.Module` tracking the ps variables by position
        (`trainable/<i>`, `non_trainable/<i>`), for `tf.train.Checkpoint`.
      checkpoint_optimizer: a `tf.Module` tracking the slots by position
        (`<slot_name>/<i>`, a sharded one whole), or None for
        `optimizer=None`.

    Raises:
      ValueError: the model is not built (has no variables yet).
    """

    def __init__(
        self,
        strategy,
        model,
        optimizer=None,
    ):
        if not model.built or not model.variables:
            raise checks.argument_error(
                "model",
                "a built Keras 3 model (its weights exist)",
                model.name,
                fix=f"(built={model.built}): give it a `keras.Input` or call it "
                "on a batch first.",
            )
        self.model_name = model.name
        self.paths = [v.path for v in model.trainable_variables]
        with strategy.scope():
            self.trainable = [
                self._create(v, trainable=True) for v in model.trainable_variables
            ]
            self.non_trainable = [
                self._create(v, trainable=False) for v in model.non_trainable_variables
            ]
            self.accumulators = []
            fill = None if optimizer is None else optimizer.slot_initial_value
            for variable in self.trainable if fill is not None else ():
                slots = []
                for shard in shards_of(variable):
                    with strategy.extended.colocate_vars_with(shard):
                        slots.append(
                            tf.Variable(
                                tf.fill(shard.shape, tf.constant(fill, shard.dtype)),
                                name=shard.name.split(":")[0]
                                + "_"
                                + optimizer.slot_name[:-1],
                                trainable=False,
                            )
                        )
                self.accumulators.append(slots)
        self.slot_name = None if optimizer is None else optimizer.slot_name
        self._checkpoint_objects = None

    def _objects(self) -> tuple:
        # What a checkpoint holds, keyed by position (a Keras 3 path changes
        # with the names Keras gives the layers: `dense_1` in a second model):
        # `model/trainable/<i>`, `model/non_trainable/<i>` and
        # `optimizer/<slot_name>/<i>` (`accumulators`, `momentums`), each
        # whole, so that a checkpoint of another optimizer does not restore.
        # Made once, on first use.
        if self._checkpoint_objects is None:
            model = tf.Module(name="ps_weights")
            model.trainable = list(self.trainable)
            model.non_trainable = list(self.non_trainable)
            optimizer = None
            if self.slot_name is not None:
                optimizer = tf.Module(name="ps_optimizer")
                setattr(
                    optimizer,
                    self.slot_name,
                    [_whole(s) for s in self.accumulators],
                )
            self._checkpoint_objects = (model, optimizer)
        return self._checkpoint_objects

    @property
    def checkpoint_model(self) -> tf.Module:
        """The ps variables by position, for `tf.train.Checkpoint`."""
        return self._objects()[0]

    @property
    def checkpoint_optimizer(self) -> tf.Module | None:
        """The slots by position (a sharded one whole), or None."""
        return self._objects()[1]

    @staticmethod
    def _create(keras_variable, trainable: bool):
        return tf.Variable(
            np.asarray(keras_variable.numpy()),
            name=_ps_name(keras_variable),
            dtype=keras_variable.dtype,
            trainable=trainable,
        )

    def numpy(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`(trainable, non_trainable)` values read from the ps, NumPy arrays."""
        return (
            [np.asarray(tf.convert_to_tensor(v)) for v in self.trainable],
            [np.asarray(tf.convert_to_tensor(v)) for v in self.non_trainable],
        )

    def check_model(self, model) -> None:
        """Raises ValueError unless `model` has the weights these were made from."""
        paths = [v.path for v in model.trainable_variables]
        if paths != self.paths:
            raise ValueError(
                f"Argument `model` must have the weights the ps variables were "
                f"made from ({self.model_name!r}: {self.paths}). Received: "
                f"{model.name!r} with {paths}"
            )

    def write_to_model(self, model) -> None:
        """Copies the ps values into `model`'s own Keras 3 variables (exactly).

        Args:
          model: the Keras 3 model these weights were made from.

        Raises:
          ValueError: `model` has other weights than those the ps hold.
        """
        self.check_model(model)
        trainable, non_trainable = self.numpy()
        for keras_variable, value in zip(model.trainable_variables, trainable):
            keras_variable.assign(value)
        for keras_variable, value in zip(model.non_trainable_variables, non_trainable):
            keras_variable.assign(value)
