"""`fit`: stock asynchronous training of a Keras 3 model on the ps (section 4).

Each step is a `tf.function` that `ClusterCoordinator.schedule` sends to a free
worker (Dean et al. 2012, section 4.1, with `n_fetch = n_push = 1`): it reads
the ps values (`PsWeights`), calls `model.stateless_call` on them, takes the
gradient with `tf.GradientTape` and applies AdaGrad on each ps shard with the
fused op. The Keras 3 model itself stays on the coordinator; only traced ops
reach the workers. Keras 3's own `Model.fit` cannot do this (README: Keras 3).
"""

from __future__ import annotations

import contextlib
import re
import time

import keras
import numpy as np
import tensorflow as tf

from tf_distbelief import checks, console, errors, paths
from tf_distbelief.keras3 import optimizer as optimizer_lib
from tf_distbelief.keras3 import step as step_lib
from tf_distbelief.keras3 import variables as variables_lib

# `tf_distbelief.faults.nonfinite.MODES`, which imports tf_keras (this module
# does not); tests/keras3 checks that the two agree.
_NONFINITE_MODES = ("raise", "skip")


def _metric(metric, y) -> keras.metrics.Metric:
    """A Keras 3 `Metric` for `metric` (a Metric, a name or a function)."""
    if isinstance(metric, keras.metrics.Metric):
        return metric
    if metric in ("accuracy", "acc"):
        # As Keras 3's `compile` resolves it for integer class labels.
        if y is not None and np.issubdtype(np.asarray(y).dtype, np.integer):
            return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        return keras.metrics.CategoricalAccuracy(name="accuracy")
    fn = keras.metrics.get(metric)
    if isinstance(fn, keras.metrics.Metric):
        return fn
    name = metric if isinstance(metric, str) else getattr(fn, "__name__", "metric")
    return keras.metrics.MeanMetricWrapper(fn, name=name)


def _check_arguments(model, x, y, dataset, epochs, steps_per_epoch, batch_size):
    if not isinstance(model, keras.Model):
        raise checks.argument_error(
            "model",
            "a Keras 3 `keras.Model` (tf_keras models train with "
            "`tf_distbelief.fit.training.fit`)",
            type(model),
        )
    for name, value in (
        ("epochs", epochs),
        ("steps_per_epoch", steps_per_epoch),
        ("batch_size", batch_size),
    ):
        checks.check_int(name, value, 1, "an int >= 1", "an int >= 1")
    if (dataset is None) == (x is None):
        raise ValueError(
            "Pass either `x` and `y` (NumPy arrays) or `dataset` (a batched "
            "`tf.data.Dataset` of `(x, y)`). Received: "
            f"x={'set' if x is not None else None}, dataset={dataset!r}"
        )
    if x is not None and (y is None or len(x) != len(y)):
        raise ValueError(
            "Arguments `x` and `y` must have one label per example. Received: "
            f"{len(x)} examples and {None if y is None else len(y)} labels"
        )


def _check_reliability(model_dir, checkpoint_every_steps, nonfinite) -> None:
    checks.check_checkpoint_cadence(model_dir, checkpoint_every_steps)
    checks.check_one_of("nonfinite", nonfinite, _NONFINITE_MODES)


def _check_validation_data(validation_data) -> None:
    if validation_data is None:
        return
    ok = isinstance(validation_data, (tuple, list)) and len(validation_data) == 2
    if ok:
        x_val, y_val = validation_data
        ok = len(x_val) == len(y_val) and len(x_val) > 0
    if not ok:
        shown = (
            f"{len(validation_data)} items"
            if isinstance(validation_data, (tuple, list))
            else repr(type(validation_data))
        )
        if isinstance(validation_data, (tuple, list)) and len(validation_data) == 2:
            shown = (
                f"{len(validation_data[0])} examples, {len(validation_data[1])} labels"
            )
        raise checks.argument_error(
            "validation_data",
            "`(x_val, y_val)`: two arrays with one label per example, at least one",
            shown,
        )


def _logs(fetched, metrics, metric_inits) -> dict:
    """The epoch's logs from its functions' `(loss sum, losses, deltas)`."""
    logs = {"loss": float(sum(f[0] for f in fetched) / sum(f[1] for f in fetched))}
    for k, (metric, init) in enumerate(zip(metrics, metric_inits)):
        state = [
            i + sum(np.asarray(f[2][k][j]) for f in fetched) for j, i in enumerate(init)
        ]
        logs[metric.name] = float(metric.stateless_result(state))
    return logs


