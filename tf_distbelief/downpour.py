"""Downpour SGD on `DistBeliefStrategy` (Dean et al. 2012, section 4.1).

The step order is defined in `tf_distbelief.downpour_schedule` (with a NumPy
reference); this module runs it on a parameter-server cluster:

* every ps variable is a `downpour_variables.DownpourVariable` (see `enable`),
  which reads as the replica's cache during the forward pass;
* each worker keeps its cache, its accumulator and its counters in
  `per_worker_variable=True` variables, so the cadence is counted by the worker
  that runs the step, whichever worker the coordinator hands it to;
* the ps keeps an update counter (one per push), for staleness;
* a push runs the user's tf_keras optimizer (`update_step`, on each variable's
  ps shard) inside `tf.cond`, so a non-push step sends no gradient.

Example with `fit`:
  ```
  strategy = tfdb.DistBeliefStrategy(resolver)
  downpour.enable(strategy)  # before any variable is created
  with strategy.scope():
    model = digits.build_model()
    model.compile(tfdb.Adagrad(0.1), loss=..., metrics=["accuracy"])
    replicas = downpour.install(model, downpour.DownpourConfig(4, 4, 0.01))
  model.fit(dataset, epochs=5, steps_per_epoch=100)
  print(replicas.stats())
  ```
"""

from __future__ import annotations

import re

import tensorflow as tf
import tf_keras

from tf_distbelief import downpour_variables
from tf_distbelief.downpour_schedule import DownpourConfig, ReplicaStats
from tf_distbelief.downpour_variables import enable

__all__ = [
    "Downpour",
    "DownpourConfig",
    "DownpourMetrics",
    "DownpourTrainer",
    "ReplicaStats",
    "enable",
    "install",
]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name.split(":")[0])


_STAT_NAMES = (
    "steps",
    "fetches",
    "pushes",
    "dropped_pushes",
    "staleness_sum",
    "max_staleness_seen",
)


def _read(handle, dtype):
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def _assign(handle, value):
    return tf.raw_ops.AssignVariableOp(resource=handle, value=value)


def _add(handle, value):
    return tf.raw_ops.AssignAddVariableOp(resource=handle, value=value)


def _after(ops, value):
    """`value` as a tensor that runs after `ops` (a `tf.cond` branch output)."""
    with tf.control_dependencies(ops):
        return tf.identity(value)


