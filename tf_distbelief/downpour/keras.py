"""Downpour SGD for tf_keras models: `fit`, a custom loop, per-epoch figures.

Dean et al. 2012, section 4.1, on a compiled tf_keras model whose variables
were created under a `DistBeliefStrategy` with `variables.enable` in effect:

* `install` makes `model.fit` train with Downpour (`replica.Downpour.step`, or
  `Downpour.run_steps` in segments);
* `DownpourTrainer` schedules one local step at a time on a
  `ClusterCoordinator`;
* `DownpourMetrics` adds each epoch's staleness and bytes moved to the logs.

Resume (`training.fit(model_dir=...)`): a checkpoint holds the ps state,
every variable, every optimizer slot, the iteration count and the step, and
each replica's own state, which lives on its worker
(`per_worker_variable=True`): its cache, its gradient sums not yet pushed, its
local AdaGrad accumulator, its step counter (the fetch and push cadence) and
its counters (`stats`), with the ps update count (staleness). A resume
restores all of it bit for bit, replica `i`'s state to worker `i`
(`replica_state`), so that with the same workers a resumed run equals an
uninterrupted one exactly at any step (1 worker and fixed data:
`tests/test_downpour_resume.py`). The rules for a checkpoint without that
state, another number of workers, and a worker restarted mid-run (it starts
fresh from the ps) are in `replica_state`.

Example with `fit`:
  ```
  strategy = tfdb.DistBeliefStrategy(resolver)
  downpour.enable(strategy)  # before any variable is created
  with strategy.scope():
    model = digits.build_model()
    model.compile(tfdb.adagrad.Adagrad(0.1), loss=..., metrics=["accuracy"])
    state = downpour.install(model, downpour.DownpourConfig(4, 4))
  model.fit(dataset, epochs=5, steps_per_epoch=100,
            callbacks=[downpour.DownpourMetrics(state)])
  print(state.stats())
  ```
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import tensorflow as tf
import tf_keras

from tf_distbelief import checks, hooks
from tf_distbelief.downpour import push_guard, replica_state, report
from tf_distbelief.downpour.config import DownpourConfig
from tf_distbelief.downpour.replica import Downpour
from tf_distbelief.downpour.schedule import ReplicaStats
from tf_distbelief.tf_internals import keras_model

__all__ = ["DownpourMetrics", "DownpourTrainer", "embedding_tables", "install"]


def _check_compiled(model: tf_keras.Model) -> None:
    if getattr(model, "optimizer", None) is None:
        raise checks.argument_error(
            "model",
            "compiled with an optimizer (the ps applies it to each push), e.g. "
            "`model.compile(tf_distbelief.adagrad.Adagrad(0.1), loss=...)`",
            model.name,
            what="an uncompiled model",
        )
    if not model.built:
        raise checks.argument_error(
            "model",
            "built before Downpour can cache its variables (give it an input shape)",
            model.name,
        )


def embedding_tables(model: tf_keras.Model) -> list:
    """The tables of `model`'s trainable tf_keras `Embedding` layers.

    What `install` and `DownpourTrainer` treat as row-sparse by default.

    Args:
      model: a built tf_keras model.

    Returns:
      A list of variables (`ShardedVariable`s where the partitioner split them).
    """
    return [
        layer.embeddings
        for layer in model.submodules
        if isinstance(layer, tf_keras.layers.Embedding) and layer.trainable
    ]


def _make_downpour(model, config, row_sparse) -> Downpour:
    _check_compiled(model)
    return Downpour(
        model.distribute_strategy,
        model.trainable_variables,
        model.optimizer,
        config,
        row_sparse=embedding_tables(model) if row_sparse is None else row_sparse,
    )


def _forward(model: tf_keras.Model, data):
    """`(loss, y_pred)` of a training step of `model` on the batch `data`."""
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=True)
    return model.compute_loss(x, y, y_pred, sample_weight), y_pred


def _update_metrics(model: tf_keras.Model, data, y_pred) -> dict:
    """Updates the model's metrics with a step's predictions; their results."""
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    return model.compute_metrics(x, y, y_pred, sample_weight)


def _make_train_step(model, downpour: Downpour, downpour_logs: bool):
    """A `train_step` running `Downpour.step`.

    Its logs are the model's metrics, plus, with `downpour_logs`, the step's
    `staleness`, `bytes_fetched` and `bytes_pushed` (for `DownpourTrainer`).
    Under `fit` they are left out: `fit` then replaces the last step's logs
    with the model's metrics at each epoch end, and the three are not sent
    back at every step (`DownpourMetrics` gives them per epoch).
    """

    def train_step(data):
        _, y_pred, metrics = downpour.step(lambda: _forward(model, data))
        logs = dict(_update_metrics(model, data, y_pred))
        if downpour_logs:
            logs.update(metrics)
        return logs

    return train_step


def _install_segment_train_function(model, downpour: Downpour) -> None:
    """Makes `model.make_train_function` run `Downpour.run_steps` under `fit`.

    It mirrors tf_keras's coordinator path (`Model.make_train_function`): one
    scheduled `tf.function` runs `steps_per_execution` steps. The model's
    train counter (a ps variable) grows once per scheduled function, by the
    steps it ran, rather than at every step; the function returns the model's
    metric results, which `fit` reads again at each epoch end. Each push is
    gated by its step's `exactly_once` token, so that a function retried after
    a worker loss does not push a step's update twice.
    """

    def build():
        @tf.function(reduce_retracing=True)
        def train_function(iterator, first_token, steps_per_execution):
            done = downpour.run_steps(
                iterator,
                steps_per_execution,
                lambda data: _forward(model, data),
                lambda data, y_pred: _update_metrics(model, data, y_pred),
                first_token=first_token,
            )
            counter = keras_model.train_counter(model)
            with tf.control_dependencies(
                [counter.assign_add(tf.cast(done, counter.dtype))]
            ):
                return tf.nest.map_structure(tf.identity, model.get_metrics_result())

        # Tokens fixed when a function is scheduled: a retry on another worker
        # gets the same ones.
        return train_function, downpour.tokens

    keras_model.override_train_function(model, build)


def install(
    model: tf_keras.Model,
    config: DownpourConfig,
    row_sparse: Sequence[tf.Variable] | None = None,
) -> Downpour:
    """Makes `model.fit` train with Downpour SGD.

    The model must be built and compiled under the scope of a strategy on which
    `enable` was called before the model was created. With `n_fetch` or
    `n_push` 1, or a warm start, `fit` runs one local Downpour step
    (`Downpour.step`) per training step, on whichever worker the coordinator
    picks. Otherwise each scheduled function runs its steps in segments
    between fetches and pushes (`Downpour.run_steps`): the ps takes part once
    per segment, and Keras metrics are updated on the last batch of each
    segment. Either way the logs are the model's metrics; `DownpourMetrics`
    adds staleness and bytes moved per epoch.

    Args:
      model: a compiled, built tf_keras model.
      config: a `DownpourConfig`.
      row_sparse: the variables only read by row lookups, fetched and pushed
        by rows (see `Downpour`); None (default) means the tables of the
        model's trainable `Embedding` layers (`embedding_tables`), `[]` none.
        A list replaces the default: include `embedding_tables(model)` to add
        to it.

    Returns:
      The `Downpour` state; `.stats()` gives each replica's counters.

    Raises:
      ValueError: the model is not compiled or not built, or see `Downpour`.
      TypeError: see `Downpour`.
    """
    downpour = _make_downpour(model, config, row_sparse)
    # An instance attribute wins over `Model.train_step`; the cached train
    # function is dropped so that `fit` traces the new step.
    keras_model.override_method(
        model, "train_step", _make_train_step(model, downpour, downpour_logs=False)
    )
    if downpour.runs_segments:
        _install_segment_train_function(model, downpour)
    model.train_function = None
    hooks.attach(
        model,
        hooks.FitHooks(
            name="downpour",
            install_guard=functools.partial(push_guard.install, downpour),
            checkpoint_state=functools.partial(replica_state.ReplicaState, downpour),
            read_counters=downpour.stats,
            interval_figures=interval_figures,
            figure_words=report.epoch_words,
            state=downpour,
            finish=downpour.finish,
        ),
    )
    return downpour


class DownpourTrainer:
    """A custom training loop for Downpour SGD on a `ClusterCoordinator`.

    Example:
      ```
      trainer = downpour.DownpourTrainer(model, downpour.DownpourConfig(3, 2))
      iterator = iter(trainer.per_worker_dataset(dataset_fn))
      for _ in range(100):
        trainer.step(iterator)
      trainer.join()
      print(trainer.stats())
      ```

    Args:
      model: a compiled, built tf_keras model, as for `install`.
      config: a `DownpourConfig`.
      row_sparse: as for `install`.

    Attributes:
      downpour: the `Downpour` state.

    Raises:
      ValueError: as for `install`.
      TypeError: as for `install`.
    """

    def __init__(
        self,
        model: tf_keras.Model,
        config: DownpourConfig,
        row_sparse: Sequence[tf.Variable] | None = None,
    ):
        self.model = model
        self.strategy = model.distribute_strategy
        self.downpour = _make_downpour(model, config, row_sparse)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
            self.strategy
        )
        train_step = _make_train_step(model, self.downpour, downpour_logs=True)

        @tf.function
        def worker_fn(iterator):
            return self.strategy.run(train_step, args=(next(iterator),))

        self._worker_fn = worker_fn

    def per_worker_dataset(self, dataset_fn: Callable[[], tf.data.Dataset]):
        """`ClusterCoordinator.create_per_worker_dataset` of this trainer."""
        return self.coordinator.create_per_worker_dataset(dataset_fn)

    def step(self, iterator):
        """Schedules one local step; returns the `RemoteValue` of its logs."""
        return self.coordinator.schedule(self._worker_fn, args=(iterator,))

    def join(self) -> None:
        """Waits for every scheduled step."""
        self.coordinator.join()

    def finish(self) -> list[str]:
        """The end of training, after the last `join()`: with the outer rule,
        the replicas' unsent progress averaged into the ps
        (`Downpour.finish`); lines for the console."""
        return self.downpour.finish()

    def stats(self) -> list[ReplicaStats]:
        """Each replica's counters, after `join()`; see `Downpour.stats`."""
        return self.downpour.stats()