def _validation_logs(model, loss_fn, metrics, validation_data, batch_size) -> dict:
    x_val, y_val = validation_data
    y_pred = model.predict(x_val, batch_size=max(batch_size, 256), verbose=0)
    logs = {"val_loss": float(loss_fn(y_val, y_pred))}
    for metric in metrics:
        metric.reset_state()
        metric.update_state(y_val, y_pred)
        logs[f"val_{metric.name}"] = float(metric.result())
        metric.reset_state()
    return logs


def fit(
    model,
    x=None,
    y=None,
    *,
    strategy,
    dataset=None,
    batch_size: int = 32,
    epochs: int = 1,
    steps_per_epoch: int,
    steps_per_execution: int = 1,
    loss=None,
    metrics=("accuracy",),
    optimizer=None,
    callbacks=None,
    validation_data=None,
    initial_epoch: int = 0,
    verbose: int = 0,
    print_fn=console.echo,
    seed: int | None = None,
    ps_weights: variables_lib.PsWeights | None = None,
    downpour=None,
    model_dir: str | None = None,
    checkpoint_every_steps: int = 0,
    nonfinite: str = "raise",
    log_every_steps: int = 0,
) -> keras.callbacks.History:
    """Trains a Keras 3 model by stock asynchronous SGD, the optimizer on the ps.

    `keras.Model.fit`'s arguments and callbacks, for a model built outside
    the strategy's scope. `PsWeights` puts each weight on the ps (sharded by
    the strategy's partitioner); every step is scheduled on a free worker
    through `ClusterCoordinator`, reads the ps values, computes the gradient
    with `model.stateless_call` and applies AdaGrad
    (`tf_distbelief.adagrad.rule`) or SGD on each ps shard; workers never wait for
    each other (Dean et al. 2012, section 4.1, with `n_fetch = n_push = 1`).
    At each epoch end the ps values are copied into the model's own variables
    before the callbacks' `on_epoch_end`, so `model.save("m.keras")` and
    `keras.callbacks.ModelCheckpoint` save the trained weights. Callbacks get
    `on_train_begin/end` and `on_epoch_begin/end` (logs: `loss`, each
    metric, `val_*`); batch hooks are not called (steps run asynchronously).
    `model.stop_training = True` (e.g. `EarlyStopping`) ends after the epoch.

    Args:
      model: a built Keras 3 `keras.Model` (TensorFlow backend), mapping
        `[batch, ...]` features to predictions, e.g. `[batch, classes]` logits.
      x: features, `[num_examples, ...]` NumPy array (with `y`; else `dataset`).
        Worker `i` of `W` reads records `i, i + W, ...` (its own shard, as
        in a tf_keras job), shuffled and repeated, in batches of `batch_size`
        (a pass's last partial batch dropped); it is embedded in the step's
        graph (keep it under 2 GB).
      y: labels, `[num_examples, ...]`.
      strategy: the `DistBeliefStrategy` (or any ParameterServerStrategy).
      dataset: instead of `x, y`: a batched `tf.data.Dataset` of `(x, y)`,
        repeated here and copied to every worker.
      batch_size: examples per step (per worker), with `x, y`.
      epochs: the epoch to train to (Keras: `initial_epoch` counts).
      steps_per_epoch: steps per epoch over all workers, a multiple of
        `steps_per_execution`.
      steps_per_execution: steps in one scheduled function (one worker, in a
        row, each on the ps values the one before it left), >= 1.
      loss: a Keras 3 loss, its name or a function `(y_true, y_pred) ->
        scalar`; None takes the loss given to `model.compile`. Losses the
        model adds (regularizers) are added.
      metrics: Keras 3 metrics or names (`"accuracy"` on integer labels is
        `SparseCategoricalAccuracy`) whose state adds up over steps (means,
        sums, confusion counts).
      optimizer: None (AdaGrad with `tf_distbelief.adagrad.Adagrad`'s defaults),
        `"adagrad"`, `"sgd"`, an `Adagrad` or `SGD` (`keras3.optimizer`), a
        `tf_distbelief.adagrad.Adagrad` or a `keras.optimizers.SGD` (momentum
        and Nesterov momentum taken); see `keras3.optimizer.from_optimizer`.
        Downpour trains with AdaGrad on the ps.
      callbacks: Keras 3 callbacks.
      validation_data: `(x_val, y_val)` NumPy arrays, evaluated on the
        coordinator with the epoch's trained weights.
      initial_epoch: the epoch to start at.
      verbose: 1 prints one line per epoch with `print_fn`: `epoch 2/5: steps
        200/500 loss 0.1234 accuracy 0.9700 (1.9 s)` (the global steps done).
      print_fn: where that line goes.
      seed: shuffle seed of the `x, y` pipeline; None shuffles each worker
        differently.
      ps_weights: the `PsWeights` of an earlier `fit` of this model on this
        strategy (`history.ps_weights`), to train on with their AdaGrad
        accumulators; None creates them from the model's current weights
        (accumulators at `initial_accumulator_value`).
      downpour: None (stock asynchronous training), or a `DownpourConfig`:
        Downpour SGD with each worker's cache (`keras3.downpour`); needs a
        model without non-trainable weights, and `strategy` a
        `DistBeliefStrategy`. With `steps_per_execution` > 1 (which needs
        `downpour.runs_segments`) each function runs its steps in segments
        between fetches and pushes, and the logged loss and metrics are those
        of the last step of each segment. `history.downpour.stats()` gives
        each replica's counters.

      model_dir: None, or the job's folder (`tf_distbelief.paths`): the
        run holds its lock (`paths.ModelDirLock`), resumes exactly from its
        latest checkpoint (every ps variable, accumulator and Downpour
        replica state bit for bit, into any number of ps tasks; the step,
        mid-epoch if need be; verified by reading them back) and writes a
        checkpoint at each epoch end (`keras3.checkpoints`). Training goes
        to `epochs * steps_per_epoch` steps in all, from the checkpoint's
        step rather than `initial_epoch`. The data restart from their
        beginning, as in the tf_keras job.
      checkpoint_every_steps: steps between checkpoints besides each epoch
        end, >= 0 (0: epoch ends only); needs `model_dir`. The checkpoint of
        step `n` is written once the steps before it are done (the workers
        wait for the write), at the first execution boundary at or after
        each multiple.
      nonfinite: `"raise"` (a step whose gradient holds a NaN or inf stops
        the run with `NonFiniteError`) or `"skip"` (the step changes no ps
        variable and is counted: `history.nonfinite_skipped`; with Downpour,
        pushes).
      log_every_steps: every so many finished steps (read while the workers
        train) a line `step 300/500: 1843 examples/s, elapsed 12s, ETA 8s`
        with `print_fn`, and with `model_dir` an `interval/examples_per_sec`
        scalar; 0 (default): none.

    Returns:
      A `keras.callbacks.History` (`history.history["loss"]`, ...); its
      `ps_weights` attribute holds the `PsWeights`; `initial_step` and
      `steps` the global steps at the start and end, `checkpoint_path` the
      last checkpoint (None without `model_dir`), `nonfinite_skipped` the
      steps (Downpour: pushes) skipped in this run, `applied_steps` the steps
      this run applied on the ps (stock training; None with Downpour, whose
      `downpour.update_count` counts pushes): each scheduled step carries an
      exactly-once token (`faults.exactly_once`), so a step that the
      coordinator runs again after a lost worker is applied once.

    Raises:
      TypeError: `model` is not a Keras 3 model.
      ValueError: bad arguments (named), an unbuilt model, a model without a
        loss, or an optimizer that does not run on the ps (named); before
        anything is created.
      NonFiniteError: a step's gradient held NaN or inf (named by
        weight; `nonfinite="raise"`); that step changed no ps variable, and
        the model holds the ps values of the steps before it. Or a
        checkpoint would have held a NaN or inf (nothing written).
    """
    _check_arguments(model, x, y, dataset, epochs, steps_per_epoch, batch_size)
    _check_reliability(model_dir, checkpoint_every_steps, nonfinite)
    _check_validation_data(validation_data)
    if not checks.is_int(initial_epoch) or initial_epoch < 0:
        raise checks.argument_error("initial_epoch", "an int >= 0", initial_epoch)
    if not checks.is_int(log_every_steps) or log_every_steps < 0:
        raise checks.argument_error("log_every_steps", "an int >= 0", log_every_steps)
    if (
        not checks.is_int(steps_per_execution)
        or steps_per_execution < 1
        or steps_per_epoch % steps_per_execution
    ):
        raise checks.argument_error(
            "steps_per_execution",
            f"an int >= 1 that divides `steps_per_epoch` ({steps_per_epoch})",
            steps_per_execution,
        )
    rule = optimizer_lib.from_optimizer(optimizer)
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise checks.argument_error(
            "loss",
            "a Keras 3 loss, its name or a function, or the model compiled with one",
            None,
        )
    loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    metrics = [_metric(m, y) for m in (metrics or ())]
    for metric in metrics:
        metric.reset_state()
    metric_inits = [[np.asarray(v.numpy()) for v in m.variables] for m in metrics]

    if downpour is not None:
        from tf_distbelief import downpour as downpour_lib

        if model.non_trainable_variables or ps_weights:
            raise ValueError(
                "Argument `downpour` needs a model without non-trainable "
                "weights and no `ps_weights`. Received: non-trainable "
                f"{[v.path for v in model.non_trainable_variables]}, "
                f"ps_weights={ps_weights!r}"
            )
        if not isinstance(rule, optimizer_lib.Adagrad):
            raise checks.argument_error(
                "optimizer",
                "AdaGrad with `downpour`: a Keras 3 model's Downpour pushes to "
                "AdaGrad on the ps",
                optimizer,
            )
        if steps_per_execution > 1 and not downpour.runs_segments:
            raise checks.argument_error(
                "steps_per_execution",
                "1 with Downpour unless it runs in segments (n_fetch > 1, "
                "n_push > 1, no warm start)",
                steps_per_execution,
                fix=f"({downpour})",
            )
        downpour_lib.enable(strategy)
    lock = contextlib.nullcontext()
    if model_dir:
        # One job per model_dir: no other process writes checkpoints here.
        lock = paths.ModelDirLock(model_dir, print_fn)
    with lock:
        return _fit(
            model,
            x,
            y,
            strategy,
            dataset,
            batch_size,
            epochs,
            steps_per_epoch,
            steps_per_execution,
            loss_fn,
            metrics,
            metric_inits,
            rule,
            callbacks,
            validation_data,
            initial_epoch,
            verbose,
            print_fn,
            seed,
            ps_weights,
            downpour,
            model_dir,
            checkpoint_every_steps,
            nonfinite,
            log_every_steps,
        )


