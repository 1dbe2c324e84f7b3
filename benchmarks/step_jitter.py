r"""How much a worker's step time varies on the local cluster: the planner's
`--step_jitter_ms`.

After each join of the coordinator every worker starts its next step at
once, so their exchanges with the ps meet at the ps NIC. A NIC that shares
its rate fairly keeps the offset between two workers' transfers as it is;
only the variation of their step times moves them apart, a random walk: `j`
exchanges of `s` steps after a join, two workers are apart by about
`sigma * sqrt(2 j s)`, `sigma` the standard deviation of one step's time
(`tf_distbelief.planner.Cluster.step_jitter_secs`).

This script measures `sigma` where the benchmark's rows run: a `LocalCluster`
of 2 workers and 1 ps (one intra-op thread per task, unshaped), stock
parameter-server training of the speech-shaped model (`--speech_hidden_units`,
`--speech_classes`) at batch `--batch_size`, `--steps_per_execution` steps
per scheduled function, each step's end stamped on its worker
(`tf.timestamp`). Printed: a step's mean and standard deviation (ms), and
the standard deviation of the time of `s` consecutive steps over
`sqrt(s)` for s = 4 and 16 (equal to a step's when steps vary
independently, larger when slow steps come together), over `--rounds`
rounds: medians and `[min-max]`.

Usage:
  python benchmarks/step_jitter.py   # about 3 minutes on 2 idle cores
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from tf_distbelief import console  # noqa: E402  (no TensorFlow)
from tf_distbelief.cluster.network import isolation  # noqa: E402  (no TensorFlow)

if __name__ == "__main__":
    # As the benchmark's rows: the cluster in the private network namespace,
    # entered while no TensorFlow is loaded and no thread runs.
    isolation.enter_private_network()

SPANS = (4, 16)


def define_flags():
    flags.DEFINE_integer("rounds", 3, "Rounds, each on a new cluster.", lower_bound=1)
    flags.DEFINE_integer(
        "functions", 40, "Timed scheduled functions per round.", lower_bound=2
    )
    flags.DEFINE_integer(
        "steps_per_execution", 20, "Steps per scheduled function.", lower_bound=17
    )
    flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
    flags.DEFINE_integer("speech_hidden_units", 256, "Speech model width.")
    flags.DEFINE_integer("speech_classes", 8192, "Speech model softmax width.")


def _round(f, seed: int) -> dict:
    """One round: step times (seconds) of every timed scheduled function."""
    import tensorflow as tf
    import tf_keras

    from tf_distbelief import cluster, demos
    from tf_distbelief import strategy as strategy_lib

    spec = demos.spec(
        "speech",
        seed=seed,
        speech_hidden_units=f.speech_hidden_units,
        speech_classes=f.speech_classes,
    )
    (x, y), _ = spec.load_data()
    steps = f.steps_per_execution
    with cluster.LocalCluster(num_workers=2, num_ps=1, intra_op_threads=1) as local:
        strategy = strategy_lib.DistBeliefStrategy(local.resolver_for(2, 1))
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
            strategy
        )
        with strategy.scope():
            model = spec.build_model(None)
            optimizer = tf_keras.optimizers.Adagrad(0.2)
            optimizer.build(model.trainable_variables)
        loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf_keras.losses.Reduction.NONE
        )

        def dataset_fn():
            data = tf.data.Dataset.from_tensor_slices((x, y))
            return data.shuffle(4096, seed=seed).repeat().batch(f.batch_size)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        def one_step(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(labels, model(features, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def timed(iterator):
            stamps = [tf.timestamp()]
            for _ in range(steps):
                with tf.control_dependencies(stamps[-1:]):
                    loss = strategy.run(one_step, args=(next(iterator),))
                with tf.control_dependencies([loss, optimizer.iterations]):
                    stamps.append(tf.timestamp())
            return tf.stack(stamps)

        for _ in range(2):  # Warm-up: tracing, first transfers.
            coordinator.schedule(timed, args=(iterator,))
        coordinator.join()
        results = [
            coordinator.schedule(timed, args=(iterator,)) for _ in range(f.functions)
        ]
        coordinator.join()
        return {"stamps": [r.fetch() for r in results]}


def summarize(stamps: list) -> dict:
    """Step mean and std (ms), and std of `s`-step sums over sqrt(s).

    Args:
      stamps: per scheduled function, `steps + 1` timestamps (seconds).
    """
    steps = np.concatenate([np.diff(s) for s in stamps])
    out = {"mean_ms": 1e3 * steps.mean(), "std_ms": 1e3 * steps.std(ddof=1)}
    for span in SPANS:
        sums = np.concatenate(
            [
                np.diff(s)[: len(s) - 1 - (len(s) - 1) % span]
                .reshape(-1, span)
                .sum(axis=1)
                for s in stamps
            ]
        )
        out[f"std{span}_ms"] = 1e3 * sums.std(ddof=1) / np.sqrt(span)
    return out


def main(argv):
    console.start_quiet_script(argv)
    f = flags.FLAGS
    rounds = []
    for r in range(f.rounds):
        figures = summarize(_round(f, seed=r)["stamps"])
        rounds.append(figures)
        console.echo(
            f"round {r + 1}/{f.rounds}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
        )
    console.echo(
        f"speech {f.speech_hidden_units}x4-{f.speech_classes}, 2 workers, 1 ps, "
        f"batch {f.batch_size}, {f.steps_per_execution} steps per function, "
        f"{f.functions} functions x {f.rounds} rounds"
    )
    console.echo(
        "| step mean ms | step std ms | "
        + " | ".join(f"std of {s} steps / sqrt({s}) ms" for s in SPANS)
        + " |"
    )
    console.echo("|---|---|" + "---|" * len(SPANS))
    cells = []
    for key in ["mean_ms", "std_ms"] + [f"std{s}_ms" for s in SPANS]:
        values = [r[key] for r in rounds]
        cells.append(f"{np.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
    console.echo("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    define_flags()
    app.run(console.exiting(main, keep=(app.UsageError,)))
