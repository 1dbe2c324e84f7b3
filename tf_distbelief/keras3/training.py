"""`fit`: stock asynchronous training of a Keras 3 model on the ps (section 4).

Each step is a `tf.function` that `ClusterCoordinator.schedule` sends to a free
worker (Dean et al. 2012, section 4.1, with `n_fetch = n_push = 1`): it reads
the ps values (`PsWeights`), calls `model.stateless_call` on them, takes the
gradient with `tf.GradientTape` and applies AdaGrad on each ps shard with the
fused op. The Keras 3 model itself stays on the coordinator; only traced ops
reach the workers. Keras 3's own `Model.fit` cannot do this (README: Keras 3).

`fit` checks its arguments (`training_args`), holds the model_dir's lock
(`paths.model_dir_lock`, as tf_keras `fit.fit`), creates the run's objects
(`training_setup`) and trains its epochs (`training_loop`).
"""

from __future__ import annotations

import keras

from tf_distbelief import console, paths
from tf_distbelief import downpour as downpour_lib
from tf_distbelief.faults import goodput as goodput_lib
from tf_distbelief.keras3 import optimizer as optimizer_lib
from tf_distbelief.keras3 import training_args, training_loop, training_setup
from tf_distbelief.keras3 import variables as variables_lib


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
    goodput: goodput_lib.Goodput | None = None,
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
      verbose: 1 prints one line per epoch with `print_fn`, in tf_keras's
        `fit.fit` format (`fit.lines`): `epoch 2/5: steps 200/500
        loss=0.1234 accuracy=0.9700 1,843 examples/s, elapsed 4s, ETA 6s;
        goodput 61.2%` (the global steps done; the goodput with `goodput`).
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
      goodput: the job's `faults.goodput.Goodput`, fed with when training
        runs, the steps done and the checkpoints' time; None: the job's
        (`goodput.current()`), if any.

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
    args = training_args.FitArgs(
        x=x,
        y=y,
        dataset=dataset,
        batch_size=batch_size,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        steps_per_execution=steps_per_execution,
        validation_data=validation_data,
        initial_epoch=initial_epoch,
        verbose=verbose,
        print_fn=print_fn,
        seed=seed,
        model_dir=model_dir,
        checkpoint_every_steps=checkpoint_every_steps,
        nonfinite=nonfinite,
        log_every_steps=log_every_steps,
    )
    training_args.check(model, args)
    rule = optimizer_lib.from_optimizer(optimizer)
    loss_fn = training_args.loss_function(model, loss)
    metrics = [training_args.metric(m, y) for m in (metrics or ())]
    for metric in metrics:
        metric.reset_state()
    if downpour is not None:
        training_args.check_downpour(
            model, rule, optimizer, ps_weights, downpour, steps_per_execution
        )
        downpour_lib.enable(strategy)
    if goodput is None:
        goodput = goodput_lib.current()
    with paths.model_dir_lock(model_dir, print_fn):
        run = training_setup.setup(
            model, strategy, args, loss_fn, metrics, rule, ps_weights, downpour
        )
        return training_loop.train(run, args, callbacks, goodput)