def _fit(
    model,
    x,
    y,
    strategy,
    dataset,
    batch_size,
    epochs,
    steps_per_epoch,
    steps_per_execution,
    loss_fn,
    metrics,
    metric_inits,
    rule,
    callbacks,
    validation_data,
    initial_epoch,
    verbose,
    print_fn,
    seed,
    ps_weights,
    downpour,
    model_dir,
    checkpoint_every_steps,
    nonfinite,
    log_every_steps,
) -> keras.callbacks.History:
    """`fit` after its checks (holding the model_dir's lock)."""
    if ps_weights is None:
        weights = variables_lib.PsWeights(
            strategy, model, rule if downpour is None else None
        )
    else:
        weights = ps_weights
        weights.check_model(model)
        if weights.slot_name != rule.slot_name:
            raise ValueError(
                f"Argument `ps_weights` holds {weights.slot_name} (made for "
                f"another optimizer) and `optimizer` keeps {rule.slot_name}: "
                f"pass the optimizer they were made with. Received: {rule!r}"
            )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    # No step scheduled after a failed one runs (a NaN refused with "raise").
    # Imported here: importing this module imports no tf_keras (the strategy
    # already holds `tf_internals`).
    from tf_distbelief.tf_internals import coordinator as tf_coordinator

    tf_coordinator.cancel_queued_on_failure(coordinator)
    if dataset is None:
        per_worker = coordinator.create_per_worker_dataset(
            _arrays_dataset_fn(strategy, x, y, batch_size, seed)
        )
    else:
        per_worker = coordinator.create_per_worker_dataset(dataset.repeat())
    iterator = iter(per_worker)
    history_downpour = applied = None
    if downpour is None:
        from tf_distbelief.faults import exactly_once  # Imports no tf_keras.

        skipped = None
        with strategy.scope():  # On a ps task: every worker's steps add up.
            applied = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="applied_steps"
            )
            if nonfinite == "skip":
                skipped = tf.Variable(
                    0, dtype=tf.int64, trainable=False, name="nonfinite_skipped"
                )
        tokens = exactly_once.StepTokens(applied, strategy)
        step = step_lib.make_step(
            model,
            weights,
            loss_fn,
            metrics,
            metric_inits,
            rule,
            steps_per_execution,
            tokens,
            applied,
            skipped,
        )
    else:
        from tf_distbelief.downpour import push_guard
        from tf_distbelief.keras3 import downpour as keras3_downpour

        step, history_downpour, applied = keras3_downpour.make_step(
            strategy,
            model,
            weights,
            loss_fn,
            metrics,
            metric_inits,
            rule,
            downpour,
            steps_per_execution,
        )
        # What a push with a NaN or inf does (read when the step is traced).
        push_guard.install(history_downpour, model, nonfinite)
        skipped = history_downpour.nonfinite_skipped
        tokens = history_downpour.tokens
    skipped_before = 0 if skipped is None else int(skipped.numpy())

    def step_args():  # Fixed when scheduled: a retry keeps its tokens.
        first = tokens.take(steps_per_execution)
        return (iterator, tf.constant(first, tf.int64))

    saver = None
    initial_step = initial_epoch * steps_per_epoch
    if model_dir:
        from tf_distbelief.keras3 import checkpoints

        saver = checkpoints.Checkpoints(
            model_dir,
            weights,
            steps_per_epoch,
            checkpoint_every_steps,
            downpour=history_downpour,
            print_fn=print_fn,
        )
        # A checkpoint's step wins over `initial_epoch` (never 0: none is
        # written before a step).
        initial_step = saver.restore() or initial_step
    goodput = _goodput()
    # Imports no Keras; with a model_dir, `epoch/` and `goodput/` scalars.
    from tf_distbelief.fit import scalars

    writer = scalars.ScalarWriter(
        paths.tensorboard_dir(model_dir) if model_dir else None
    )

    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        [*(callbacks or ()), history],
        model=model,
        epochs=epochs,
        steps=steps_per_epoch,
        verbose=verbose,
    )
    model.stop_training = False
    done = initial_step
    logs = {}
    if done >= epochs * steps_per_epoch:
        print_fn(
            f"Already trained {done // steps_per_epoch} epochs (>= --epochs={epochs})."
        )
        weights.write_to_model(model)
    else:
        callback_list.on_train_begin()
        if goodput is not None:
            goodput.begin_training(done)
        follower = _follow_steps(
            applied,
            log_every_steps,
            done,
            epochs * steps_per_epoch,
            batch_size,
            writer,
            goodput,
            print_fn,
        )
        failed = True
        try:
            for epoch in range(done // steps_per_epoch, epochs):
                callback_list.on_epoch_begin(epoch)
                start, epoch_start_step = time.monotonic(), done
                results, done = _run_epoch(
                    coordinator,
                    step,
                    step_args,
                    epoch,
                    done,
                    steps_per_epoch,
                    steps_per_execution,
                    saver,
                    goodput,
                )
                logs = _logs(coordinator.fetch(results), metrics, metric_inits)
                if nonfinite == "skip":  # Else a non-finite step stops the run.
                    logs["nonfinite_skipped"] = int(skipped.numpy()) - skipped_before
                if saver is not None:
                    _save(saver, done, goodput)
                weights.write_to_model(model)
                if validation_data is not None:
                    logs.update(
                        _validation_logs(
                            model, loss_fn, metrics, validation_data, batch_size
                        )
                    )
                rate = (done - epoch_start_step) * batch_size
                rate /= max(time.monotonic() - start, 1e-9)
                writer.write(
                    scalars.EPOCH_PREFIX, dict(logs, examples_per_sec=rate), done
                )
                writer.write_goodput(goodput, done)
                if verbose:
                    values = " ".join(
                        f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}"
                        for k, v in logs.items()
                    )
                    print_fn(
                        f"epoch {epoch + 1}/{epochs}: steps {done}/"
                        f"{epochs * steps_per_epoch} {values} "
                        f"({time.monotonic() - start:.1f} s)"
                    )
                callback_list.on_epoch_end(epoch, logs)
                if model.stop_training:
                    break
            failed = False
        except errors.NonFiniteError:
            # The ps hold the steps before it, as a model after Keras's own
            # `fit` failed holds its weights at the failure.
            weights.write_to_model(model)
            raise
        finally:
            if follower is not None:
                follower.close()
            if goodput is not None:
                goodput.end_training(done, failed)
        callback_list.on_train_end(logs)
    history.ps_weights = weights
    history.downpour = history_downpour
    history.initial_step = initial_step
    history.steps = done
    history.checkpoint_path = saver.latest if saver is not None else None
    history.nonfinite_skipped = (
        0 if skipped is None else int(skipped.numpy()) - skipped_before
    )
    history.applied_steps = (
        None if history_downpour is not None else int(applied.numpy())
    )
    return history