class DownpourMetrics(tf_keras.callbacks.Callback):
    """Adds each epoch's Downpour figures to the `fit` logs (and so TensorBoard).

    At every epoch end it reads the replicas' counters (`Downpour.stats`) and
    writes the epoch's figures (replacing per-step `staleness`,
    `bytes_fetched` and `bytes_pushed` values, should the logs hold any):

    * `replica{i}/staleness`: mean staleness of replica i's pushes in the epoch
      (ps updates by other replicas between its fetch and its push);
    * `replica{i}/steps`: steps replica i ran in the epoch;
    * `bytes_fetched_per_step`, `bytes_pushed_per_step`: parameter bytes moved
      per step over all replicas (tensor sizes; `benchmarks/downpour_bench.py`
      checks them against socket counters);
    * `nonfinite_pushes`: pushes dropped for a NaN or inf in the epoch
      (`nonfinite="skip"`, `push_guard`).

    Put it before the callback that prints or writes the logs.

    Args:
      downpour: the `Downpour` state `install` returned.
    """

    def __init__(self, downpour: Downpour):
        super().__init__()
        self.downpour = downpour
        self._last: list[ReplicaStats] = []

    def on_train_begin(self, logs=None):
        # Counters restored by a resume count earlier runs' steps.
        try:
            self._last = self.downpour.stats()
        except (tf.errors.CancelledError, tf.errors.UnavailableError):
            pass  # A worker lost right now: figures from the last reading.

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        try:
            now = self.downpour.stats()
        except (tf.errors.CancelledError, tf.errors.UnavailableError):
            return  # A worker lost right now: this epoch's figures are left out.
        figures = interval_figures(now, self._last)
        self._last = now
        for key in ("staleness", "bytes_fetched", "bytes_pushed"):
            logs.pop(key, None)
        logs.update(figures)


