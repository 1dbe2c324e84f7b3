r"""Downpour's local step and ps accumulator modes on the speech-shaped model.

Dean et al. 2012, section 4.1 leaves open how AdaGrad on the ps treats a push
of `n_push` steps' gradients, and what step a replica takes on its own cache.
This script compares the choices of `DownpourConfig` without a cluster, with
`downpour_schedule.simulate` (the NumPy reference the TF implementation is
tested against step for step): 2 replicas taking whole steps in turn, each
reading its own shuffle of `tf_distbelief.demos.speech`'s data, batch 32,
AdaGrad gamma 0.2 on the ps (as `benchmarks/downpour_bench.py`), for `--steps`
steps in all.
Each row is one `(n, local_optimizer, adagrad_accumulator, push rule)`, `n =
n_fetch = n_push`, over `--seeds` (model initialisation and data order); `diff` is the
mean over seeds of the test accuracy's difference to `n=1` of the same seed
(plain sequential AdaGrad with steps in turn), `sd` that difference's
standard deviation over seeds.

Without a cluster the replicas' steps interleave one by one, so staleness is
what the cadence alone makes: a replica's cache misses the other replica's
pushes since its fetch. The test accuracy after 960 steps is early in
training, where runs differ by several points: read `diff` with `sd`.

With `--out_dir` (default `benchmarks/results/`) it also writes every seed's
accuracy as `downpour_modes.csv` and the mean test accuracy per configuration
as `downpour_modes.png` (`benchmarks/plots.py`).

Usage:
  python benchmarks/downpour_modes.py            # about 12 minutes, 2 cores
  python benchmarks/downpour_modes.py --seeds=0 --steps=200   # a smoke run
  python benchmarks/downpour_modes.py --out_dir= \
    --only=1/adagrad/squares/-,16/adagrad/squares/-,16/adagrad/squares/outer1
    # n=16 with a push rule (`RULES`) against n=1
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks import plots  # noqa: E402

_LEARNING_RATE = 0.2  # AdaGrad gamma on the ps, as downpour_bench's speech.
_BATCH_SIZE = 32
# The push rules compared (`DownpourConfig` options), by the name
# the rows give them: "-" none; "outer" DiLoCo's outer Nesterov on the pushed
# parameter delta (Douillard et al. 2023), "dc" DC-ASGD's delay compensation
# (Zheng et al. 2017), "stale" the staleness-scaled step (Zhang et al. 2016).
RULES = {
    "-": {},
    "outer1": {"outer_learning_rate": 1.0, "outer_momentum": 0.0},
    "outer.7m.5": {"outer_learning_rate": 0.7, "outer_momentum": 0.5},
    "outer.7m.9": {"outer_learning_rate": 0.7, "outer_momentum": 0.9},
    "outer1m.9": {"outer_learning_rate": 1.0, "outer_momentum": 0.9},
    "outer.5m.9": {"outer_learning_rate": 0.5, "outer_momentum": 0.9},
    "outer.35m.9": {"outer_learning_rate": 0.35, "outer_momentum": 0.9},
    # Each push is one replica's delta: 0.5 is DiLoCo's average of 2.
    "outer.5": {"outer_learning_rate": 0.5, "outer_momentum": 0.0},
    "outer.35m.5": {"outer_learning_rate": 0.35, "outer_momentum": 0.5},
    "dc.04": {"delay_compensation": 0.04},
    "dc1": {"delay_compensation": 1.0},
    "stale": {"staleness_scaled": True},
    # SparseLoCo's pushes (Sarfi et al. 2025): the pseudo-gradient's top 1%
    # in 2 bits with error feedback, the outer step without momentum (so that
    # fetches can be sparse too; the fetches change nothing in the NumPy
    # reference), at outer learning rates 1, 2 and 3.
    **{
        f"sparse{lr}": {
            "outer_learning_rate": float(lr),
            "outer_momentum": 0.0,
            "top_k_fraction": 0.01,
            "quantize_bits": 2,
            "sparse_fetches": True,
        }
        for lr in (1, 2, 3)
    },
    # Rarer exchanges with more entries each, at outer learning rate 1 (the
    # same push bytes per example at n=32 and n=64 as 1% at n=16).
    **{
        f"sparse1k{int(fraction * 100)}": {
            "outer_learning_rate": 1.0,
            "outer_momentum": 0.0,
            "top_k_fraction": fraction,
            "quantize_bits": 2,
            "sparse_fetches": True,
        }
        for fraction in (0.02, 0.04)
    },
    # Plain AdaGrad pushes (no outer rule) of the top 1% in 2 bits, sparse
    # fetches (with accumulator "mean" or "sum": no squares pushed).
    "sparse_adagrad": {
        "top_k_fraction": 0.01,
        "quantize_bits": 2,
        "sparse_fetches": True,
    },
    # The same at outer learning rate 1 with 8-bit values, with none (top-k
    # alone), and with 8-bit values of the top 1% of each chunk of 1,024.
    **{
        f"sparse1{name}": {
            "outer_learning_rate": 1.0,
            "outer_momentum": 0.0,
            "top_k_fraction": 0.01,
            "sparse_fetches": True,
            **extra,
        }
        for name, extra in (
            ("q8", {"quantize_bits": 8}),
            ("topk", {}),
            ("q8c", {"quantize_bits": 8, "top_k_chunk": 1024}),
        )
    },
}
# (n, local_optimizer, adagrad_accumulator, push rule); n=1 first: the baseline.
_CONFIGS = (
    (1, "adagrad", "squares", "-"),
    (4, "sgd", "mean", "-"),
    (4, "adagrad", "mean", "-"),
    (4, "sgd", "squares", "-"),
    (4, "adagrad", "squares", "-"),
    (16, "sgd", "mean", "-"),
    (16, "adagrad", "squares", "-"),
    *((16, "adagrad", "squares", rule) for rule in RULES if rule != "-"),
)


def _label(config) -> str:
    """A row's name for `--only`, e.g. `16/adagrad/squares/outer1`."""
    return "/".join(map(str, config))