class Downpour:
    """The per-replica state of Downpour SGD and its step.

    Create it under the strategy's scope, after the model's variables (created
    with `enable` in effect); call `step` inside a function the coordinator
    schedules on a worker (as `fit` does, or `DownpourTrainer`).

    Args:
      strategy: the `DistBeliefStrategy` the variables live on.
      variables: the trained ps variables (`model.trainable_variables`).
      optimizer: a tf_keras optimizer (e.g. `tf_distbelief.Adagrad`) applied on
        the ps to each push; it is built here if it is not yet.
      config: a `DownpourConfig`.

    Raises:
      TypeError: a variable was not created with `enable(strategy)` in effect,
        or `config` is not a `DownpourConfig`.
    """

    def __init__(self, strategy, variables, optimizer, config: DownpourConfig):
        if not isinstance(config, DownpourConfig):
            raise TypeError(
                f"Argument `config` must be a DownpourConfig. Received: {config!r}"
            )
        self.strategy = strategy
        self.config = config
        self.optimizer = optimizer
        self.variables = downpour_variables.leaf_variables(variables)
        for v in self.variables:
            if not isinstance(v, downpour_variables.DownpourVariable):
                raise TypeError(
                    f"Variable {v.name} is not Downpour-capable ({type(v).__name__})."
                    " Call `tf_distbelief.downpour.enable(strategy)` before creating "
                    "the model under `strategy.scope()`."
                )
        # Bytes moved by one fetch or one push: every parameter once.
        self.model_bytes = sum(
            v.shape.num_elements() * v.dtype.size for v in self.variables
        )
        with strategy.scope():
            if not getattr(optimizer, "_built", False):
                optimizer.build(variables)

            def per_worker(name, shape, dtype):
                return tf.Variable(
                    initial_value=lambda: tf.zeros(shape, dtype),
                    shape=shape,
                    dtype=dtype,
                    trainable=False,
                    name=name,
                    per_worker_variable=True,
                )

            self._caches = [
                per_worker(f"downpour/cache/{_slug(v.name)}", v.shape, v.dtype)
                for v in self.variables
            ]
            self._accumulators = [
                per_worker(f"downpour/accumulator/{_slug(v.name)}", v.shape, v.dtype)
                for v in self.variables
            ]
            # Per worker, int64 scalars: `seen` is the ps update count the cache
            # accounts for; `refetch` is 1 after a dropped push.
            self._seen = per_worker("downpour/seen", [], tf.int64)
            self._refetch = per_worker("downpour/refetch", [], tf.int64)
            self._stats = {
                name: per_worker(f"downpour/{name}", [], tf.int64)
                for name in _STAT_NAMES
            }
            # On the ps, int64 scalars: pushes applied, and replica 0's steps
            # during the warm start.
            self.update_count = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="downpour/update_count"
            )
            self.warm_steps = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="downpour/warm_steps"
            )

    def step(self, forward_fn):
        """One local Downpour step of the worker it runs on.

        Args:
          forward_fn: `() -> (loss, outputs)`, run with the ps variables reading
            as this replica's cache; `loss` is a scalar to differentiate.

        Returns:
          `(loss, outputs, metrics)`: `metrics` maps `staleness` (this step's
          push, -1 without one), `bytes_fetched` and `bytes_pushed` (this step)
          to int64 scalars.
        """
        cfg = self.config
        # Per-worker handles are taken here, at the top: taken inside a
        # `tf.cond` branch they would not resolve to the running worker.
        caches = [c.handle for c in self._caches]
        accs = [a.handle for a in self._accumulators]
        seen, refetch = self._seen.handle, self._refetch.handle
        stats = {name: v.handle for name, v in self._stats.items()}
        dtypes = [v.dtype for v in self.variables]
        ps_handles = [v.get().handle for v in self.variables]
        count = self.update_count.get().handle
        int64 = tf.int64

        t = _read(stats["steps"], int64)
        if cfg.warmstart_steps:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            is_first = tf.equal(worker, 0)
            warm = self.warm_steps.get().handle
            active = is_first | (_read(warm, int64) >= cfg.warmstart_steps)
            warm_op = tf.cond(
                is_first & (t < cfg.warmstart_steps),
                lambda: _after([_add(warm, tf.constant(1, int64))], True),
                lambda: tf.constant(False),
            )
        else:
            active = tf.constant(True)
            warm_op = active
        do_fetch = active & (tf.equal(t % cfg.n_fetch, 0) | (_read(refetch, int64) > 0))

        def fetch():
            ops = [
                _assign(c, _read(p, d)) for c, p, d in zip(caches, ps_handles, dtypes)
            ]
            ops += [
                _assign(seen, _read(count, int64)),
                _assign(refetch, tf.constant(0, int64)),
                _add(stats["fetches"], tf.constant(1, int64)),
            ]
            return _after(ops, True)

        fetched = tf.cond(do_fetch, fetch, lambda: tf.constant(False))
        with tf.control_dependencies([fetched, warm_op]):
            values = [_read(c, d) for c, d in zip(caches, dtypes)]
        with tf.GradientTape() as tape:
            tape.watch(values)
            with downpour_variables.substitute(zip(self.variables, values)):
                loss, outputs = forward_fn()
        grads = tape.gradient(
            loss, values, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        lr = cfg.local_learning_rate

        def local_update():
            ops = [_add(a, g) for a, g in zip(accs, grads)]
            if lr:
                ops += [
                    tf.raw_ops.AssignSubVariableOp(
                        resource=c, value=tf.cast(lr, g.dtype) * g
                    )
                    for c, g in zip(caches, grads)
                ]
            return _after(ops, True)

        updated = tf.cond(active, local_update, lambda: tf.constant(False))
        with tf.control_dependencies([updated]):
            do_push = active & tf.equal((t + 1) % cfg.n_push, 0)

        def push():
            acc_values = [_read(a, d) for a, d in zip(accs, dtypes)]
            staleness = _read(count, int64) - _read(seen, int64)
            if cfg.max_staleness is None:
                apply = tf.constant(True)
            else:
                apply = staleness <= cfg.max_staleness

            def apply_push():
                self._apply(acc_values)
                ops = [
                    _add(count, tf.constant(1, int64)),
                    _add(seen, tf.constant(1, int64)),
                    _add(stats["pushes"], tf.constant(1, int64)),
                ]
                return _after(ops, True)

            def drop_push():
                ops = [
                    _assign(refetch, tf.constant(1, int64)),
                    _add(stats["dropped_pushes"], tf.constant(1, int64)),
                ]
                return _after(ops, False)

            applied = tf.cond(apply, apply_push, drop_push)
            with tf.control_dependencies([applied]):
                ops = [_assign(a, tf.zeros_like(v)) for a, v in zip(accs, acc_values)]
                ops += [
                    _add(stats["staleness_sum"], staleness),
                    _assign(
                        stats["max_staleness_seen"],
                        tf.maximum(
                            staleness, _read(stats["max_staleness_seen"], int64)
                        ),
                    ),
                ]
            with tf.control_dependencies(ops):
                return tf.identity(staleness), tf.identity(applied)

        staleness, pushed = tf.cond(
            do_push, push, lambda: (tf.constant(-1, int64), tf.constant(False))
        )
        with tf.control_dependencies([staleness]):
            counted = tf.cond(
                active,
                lambda: _after([_add(stats["steps"], tf.constant(1, int64))], 1),
                lambda: tf.constant(0),
            )
        with tf.control_dependencies([counted]):
            zero = tf.constant(0, int64)
            model_bytes = tf.constant(self.model_bytes, int64)
            metrics = {
                "staleness": tf.identity(staleness),
                "bytes_fetched": tf.where(fetched, model_bytes, zero),
                "bytes_pushed": tf.where(pushed, model_bytes, zero),
            }
        return loss, outputs, metrics

    def _apply(self, grads):
        """Applies one push with the optimizer, variable by variable on its shard."""
        opt = self.optimizer
        grads = opt._clip_gradients(list(grads))
        for g, v in zip(grads, self.variables):
            opt._update_step(g, v)
        opt.iterations.assign_add(1)

    def stats(self) -> list[ReplicaStats]:
        """Reads every replica's counters (blocking). Index = worker index."""
        if self._stats["steps"]._per_worker_vars is None:
            return []
        columns = {
            name: [int(x.numpy()) for x in v.read_all()]
            for name, v in self._stats.items()
        }
        result = []
        for i in range(len(columns["steps"])):
            s = ReplicaStats(**{name: columns[name][i] for name in _STAT_NAMES})
            s.bytes_fetched = s.fetches * self.model_bytes
            s.bytes_pushed = s.pushes * self.model_bytes
            result.append(s)
        return result


def _check_compiled(model):
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "Argument `model` must be compiled with an optimizer (the ps applies "
            "it to each push), e.g. `model.compile(tf_distbelief.Adagrad(0.1), "
            f"loss=...)`. Received an uncompiled model: {model.name!r}"
        )
    if not model.built:
        raise ValueError(
            f"Argument `model` must be built before Downpour can cache its "
            f"variables (give it an input shape). Received: {model.name!r}"
        )


