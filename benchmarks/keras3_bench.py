r"""Examples/s of the Keras 3 path against the tf_keras path, side by side.

A Keras 3 model trained by `tf_distbelief.keras3.fit` (each step a
scheduled function calling `model.stateless_call` on the ps values, AdaGrad on
the ps shards) against the same model built with tf_keras and trained by its
`Model.fit` under `DistBeliefStrategy` (the stock parameter-server path), on
the speech model's shape (`tf_distbelief.demos.speech`) or the digits MLP
(`--model=digits`), one local cluster, one strategy.

The two paths alternate (`--repeats` rounds of tf_keras then Keras 3), so that
load changes on a shared machine hit both alike. A round trains `--epochs`
epochs of `--steps` steps; the first epoch (tracing) is left out, and the round's
time is the median of the other epochs. The Keras 3 epoch includes copying the
ps values into the model at its end (`PsWeights.write_to_model`), which the
tf_keras path does not do. The table gives the median examples/s over rounds and
the ratio Keras 3 / tf_keras.

With `--n_fetch` and `--n_push` both paths train by Downpour SGD (tf_keras:
`downpour.install`; Keras 3: `keras3.fit(downpour=...)`), in segments of
`--steps_per_execution` steps per scheduled function.

  python benchmarks/keras3_bench.py --num_workers=2 --num_ps=2
  python benchmarks/keras3_bench.py --n_fetch=4 --n_push=4
  python benchmarks/keras3_bench.py --n_fetch=4 --n_push=4 --model=digits
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tf_keras  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import tf_distbelief as tfdb  # noqa: E402
from tf_distbelief import console, keras3  # noqa: E402
from tf_distbelief import strategy as strategy_lib  # noqa: E402
from tf_distbelief.demos import digits, speech  # noqa: E402
from tf_distbelief.fit import training

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_integer("num_workers", 2, "Workers.", lower_bound=1)
    flags.DEFINE_integer("num_ps", 2, "ps tasks.", lower_bound=1)
    flags.DEFINE_enum("model", "speech", ["speech", "digits"], "Model trained.")
    flags.DEFINE_integer("hidden_units", 256, "Speech model width.", lower_bound=1)
    flags.DEFINE_integer("classes", 8192, "Speech model softmax.", lower_bound=2)
    flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
    flags.DEFINE_integer("steps", 200, "Steps per epoch.", lower_bound=10)
    flags.DEFINE_integer(
        "epochs", 3, "Epochs per round (first left out).", lower_bound=2
    )
    flags.DEFINE_integer("repeats", 2, "Rounds of each path.", lower_bound=1)
    flags.DEFINE_integer(
        "steps_per_execution", 10, "Steps per function.", lower_bound=1
    )
    flags.DEFINE_integer(
        "n_fetch", 0, "Downpour: steps between fetches (0: stock).", lower_bound=0
    )
    flags.DEFINE_integer(
        "n_push", 0, "Downpour: steps between pushes (0: stock).", lower_bound=0
    )


def _epoch_timer(base):
    class EpochTimer(base):
        def __init__(self):
            super().__init__()
            self.secs = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.secs.append(time.perf_counter() - self._start)

    return EpochTimer()


def _build(keras3: bool):
    """The `--model` model, in Keras 3 or tf_keras."""
    if FLAGS.model == "digits":
        return digits.build_keras3_model() if keras3 else digits.build_model()
    build = speech.build_keras3_model if keras3 else speech.build_model
    return build(FLAGS.hidden_units, FLAGS.classes)


def _downpour():
    """The rows' `DownpourConfig`, or None for stock training."""
    if not FLAGS.n_fetch and not FLAGS.n_push:
        return None
    return tfdb.downpour.DownpourConfig(FLAGS.n_fetch, FLAGS.n_push)


def _tf_keras_round(strategy, x, y):
    with strategy.scope():
        model = _build(keras3=False)
        model.compile(
            tfdb.adagrad.Adagrad(0.1),
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=FLAGS.steps_per_execution,
        )
    if _downpour() is not None:
        tfdb.downpour.install(model, _downpour())
    timer = _epoch_timer(tf_keras.callbacks.Callback)
    model.fit(
        training.dataset_creator(x, y, FLAGS.batch_size),
        epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps,
        callbacks=[timer],
        verbose=0,
    )
    return float(np.median(timer.secs[1:]))


def _keras3_round(strategy, x, y):
    model = _build(keras3=True)
    timer = _epoch_timer(keras.callbacks.Callback)
    keras3.fit(
        model,
        x,
        y,
        strategy=strategy,
        epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps,
        steps_per_execution=FLAGS.steps_per_execution,
        batch_size=FLAGS.batch_size,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=(),
        callbacks=[timer],
        downpour=_downpour(),
    )
    return float(np.median(timer.secs[1:]))


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.model == "digits":
        (x, y), _ = digits.load_data()
    else:
        (x, y), _ = speech.load_data(
            num_train=4096, num_test=16, num_classes=FLAGS.classes
        )
    rounds = {"tf_keras": [], "keras3": []}
    with tfdb.cluster.LocalCluster(FLAGS.num_workers, FLAGS.num_ps) as local:
        strategy = strategy_lib.DistBeliefStrategy(
            local.resolver, strategy_lib.make_partitioner("fixed", FLAGS.num_ps, 1)
        )
        if _downpour() is not None:  # Before any variable is created.
            tfdb.downpour.enable(strategy)
        for _ in range(FLAGS.repeats):
            rounds["tf_keras"].append(_tf_keras_round(strategy, x, y))
            rounds["keras3"].append(_keras3_round(strategy, x, y))
        examples = FLAGS.steps * FLAGS.batch_size
        rate = {k: examples / float(np.median(v)) for k, v in rounds.items()}
        shape = (
            "digits"
            if FLAGS.model == "digits"
            else f"speech {FLAGS.hidden_units}x{FLAGS.classes}"
        )
        print(
            f"{shape}, {FLAGS.num_workers} "
            f"workers, {FLAGS.num_ps} ps, batch {FLAGS.batch_size}, "
            f"steps_per_execution {FLAGS.steps_per_execution}, "
            + (f"Downpour {_downpour()}" if _downpour() else "stock"),
            flush=True,
        )
        print("| path | examples/s | ratio to tf_keras |", flush=True)
        print("| --- | --- | --- |", flush=True)
        for name in rounds:
            print(
                f"| {name} | {rate[name]:.0f} | {rate[name] / rate['tf_keras']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    define_flags()
    app.run(console.exiting(main, keep=(app.UsageError,)))
