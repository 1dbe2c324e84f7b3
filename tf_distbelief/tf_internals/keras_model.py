"""tf_keras `Model` internals under `fit`, and method overrides on a user's model.

Used where tf_distbelief changes how `fit` trains a model it did not build:
Downpour (`downpour.keras`), exactly-once step tokens (`faults.exactly_once`)
and the progress report (`fit.progress`).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf
import tf_keras
from tf_keras.src.engine import training as keras_training

from tf_distbelief.tf_internals import _shapes


def train_counter(model: tf_keras.Model) -> tf.Variable:
    """The step counter that tf_keras `fit` advances (`model._train_counter`).

    A custom `train_function` must advance it as `fit`'s own does. Public route
    checked: none (`model.optimizer.iterations` counts ps updates, not steps).
    """
    return model._train_counter


def cluster_coordinator(model: tf_keras.Model):
    """The `ClusterCoordinator` tf_keras `fit` created for `model`, or None.

    A custom `train_function` schedules through the same coordinator. Public
    route checked: `ClusterCoordinator(strategy)` returns that same object
    only after `fit` made it; tf_keras keeps it on the model.
    """
    return getattr(model, "_cluster_coordinator", None)


def steps_per_execution(model: tf_keras.Model) -> tf.Variable:
    """The `steps_per_execution` variable of a compiled tf_keras model.

    Public route checked: `compile(steps_per_execution=...)` takes it but no
    public attribute returns it.
    """
    return model._steps_per_execution


def reduce_per_replica(model: tf_keras.Model, outputs):
    """A step's outputs reduced over replicas, as tf_keras `fit`'s step does.

    `exactly_once` rebuilds tf_keras's scheduled train function (to give each
    step a token) and must return what tf_keras's returns. Public route
    checked: none; `Model.make_train_function` keeps its step function local.
    """
    return keras_training.reduce_per_replica(
        outputs,
        model.distribute_strategy,
        reduction=model.distribute_reduction_method,
    )


def override_method(model: tf_keras.Model, name: str, fn: Callable) -> None:
    """Makes `model.<name>` be `fn`, on this model only (an instance attribute).

    Downpour replaces the `train_step` of the user's model, and Downpour in
    segments and `exactly_once` its `make_train_function`
    (`override_train_function`); tf_keras's `fit` looks both up on the
    model, where an instance attribute wins over the class's method. It is
    set past tf_keras's `Model.__setattr__` (which tracks layers, weights and
    checkpoint dependencies), so that `fn` stays a plain attribute. Public
    route checked: tf_keras's route is subclassing `Model`, which cannot
    apply to a model the user already built.
    """
    object.__setattr__(model, name, fn)


def restore_method(model: tf_keras.Model, name: str) -> None:
    """Undoes `override_method(model, name, ...)`: the class's method again."""
    if overrides(model, name):
        object.__delattr__(model, name)


def overrides(model: tf_keras.Model, name: str) -> bool:
    """True if `model.<name>` was overridden on the model (`override_method`)."""
    return name in vars(model)


def override_train_function(model: tf_keras.Model, build: Callable) -> None:
    """Makes `fit` schedule each call of a train function of our own.

    Overrides `model.make_train_function` (`override_method`) with one that
    mirrors tf_keras's coordinator path (`Model.make_train_function` under a
    `ClusterCoordinator`) with step tokens added. `build()` is called when
    `fit` makes the train function, and returns `(train_function, tokens)`:
    a `tf.function` `train_function(iterator, first_token, steps)` running
    `steps` steps (the model's `steps_per_execution`), the first with token
    `first_token` (int64 scalars), and the `exactly_once.StepTokens` they come
    from. Each call of `model.train_function` takes its `steps` tokens when
    it schedules (a retry on another worker gets the same ones) and
    schedules `train_function` through the coordinator `fit` made. Without a
    coordinator (no parameter-server training) tf_keras's own
    `make_train_function` runs. The cached train function is dropped, so that
    `fit` makes the new one.

    Public route checked: none; tf_keras's scheduled function takes the
    iterator only, and its step function is local to `make_train_function`.
    """

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        coordinator = cluster_coordinator(model)
        if coordinator is None:
            return type(model).make_train_function(model, force)
        train_function, tokens = build()
        spe = steps_per_execution(model)

        def schedule(iterator):
            steps = int(spe.numpy())
            first = tokens.take(steps)
            args = (
                iterator,
                tf.constant(first, tf.int64),
                tf.constant(steps, tf.int64),
            )
            return coordinator.schedule(train_function, args=args)

        model.train_tf_function = train_function
        model.train_function = schedule
        return schedule

    override_method(model, "make_train_function", make_train_function)
    model.train_function = None


def _overrides_and_restores() -> bool:
    model = tf_keras.Model()

    def train_step(data):
        return data

    override_method(model, "train_step", train_step)
    ok = model.train_step is train_step and overrides(model, "train_step")
    restore_method(model, "train_step")
    restored = getattr(model.train_step, "__func__", None) is tf_keras.Model.train_step
    return ok and restored and not overrides(model, "train_step")


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    model, names = tf_keras.Model, _shapes.source_names(tf_keras.Model)
    _shapes.expect(
        "keras_model",
        [
            ("tf_keras Model._train_counter", "_train_counter" in names),
            ("tf_keras Model._cluster_coordinator", "_cluster_coordinator" in names),
            (
                "tf_keras training.reduce_per_replica",
                callable(getattr(keras_training, "reduce_per_replica", None)),
            ),
            ("tf_keras Model._steps_per_execution", "_steps_per_execution" in names),
            (
                "tf_keras Model.fit calls model.make_train_function, "
                "model.train_function",
                {"make_train_function", "train_function"}
                <= _shapes.code_names(model.fit),
            ),
            (
                "tf_keras Model.make_train_function steps with model.train_step, "
                "sets model.train_tf_function",
                {"train_step", "train_tf_function"}
                <= _shapes.code_names(model.make_train_function),
            ),
            ("Model methods overridden and restored", _overrides_and_restores()),
        ],
    )
