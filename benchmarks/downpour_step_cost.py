r"""What a Downpour replica's local step costs against a plain training step.

The target for Downpour at `n_fetch = n_push = 16` is at least 0.85x the
examples/s of one process with no cluster (`single` in
`benchmarks/downpour_bench.py`). Between two exchanges with the ps a replica
(`downpour.replica.Replica.run_steps`, Dean et al. 2012, section 4.1) takes
each local step on its cache as `single` does (the gradient, then AdaGrad's
fused `ResourceApplyAdagradV2`) and also adds the gradient to the sum to push,
`G += g`: one more pass over the model's parameters per step (9.7 MB on the
speech-shaped model: 440-256x4-8192, 2.4M parameters), at batch 32. (The sum of
squares a push carries by default is the growth of the local AdaGrad
accumulator since the last push, `PushedSquares.LOCAL`: no pass of its own.)
This script times, with no cluster, one step of:

* `adagrad`: gradient and AdaGrad, `single`'s step;
* `adagrad + G`: with the sum of gradients, a replica's local step between
  two exchanges with the ps (`--local_optimizer=adagrad`, the default);
* `adagrad + outer delta`: with the outer rule's sum of the local steps
  instead (`G += before - after`, `outer_learning_rate` set): the value before
  the step is kept while AdaGrad writes the variable, so the write copies it;

each in a child process with 1 intra-op thread (a worker of the local
cluster, one of 2 on 2 cores) and, for `adagrad`, with 2 (`single`, which has
both cores to itself); then the 1-thread rows again in two children at once
(`1, 2 at once`, the mean of the two), as the cluster's 2 workers run, sharing
the cores' caches and memory bandwidth. `ceiling x single` is
`2 x t(adagrad, 2 threads) / t(row)`: the examples/s of 2 workers that each
have a core to themselves and spend it only on this step, as a ratio to
`single`'s, the most Downpour could reach here before the ps, the chief, gRPC
and the exchanges take their share.

The children run in turn for each of `--rounds` rounds, so that a change of
load hits every row alike; a row's time is the median over rounds of each
round's median step time (`--steps` steps after a warm-up, in 10 chunks,
the rows' chunks in turn), `[min-max]` over rounds.

Usage:
  python benchmarks/downpour_step_cost.py  # About 5 minutes on 2 idle cores.
"""

import json
import os
import subprocess
import sys
import time

# The repository root, for `tf_distbelief` (run as a script from anywhere).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

ROWS = ("adagrad", "adagrad + G", "adagrad + outer delta")