def _parse_label(name: str):
    """`--only`'s `n/local/accumulator/rule` as a config tuple: any `n >= 1`,
    a local optimizer, an accumulator mode and a rule of `RULES`."""
    from tf_distbelief.downpour import config as downpour_config

    parts = name.split("/")
    ok = len(parts) == 4 and parts[0].isdigit() and int(parts[0]) >= 1
    if not (
        ok
        and parts[1] in downpour_config.LOCAL_OPTIMIZERS
        and parts[2] in downpour_config.ADAGRAD_ACCUMULATORS
        and parts[3] in RULES
    ):
        raise app.UsageError(
            f"--only: {name!r} is not n/local/accumulator/rule with n >= 1, "
            f"local one of {downpour_config.LOCAL_OPTIMIZERS}, accumulator one "
            f"of {downpour_config.ADAGRAD_ACCUMULATORS} and rule one of "
            f"{sorted(RULES)}"
        )
    return int(parts[0]), parts[1], parts[2], parts[3]


def define_flags():
    flags.DEFINE_list("seeds", ["0", "1", "2", "3"], "Seeds to average over.")
    flags.DEFINE_integer(
        "steps", 960, "Steps of both replicas together.", lower_bound=2
    )
    flags.DEFINE_integer("hidden_units", 256, "Speech model width.", lower_bound=1)
    flags.DEFINE_integer("classes", 8192, "Speech model softmax width.", lower_bound=2)
    flags.DEFINE_string(
        "out_dir", plots.DEFAULT_OUT_DIR, "CSV and PNG output folder ('' for none)."
    )
    flags.DEFINE_list(
        "only",
        [],
        "Rows to run, by name (n/local/accumulator/rule, e.g. "
        "1/adagrad/squares/-,16/adagrad/squares/outer1); empty: all. The first "
        "is the baseline of `diff`.",
    )


def _speech_problem(hidden_units, classes, seed):
    """`(params, grad_fn, accuracy_fn, train)`: the MLP as NumPy arrays."""
    import numpy as np
    import tensorflow as tf

    from tf_distbelief.demos import speech

    (x, y), (x_test, y_test) = speech.load_data(num_test=10_000, num_classes=classes)
    model = speech.build_model(hidden_units, classes, seed=seed)
    params = model.get_weights()  # float32, as the cluster trains.

    def logits(p, inputs):
        h = inputs
        for i in range(0, len(p) - 2, 2):
            h = tf.sigmoid(h @ p[i] + p[i + 1])
        return h @ p[-2] + p[-1]

    @tf.function(reduce_retracing=True)
    def grads(p, inputs, labels):
        with tf.GradientTape() as tape:
            tape.watch(p)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels, logits(p, inputs)
                )
            )
        return tape.gradient(loss, p)

    def grad_fn(p, batch):
        inputs, labels = batch
        return [g.numpy() for g in grads([tf.constant(v) for v in p], inputs, labels)]

    def accuracy(p):
        out = logits([tf.constant(v) for v in p], tf.constant(x_test))
        return float(np.mean(np.argmax(out.numpy(), 1) == y_test))

    return params, grad_fn, accuracy, (x, y)