def _arrays_dataset_fn(strategy, x, y, batch_size, seed):
    """Each worker's dataset of `x, y`: worker `i` of `W` reads its own shard
    (`fit.shards`, as a tf_keras job's `dataset_creator`)."""
    from tf_distbelief.fit import shards  # Imports no Keras.

    num_workers = max(1, getattr(strategy, "num_workers", 1))
    return shards.arrays_dataset_fn(
        np.asarray(x), np.asarray(y), batch_size, seed, lambda: num_workers
    )


def _follow_steps(
    counter, every, start_step, total_steps, batch_size, writer, goodput, print_fn
):
    """`step 300/500: ... examples/s, elapsed, ETA` lines and `interval/` scalars.

    Every `every` finished steps (`fit.follower`: `counter`, an int64 ps
    variable of the steps this run finished, read from a thread without
    stopping the workers); None for `every` 0.
    """
    if not every:
        return None
    from tf_distbelief.fit import follower as follower_lib  # Imports no Keras.
    from tf_distbelief.fit import scalars

    clock = follower_lib.RunClock(start_step, total_steps)
    first = int(counter.numpy())

    def on_interval(finished, step, rate):
        del finished
        print_fn(clock.interval_line(step, rate))
        writer.write(scalars.INTERVAL_PREFIX, {"examples_per_sec": rate}, step)
        writer.write_goodput(goodput, step)

    return follower_lib.StepFollower(
        lambda: int(counter.numpy()) - first,
        every,
        start_step,
        batch_size,
        on_interval,
        on_read=None if goodput is None else goodput.step_done,
    )