def define_flags():
    flags.DEFINE_integer("steps", 200, "Timed steps per row and round.", lower_bound=5)
    flags.DEFINE_integer("rounds", 5, "Rounds of every child.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
    flags.DEFINE_integer(
        "child_threads", 0, "Internal: run as the child with this many threads."
    )


FLAGS = flags.FLAGS


def _child(threads: int, steps: int, batch_size: int) -> dict:
    """Median milliseconds per step of each row, with `threads` intra-op threads.

    Returns:
      `{row: ms}` for every row of `ROWS` (1 thread) or `adagrad` alone.
    """
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    import tf_keras

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    from tf_distbelief.demos import speech

    model = speech.build_model()
    model.build((None, speech.NUM_FEATURES))
    variables = model.trainable_variables
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch_size, speech.NUM_FEATURES), np.float32))
    y = tf.constant(rng.integers(0, speech.PAPER_NUM_CLASSES, batch_size))
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def zeros(value):
        return [tf.Variable(tf.fill(v.shape, value)) for v in variables]

    accumulators, sums = zeros(0.1), zeros(0.0)
    lr, epsilon = tf.constant(0.2), tf.constant(1e-7)

    def make_step(row: str):
        @tf.function
        def run(n):
            for _ in tf.range(n):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, variables)
                ops = []
                for v, a, g, s in zip(variables, accumulators, grads, sums):
                    # The outer rule's bookkeeping (`base.VariableKind.local_ops`):
                    # the value before the step, kept while the step writes.
                    before = v.read_value() if row == ROWS[2] else None
                    deps = [] if before is None else [before]
                    with tf.control_dependencies(deps):
                        stepped = tf.raw_ops.ResourceApplyAdagradV2(
                            var=v.handle, accum=a.handle, lr=lr, epsilon=epsilon, grad=g
                        )
                    ops.append(stepped)
                    if row == ROWS[1]:
                        ops.append(s.assign_add(g))
                    elif row == ROWS[2]:
                        with tf.control_dependencies([stepped]):
                            ops.append(s.assign_add(before - v.read_value()))
                tf.group(*ops)

        return run

    rows = ROWS if threads == 1 else ROWS[:1]
    runs = {row: make_step(row) for row in rows}
    for run in runs.values():
        run(tf.constant(3))  # Trace and warm up.
    chunk = max(steps // 10, 1)
    times = {row: [] for row in rows}
    for _ in range(10):  # The rows' chunks in turn: load changes hit both.
        for row, run in runs.items():
            start = time.perf_counter()
            run(tf.constant(chunk))
            times[row].append((time.perf_counter() - start) / chunk * 1000)
    result = {row: float(np.median(t)) for row, t in times.items()}
    return result


def _run_children(threads: int, count: int = 1) -> list[dict]:
    """Runs `count` children with `threads` threads at once; their results."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--child_threads={threads}",
        f"--steps={FLAGS.steps}",
        f"--batch_size={FLAGS.batch_size}",
    ]
    children = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    results = []
    try:
        for child in children:
            out, err = child.communicate(timeout=600)
            if child.returncode:
                raise RuntimeError(
                    f"The {threads}-thread child failed (exit {child.returncode}): "
                    f"{err[-3000:]}"
                )
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for child in children:  # A failed or timed-out run leaves none behind.
            if child.poll() is None:
                child.kill()
                child.wait()
    return results


def main(argv):
    del argv
    if FLAGS.child_threads:
        result = _child(FLAGS.child_threads, FLAGS.steps, FLAGS.batch_size)
        print(json.dumps(result), flush=True)
        return
    times = {}  # (row, threads) -> [ms per round]
    for r in range(FLAGS.rounds):
        for threads in (1, 2):
            for row, ms in _run_children(threads)[0].items():
                times.setdefault((row, threads), []).append(ms)
        # Two 1-thread children at once, as the cluster's 2 workers run: they
        # share the cores' caches and memory bandwidth.
        both = _run_children(1, count=2)
        for row in ROWS:
            ms = float(np.mean([b[row] for b in both]))
            times.setdefault((row, "1, 2 at once"), []).append(ms)
        print(f"round {r + 1} of {FLAGS.rounds} done", flush=True)
    timed = 10 * max(FLAGS.steps // 10, 1)  # `_child`'s 10 chunks.
    single = float(np.median(times[ROWS[0], 2]))
    base = float(np.median(times[ROWS[0], 1]))
    print(
        f"\nOne training step of the speech-shaped model, batch {FLAGS.batch_size}"
        f" (median over {FLAGS.rounds} round(s) of {timed} steps):\n",
        flush=True,
    )
    header = [
        "row",
        "threads",
        "ms/step [min-max]",
        "x adagrad (1 thread)",
        "ceiling x single",
    ]
    lines = [header, ["---"] * len(header)]
    for (row, threads), values in times.items():
        ms = float(np.median(values))
        lines.append(
            [
                row,
                str(threads),
                f"{ms:.2f} [{min(values):.2f}-{max(values):.2f}]",
                f"{ms / base:.2f}" if threads != 2 else "",
                f"{2 * single / ms:.2f}" if threads != 2 else "1.00 (single)",
            ]
        )
    for line in lines:
        print("| " + " | ".join(line) + " |", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