def _batches(train, replica, steps, seed):
    import numpy as np

    x, y = train
    order = np.random.default_rng([seed, replica]).permutation(len(x))
    out = []
    for t in range(steps):
        idx = order[(t * _BATCH_SIZE) % len(x) :][:_BATCH_SIZE]
        out.append((x[idx], y[idx]))
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tf_distbelief.downpour import config as downpour_config
    from tf_distbelief.downpour import schedule as downpour_schedule

    f = flags.FLAGS
    seeds = [int(s) for s in f.seeds]
    configs = _CONFIGS
    if f.only:
        configs = tuple(_parse_label(name) for name in f.only)
    accuracy = {}
    for seed in seeds:
        params, grad_fn, accuracy_fn, train = _speech_problem(
            f.hidden_units, f.classes, seed
        )
        batches = [_batches(train, r, f.steps // 2, seed) for r in range(2)]
        for n, local, mode, rule in configs:
            start = time.monotonic()
            config = downpour_config.DownpourConfig(
                n, n, local_optimizer=local, adagrad_accumulator=mode, **RULES[rule]
            )
            got, _ = downpour_schedule.simulate(
                params,
                grad_fn,
                batches,
                config,
                downpour_schedule.adagrad_ps(_LEARNING_RATE),
            )
            accuracy[seed, n, local, mode, rule] = accuracy_fn(got)
            print(
                f"seed {seed} n={n} {local} {mode} {rule}: "
                f"{accuracy[seed, n, local, mode, rule]:.4f} "
                f"({time.monotonic() - start:.0f} s)",
                flush=True,
            )
    print(
        f"speech 440-{f.hidden_units}x4-{f.classes}, 2 replicas, {f.steps} steps of "
        f"{_BATCH_SIZE}, AdaGrad gamma {_LEARNING_RATE}, seeds {f.seeds}"
    )
    print(
        f"{'n':>3} {'local':8} {'accumulator':11} {'rule':10} {'test acc':>8} "
        f"{'diff':>7} {'sd':>6}"
    )
    base = configs[0]
    for c in configs:
        n, local, mode, rule = c
        accs = [accuracy[(s, *c)] for s in seeds]
        diffs = [accuracy[(s, *c)] - accuracy[(s, *base)] for s in seeds]
        sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        print(
            f"{n:3d} {local:8} {mode:11} {rule:10} {statistics.mean(accs):8.4f} "
            f"{statistics.mean(diffs):+7.4f} {sd:6.4f}"
        )
    if f.out_dir:
        _write_outputs(f.out_dir, seeds, accuracy, configs)


def _write_outputs(out_dir, seeds, accuracy, configs):
    """`downpour_modes.csv` (every seed) and the mean accuracy per configuration."""
    f = flags.FLAGS
    plots.write_csv(
        os.path.join(out_dir, "downpour_modes.csv"),
        [
            "seed",
            "n",
            "local_optimizer",
            "adagrad_accumulator",
            "push_rule",
            "test_accuracy",
        ],
        [[s, *c, accuracy[(s, *c)]] for s in seeds for c in configs],
    )
    path = plots.bar_plot(
        os.path.join(out_dir, "downpour_modes.png"),
        [f"n={n}\n{local}\n{mode}\n{rule}" for n, local, mode, rule in configs],
        {"acc": [statistics.mean(accuracy[(s, *c)] for s in seeds) for c in configs]},
        title=(
            f"Downpour modes (simulated, 2 replicas, {f.steps} steps, "
            f"seeds {','.join(map(str, seeds))})"
        ),
        xlabel="n = n_fetch = n_push, local step, ps accumulator, push rule",
        ylabel="test accuracy (mean over seeds)",
        value_format="{:.3f}",
    )
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