def interval_figures(
    now: Sequence[ReplicaStats], last: Sequence[ReplicaStats]
) -> dict[str, float]:
    """The Downpour figures between two readings of the replicas' counters.

    Args:
      now: `Downpour.stats()` now.
      last: `Downpour.stats()` at the start of the interval (None or empty:
        since the start).

    Returns:
      `{"replica{i}/steps", "replica{i}/staleness", "bytes_fetched_per_step",
      "bytes_pushed_per_step", "nonfinite_pushes"}` over the interval (see
      `DownpourMetrics`).
    """
    last = list(last or []) or [ReplicaStats() for _ in now]
    figures: dict[str, float] = {}
    steps = fetched = pushed = nonfinite = 0
    for i, (a, b) in enumerate(zip(now, last)):
        nonfinite += a.nonfinite_pushes - b.nonfinite_pushes
        d_steps, d_pushes = a.steps - b.steps, a.pushes - b.pushes
        d_dropped = a.dropped_pushes - b.dropped_pushes
        stale = a.staleness_sum - b.staleness_sum
        figures[f"replica{i}/steps"] = d_steps
        figures[f"replica{i}/staleness"] = stale / max(d_pushes + d_dropped, 1)
        steps += d_steps
        fetched += a.bytes_fetched - b.bytes_fetched
        pushed += a.bytes_pushed - b.bytes_pushed
    figures["bytes_fetched_per_step"] = fetched / max(steps, 1)
    figures["bytes_pushed_per_step"] = pushed / max(steps, 1)
    figures["nonfinite_pushes"] = nonfinite
    return figures