def _goodput():
    """The job's `faults.goodput.Goodput`, if one is active (a launched job)."""
    import sys

    # Only a job that imported it has one; importing it here would not.
    module = sys.modules.get("tf_distbelief.faults.goodput")
    return None if module is None else module.current()


def _save(saver, done, goodput) -> None:
    if goodput is None:
        saver.save(done)
        return
    with goodput.timing("checkpointing"):
        saver.save(done)
    goodput.step_done(done)


def _run_epoch(
    coordinator,
    step,
    step_args,
    epoch,
    done,
    steps_per_epoch,
    steps_per_execution,
    saver,
    goodput,
):
    """Schedules the rest of epoch `epoch` from global step `done`, waits for it.

    Each scheduled function is `step(*step_args())`.

    With a `saver`, the scheduling stops at each mid-epoch checkpoint: the
    steps before it finish (`join`), the checkpoint is written, and the next
    steps are scheduled.

    Returns:
      `(results, done)`: the scheduled functions' `RemoteValue`s and the
      global step at the epoch's end.
    """
    end = (epoch + 1) * steps_per_epoch
    results = []
    while done < end:
        stop = end
        upcoming = None if saver is None else saver.next_save(done)
        if upcoming is not None and upcoming < end:
            stop = upcoming
        executions = -(-(stop - done) // steps_per_execution)
        results += [
            coordinator.schedule(step, args=step_args()) for _ in range(executions)
        ]
        done = min(done + executions * steps_per_execution, end)
        _join(coordinator, epoch)
        if done < end:
            _save(saver, done, goodput)
    return results, done


def _join(coordinator, epoch) -> None:
    """`coordinator.join()`, a step's non-finite gradient raised named."""
    try:
        coordinator.join()
    except tf.errors.InvalidArgumentError as error:
        if step_lib.NONFINITE_TAG in str(error):
            found = re.search(re.escape(step_lib.NONFINITE_TAG) + r"(\S+)", str(error))
            raise errors.NonFiniteError(
                f"Epoch {epoch + 1}: a step's gradient of weight "
                f"`{found.group(1)}` held NaN or inf; no ps variable took that "
                "step. Check the data and lower the learning rate, or pass "
                "`nonfinite='skip'` (--nonfinite=skip) to skip such steps.",
                step=None,
                variables=[found.group(1)],
            ) from error
        from tf_distbelief.faults import nonfinite as nonfinite_lib

        named = nonfinite_lib.error_from(error)  # A Downpour push.
        if named is None:
            raise
        raise named from error