def _make_train_step(model, replicas: Downpour):
    import tf_keras

    def train_step(data):
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)

        def forward():
            y_pred = model(x, training=True)
            return model.compute_loss(x, y, y_pred, sample_weight), y_pred

        _, y_pred, metrics = replicas.step(forward)
        logs = dict(model.compute_metrics(x, y, y_pred, sample_weight))
        logs.update(metrics)
        return logs

    return train_step


def install(model, config: DownpourConfig) -> Downpour:
    """Makes `model.fit` train with Downpour SGD.

    The model must be built and compiled under the scope of a strategy on which
    `enable` was called before the model was created. `fit` then runs one local
    Downpour step per training step, on whichever worker the coordinator
    picks; its logs gain `staleness`, `bytes_fetched` and `bytes_pushed` (of
    the last step).

    Args:
      model: a compiled, built tf_keras model.
      config: a `DownpourConfig`.

    Returns:
      The `Downpour` state; `.stats()` gives each replica's counters.

    Raises:
      ValueError: the model is not compiled or not built.
      TypeError: see `Downpour`.
    """
    _check_compiled(model)
    replicas = Downpour(
        model.distribute_strategy, model.trainable_variables, model.optimizer, config
    )
    # An instance attribute wins over `Model.train_step`; the cached train
    # function is dropped so that `fit` traces the new step.
    object.__setattr__(model, "train_step", _make_train_step(model, replicas))
    model.train_function = None
    return replicas


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
    """

    def __init__(self, model, config: DownpourConfig):
        _check_compiled(model)
        self.model = model
        self.strategy = model.distribute_strategy
        self.downpour = Downpour(
            self.strategy, model.trainable_variables, model.optimizer, config
        )
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
            self.strategy
        )
        train_step = _make_train_step(model, self.downpour)

        @tf.function
        def worker_fn(iterator):
            return self.strategy.run(train_step, args=(next(iterator),))

        self._worker_fn = worker_fn

    def per_worker_dataset(self, dataset_fn):
        """`ClusterCoordinator.create_per_worker_dataset` of this trainer."""
        return self.coordinator.create_per_worker_dataset(dataset_fn)

    def step(self, iterator):
        """Schedules one local step; returns the `RemoteValue` of its logs."""
        return self.coordinator.schedule(self._worker_fn, args=(iterator,))

    def join(self) -> None:
        """Waits for every scheduled step."""
        self.coordinator.join()

    def stats(self) -> list[ReplicaStats]:
        """Each replica's counters, after `join()`; see `Downpour.stats`."""
        return self.downpour.stats()


