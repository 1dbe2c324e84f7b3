r"""Sandblaster L-BFGS: the cost of checkpointing its state, side by side.

Runs the same L-BFGS job (the problem of `sandblaster_bench.py`: a tanh MLP on
synthetic data, 2 workers, 2 ps) `--iters` iterations without checkpoints,
then writing the L-BFGS state (iterate, gradient, `(s, y)` history) to a
`model_dir` every iteration and every `--every` iterations
(`SandblasterConfig.checkpoint_every_iters`), and prints one table: seconds
per iteration, the ratio to no checkpoints, and the size of one checkpoint.
The run without checkpoints comes first and again last: the two show how much
the machine's speed drifted meanwhile.

Usage:
  python benchmarks/sandblaster_checkpoint_bench.py --iters=10 --every=5
"""

import os
import sys

os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glob
import tempfile
import time

from absl import app, flags, logging

from benchmarks import sandblaster_bench
from tf_distbelief import console

flags.DEFINE_integer("examples", 8192, "Training examples.", lower_bound=64)
flags.DEFINE_integer("features", 256, "Input features.", lower_bound=1)
flags.DEFINE_integer("hidden", 1024, "Hidden units.", lower_bound=1)
flags.DEFINE_integer("portions", 16, "Work portions per batch.", lower_bound=1)
flags.DEFINE_integer("history", 10, "L-BFGS (s, y) pairs.", lower_bound=1)
flags.DEFINE_integer("iters", 10, "L-BFGS iterations per run.", lower_bound=2)
flags.DEFINE_integer("every", 5, "Iterations between checkpoints.", lower_bound=1)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import tensorflow as tf
    import tf_keras

    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel("WARNING")

    from tf_distbelief import cluster
    from tf_distbelief import strategy as strategy_lib
    from tf_distbelief.sandblaster import config as config_lib
    from tf_distbelief.sandblaster import trainer as trainer_lib

    x, y = sandblaster_bench.make_data(FLAGS.examples, FLAGS.features, 0)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows = []
    with cluster.LocalCluster(2, 2) as local:
        strategy = strategy_lib.DistBeliefStrategy(local.resolver)
        baseline = None
        for name, every in [
            ("no checkpoints", None),
            ("every iteration", 1),
            (f"every {FLAGS.every} iterations", FLAGS.every),
            ("no checkpoints, again", None),
        ]:
            model = sandblaster_bench.build_model(FLAGS.features, FLAGS.hidden, 0)
            config = config_lib.SandblasterConfig(
                history=FLAGS.history,
                portions=FLAGS.portions,
                checkpoint_every_iters=every or 1,
            )
            trainer = trainer_lib.SandblasterTrainer(
                strategy, model, loss_fn, x, y, config
            )
            trainer.fit(max_iters=1)  # Warm-up: traces the portion function.
            model_dir = tempfile.mkdtemp() if every else None
            start = time.monotonic()
            result = trainer.fit(
                max_iters=FLAGS.iters, gtol=0.0, ftol=0.0, model_dir=model_dir
            )
            secs = (time.monotonic() - start) / result.num_iters
            baseline = baseline or secs
            size_mb = ""
            if model_dir:
                ckpt = glob.glob(os.path.join(model_dir, "sandblaster", "ckpt-*"))
                last = max(int(p.split("ckpt-")[1].split(".")[0]) for p in ckpt)
                files = glob.glob(
                    os.path.join(model_dir, "sandblaster", f"ckpt-{last}.*")
                )
                size_mb = f"{sum(os.path.getsize(f) for f in files) / 1e6:.1f}"
            rows.append([name, f"{secs:.3f}", f"{secs / baseline:.2f}x", size_mb])
            trainer.objective.close()
    params = FLAGS.features * FLAGS.hidden + FLAGS.hidden + FLAGS.hidden * 10 + 10
    print(
        f"\n{params} parameters, history {FLAGS.history}, {FLAGS.examples} examples, "
        f"{FLAGS.iters} iterations, 2 workers, 2 ps\n"
    )
    header = ["checkpoints", "secs/iteration", "vs none", "MB per checkpoint"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    app.run(console.exiting(main, keep=(app.UsageError,)))