class DownpourMetrics(tf_keras.callbacks.Callback):
    """Adds each epoch's Downpour figures to the `fit` logs (and so TensorBoard).

    At every epoch end it reads the replicas' counters (`Downpour.stats`) and
    writes the epoch's figures, replacing the last-step values that
    `train_step` logs:

    * `replica{i}/staleness`: mean staleness of replica i's pushes in the epoch
      (ps updates by other replicas between its fetch and its push);
    * `replica{i}/steps`: steps replica i ran in the epoch;
    * `bytes_fetched_per_step`, `bytes_pushed_per_step`: parameter bytes moved
      per step over all replicas (tensor sizes; `benchmarks/downpour_bench.py`
      checks them against socket counters).

    Put it before the callback that prints or writes the logs.

    Args:
      replicas: the `Downpour` object `install` returned.
    """

    def __init__(self, replicas: Downpour):
        super().__init__()
        self.replicas = replicas
        self._last: list[ReplicaStats] = []

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        now = self.replicas.stats()
        last = self._last or [ReplicaStats() for _ in now]
        self._last = now
        steps = fetched = pushed = 0
        for i, (a, b) in enumerate(zip(now, last)):
            d_steps, d_pushes = a.steps - b.steps, a.pushes - b.pushes
            d_dropped = a.dropped_pushes - b.dropped_pushes
            stale = a.staleness_sum - b.staleness_sum
            logs[f"replica{i}/steps"] = d_steps
            logs[f"replica{i}/staleness"] = stale / max(d_pushes + d_dropped, 1)
            steps += d_steps
            fetched += a.bytes_fetched - b.bytes_fetched
            pushed += a.bytes_pushed - b.bytes_pushed
        for key in ("staleness", "bytes_fetched", "bytes_pushed"):
            logs.pop(key, None)
        logs["bytes_fetched_per_step"] = fetched / max(steps, 1)
        logs["bytes_pushed_per_step"] = pushed / max(steps, 1)
