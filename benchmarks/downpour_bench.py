r"""Downpour SGD against stock and single-process training: time to accuracy.

Dean et al. 2012 judge the methods by the time to reach a fixed test accuracy
(Figure 5), not examples/s. This benchmark measures it on one `LocalCluster` (2
workers, 1 ps by default), for each row:

* `single`: plain tf_keras `fit` in the benchmark's own process (no cluster, no
  strategy; same model, batch, AdaGrad gamma, steps per execution, and
  TensorFlow's default threads, one per core): the limit on these cores;
* `stock`: `DistBeliefStrategy` without Downpour (TensorFlow's
  `ParameterServerStrategy` training: variables on the ps, every step reads them
  and applies its gradient there);
* `n=1`, `n=4`, `n=16` (and `n=32`, `n=64` by `--rows`): Downpour with
  `n_fetch = n_push = n`;
* `n=<n>+outer`, `+dc`, `+stale`: with a push rule on the ps (`DownpourConfig`):
  outer Nesterov on the pushed parameter delta (`--outer_learning_rate`,
  `--outer_momentum`), DC-ASGD's delay compensation (`--delay_compensation`),
  the staleness-scaled step.

The cluster's ps and worker tasks run `--task_intra_op_threads` threads per op
(`LocalCluster(intra_op_threads=...)`; default 1: each task a one-core machine,
as in the paper and `sandblaster_bench.py`). With TensorFlow's default every
task sizes its pool for all the host's cores, and 2 workers and a ps on 2
cores oversubscribe them (measured, one round of `n=16`: 1899 ex/s at 28.6 CPU
ms per step of the workers with the default, 2166 at 24.8 with 1 thread).

Each row trains anew (a fresh strategy: `LocalCluster.resolver_for`, a new chief
port on the same ps and worker tasks) for `--steps` steps of both workers
together, every row the same examples. Every `--eval_every` steps `fit` ends
an epoch (which joins the workers), and the coordinator evaluates the test
accuracy of the ps values (`training.accuracy`; for `single`, of its model) off
the clock: the training seconds are the epochs' own, from epoch begin to epoch
end, evaluations and snapshots outside them. The first interval holds the
tracing of the training functions (a fixed cost, longest for the cluster); it
counts at the median seconds of the later intervals. `--rounds` rounds run all
rows in turn, round `r` with seed `--first_seed + r` (initialisation, data order):
the spread over rounds is over seeds as well as machine load.

The headline table (Markdown, medians over rounds, `[min-max]` over rounds):

* `secs to target`, `examples to target`: training seconds and examples until
  the test accuracy first reaches `--target_accuracy` (linear between two
  evaluations; a round that never reaches it counts as the slowest, and
  `reached` says in how many rounds it did);
* `x stock`, `x single`: those seconds over the stock and single rows';
* `final acc`: test accuracy after all steps (equal examples), `acc vs n=1`
  its difference to the `n=1` row in points;
* `ex/s`: training examples per second (both workers), the median over the
  intervals after the first; `x stock ex/s`, `x single ex/s` its ratios;
* `B/ex`, `B x stock`: worker<->ps bytes per example on the sockets (below)
  and their ratio to stock's.

Then the throughput table of the earlier benchmark (`--throughput_table`):

* `ex/s`, `x stock`: as above; `x stock` is the median over rounds of each
  round's ratio to that round's stock row.
* `sock B/ex`: worker<->ps bytes per example on the sockets: the kernel's
  per-connection TCP counters (`tf_distbelief.cluster.traffic`: `ss -tinpH
  state established`, `bytes_acked` sent, `bytes_received` received), for
  every connection between a worker process and a ps process (told apart by
  process id and peer port), summed both ways, difference over the intervals
  after the first. It includes gRPC framing and the fixed per-step messages
  (step ids, dead-branch signals, loop control).
* `tensor B/ex`: the same from tensor sizes: stock moves the model twice per
  step (read the parameters, send the gradient); Downpour counts its fetches
  and pushes (`Downpour.stats`) times the model size.
* `B x stock`: socket bytes per example over the stock row's.
* `CPU ms/step`: CPU time of the chief, workers and ps together per step
  (`traffic.cpu_secs`, from `/proc/<pid>/stat`; the evaluations left out); on
  2 cores the rates follow it (`--cpu_breakdown` splits it by process kind).
* `test acc`, `test loss`: on the test set after all steps. On the speech data
  the most frequent class is about 10% of the examples (`models/speech.py`:
  Zipf-distributed classes, a Gaussian cluster each).

The speech-shaped model (`models/speech.py`) defaults to 4 hidden layers of 256
units and 8192 classes (2.4M parameters, 9.7 MB) instead of the paper's 2560
units (42M), so that it trains on a 2-core machine; `--quick` uses 2048 classes.

Outputs (`--out_dir`, default `benchmarks/results/`; `benchmarks/downpour_figures.py`):
`downpour_time_to_accuracy.csv` (the headline table), `downpour.csv` (the
throughput table), `downpour_curves.csv` (every round's curve), and per model
`downpour_<model>_accuracy.png` (test accuracy against training seconds, the
paper's Figure 4 form), `downpour_<model>_time_to_target.png` (Figure 5's
measure) and `downpour_<model>_bytes.png`.

On stderr, TensorFlow logs "Failed to remove function remotely" for functions
of an earlier row's context (each row reconnects); they are harmless.

Usage:
  python benchmarks/downpour_bench.py            # about 20 minutes, 2 idle cores
  python benchmarks/downpour_bench.py --quick    # about 3 minutes
  python benchmarks/downpour_bench.py --rows=stock,n=16,n=16+outer --rounds=3

Duration (speech, estimated from 1- and 2-round runs at load 8-20, scaled by
the idle rates of issue 14: single 3,200-3,800 ex/s, stock 1,440, n=16 2,800):
a row of 1600 steps takes about 25 s (single) to 55 s (stock, n=1) of wall
time on 2 idle cores (setup, tracing, 11 evaluations of 10,000 examples,
training), a round of the 8 default rows about 6 minutes, the default 3
rounds about 17-20 minutes. Accuracy after equal examples differs by 2-4
points between seeds, so a 1-point difference needs many more seeds than 3
rounds: `--rows=n=1,n=16,n=16+outer --rounds=8` (about 18 minutes) for that.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from benchmarks import downpour_figures, plots  # noqa: E402
from tf_distbelief import console  # noqa: E402  (no TensorFlow)
from tf_distbelief.cluster import traffic  # noqa: E402  (no TensorFlow)

# Steps between evaluations and in all, both workers together, of a full and
# a `--quick` run: multiples of 2 workers x 20 steps per execution, so that
# the workers get as many scheduled functions; each interval ends with a join
# (a worker may idle for up to one scheduled function).
_EVAL_EVERY = {"digits": 40, "speech": 160}
_STEPS = {"digits": 480, "speech": 1600}
_QUICK_EVAL_EVERY = {"digits": 40, "speech": 80}
_QUICK_STEPS = {"digits": 240, "speech": 640}
# Default targets: reached by every row in the rounds we ran (see the README;
# on digits every row passes 0.9 within 80 steps), well above the plateau at
# the most frequent class (speech 0.1055 on the test set, 0.124 early on).
_TARGET_ACCURACY = {"digits": 0.95, "speech": 0.2}
_QUICK_TARGET_ACCURACY = {"digits": 0.93, "speech": 0.15}
# The push rules' settings of the `+outer` and `+dc` rows: outer Nesterov at
# lr 0.35, momentum 0.9 kept n=16 within 1 point of n=1 in the simulation
# (benchmarks/downpour_modes.py, 8 seeds) and on the cluster (lr 0.5 was as
# good in the simulation but fell behind on the cluster; lr 0.7 collapsed in
# both); DC-ASGD's lambda of its reference runs.
_OUTER_LEARNING_RATE = 0.35
_OUTER_MOMENTUM = 0.9
_DELAY_COMPENSATION = 0.04
# Rows: "single" (one process, no cluster), "stock", "n=<n>" (Downpour,
# n_fetch = n_push = n), "n=<n>+<rule>" (with a push rule).
_RULES = ("outer", "dc", "stale")
_DEFAULT_ROWS = (
    "single",
    "stock",
    "n=1",
    "n=4",
    "n=16",
    "n=16+outer",
    "n=16+dc",
    "n=16+stale",
)
_QUICK_ROWS = ("single", "stock", "n=1", "n=16", "n=16+outer")
# n_fetch = n_push of the known Downpour rows (32 and 64: rarer exchanges, the
# outer rule's regime in DiLoCo).
_NS = (1, 4, 16, 32, 64)


def _known_rows():
    names = ["single", "stock"]
    for n in _NS:
        names.append(f"n={n}")
        names += [f"n={n}+{r}" for r in _RULES if not (n == 1 and r == "outer")]
    return names


_QUICK_SPEECH_CLASSES = 2048
# Test examples of the speech data: at an accuracy of 0.18 the sampling error
# is 0.4 points (0.9 with `models/speech.py`'s default of 2,000).
_SPEECH_TEST_EXAMPLES = 10_000
# AdaGrad gamma per model: the 4 sigmoid layers of the speech model learn
# slowly at digits' 0.1, and at 0.5 the asynchronous runs often stay at the
# most frequent class.
_LEARNING_RATE = {"digits": 0.1, "speech": 0.2}
_MODELS = ("digits", "speech")

_KEEP_ALIVE = []


# --- The benchmark -------------------------------------------------------------


def define_flags():
    flags.DEFINE_bool(
        "quick",
        False,
        "A smoke run: 2048-class speech, fewer steps, one round, fewer rows.",
    )
    flags.DEFINE_list("models", ["speech"], "Models to run: speech, digits.")
    flags.DEFINE_list(
        "rows",
        [],
        f"Rows to run, by name (default: {','.join(_DEFAULT_ROWS)}; known: "
        f"{','.join(_known_rows())}).",
    )
    flags.register_validator("rows", _check_rows)
    flags.DEFINE_integer("num_ps", 1, "ps tasks.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
    # 20 rather than `JobConfig`'s 10: tf_keras spends about 10 ms of chief
    # CPU per scheduled function here (scheduling, its step count, the logs),
    # 1 ms per step at 10, which weighs on the configurations that need
    # little else.
    flags.DEFINE_integer(
        "steps_per_execution", 20, "Steps per scheduled function.", lower_bound=1
    )
    flags.DEFINE_integer(
        "eval_every",
        None,
        "K: steps (both workers together) between test-set evaluations, off "
        "the clock (default: per model, speech 160, digits 40; a multiple of "
        "2 x steps_per_execution keeps the workers even).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "steps",
        None,
        "Training steps of every row, both workers together (default: per "
        "model, speech 1600, digits 480; rounded up to a multiple of "
        "--eval_every).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "rounds",
        None,
        "Rounds over all rows (each trains anew, round r with seed "
        "first_seed + r: model initialisation and data order); medians and "
        "spread over rounds "
        "(default 3, --quick 1).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "first_seed",
        0,
        "Round r runs with seed first_seed + r (to add seeds to an earlier run).",
        lower_bound=0,
    )
    flags.DEFINE_float(
        "learning_rate",
        None,
        "AdaGrad gamma on the ps (default: per model, digits 0.1, speech 0.2).",
    )
    flags.DEFINE_float(
        "local_learning_rate",
        None,
        "Downpour: step size on each worker's cache (default: JobConfig's).",
    )
    flags.DEFINE_enum(
        "local_optimizer",
        "adagrad",
        ("adagrad", "sgd"),
        "Downpour: each worker's update of its cache (JobConfig.local_optimizer).",
    )
    flags.DEFINE_enum(
        "adagrad_accumulator",
        "squares",
        ("squares", "mean", "sum"),
        "Downpour: how a push grows the ps AdaGrad accumulator.",
    )
    flags.DEFINE_float(
        "outer_learning_rate",
        _OUTER_LEARNING_RATE,
        "The `+outer` rows: DownpourConfig.outer_learning_rate.",
    )
    flags.DEFINE_float(
        "outer_momentum",
        _OUTER_MOMENTUM,
        "The `+outer` rows: DownpourConfig.outer_momentum (Nesterov).",
    )
    flags.DEFINE_float(
        "delay_compensation",
        _DELAY_COMPENSATION,
        "The `+dc` rows: DownpourConfig.delay_compensation (DC-ASGD lambda).",
    )
    flags.DEFINE_integer("speech_hidden_units", 256, "Speech model width.")
    flags.DEFINE_integer("speech_classes", 8192, "Speech model softmax width.")
    flags.DEFINE_bool(
        "cpu_breakdown", False, "Also print CPU ms per step of each process kind."
    )
    flags.DEFINE_integer(
        "task_intra_op_threads",
        1,
        "Threads per op of each ps and worker task (LocalCluster's "
        "intra_op_threads; 0: as this process's environment gives, by default "
        "TensorFlow's one per core).",
        lower_bound=0,
    )
    flags.DEFINE_bool(
        "throughput_table",
        True,
        "Also print the throughput table (ex/s, bytes, CPU) after the headline.",
    )
    flags.DEFINE_string(
        "out_dir", plots.DEFAULT_OUT_DIR, "CSV and PNG output folder ('' for none)."
    )
    flags.DEFINE_float(
        "target_accuracy",
        None,
        "Test accuracy of the time to accuracy (default: per model, "
        f"{_TARGET_ACCURACY}; --quick {_QUICK_TARGET_ACCURACY}).",
    )


@dataclasses.dataclass
class Row:
    """One row's measurements (one round, or medians over rounds)."""

    model: str
    name: str
    examples_per_sec: float  # Median over the evaluation intervals after the first.
    socket_bytes_per_example: float
    tensor_bytes_per_example: float
    cpu_ms_per_step: dict  # {"chief"|"worker"|"ps": CPU ms per step}.
    test_accuracy: float  # After all steps: equal examples for every row.
    test_loss: float
    wall_secs: float
    # Examples/s over the same round's stock row, median over rounds (set by
    # `median_rows`); None: the ratio of the rates.
    speedup: float | None = None
    # `(training secs, test accuracy)` before training and after every
    # `--eval_every` steps; the seconds leave the evaluations out (medians
    # over rounds after `median_rows`).
    curve: list = dataclasses.field(default_factory=list)
    # Training seconds and examples to first reach `target` (linear between
    # evaluations; NaN: not reached), medians over rounds after `median_rows`
    # (a round that did not reach it counts as the slowest).
    target: float = math.nan
    secs_to_target: float = math.nan
    examples_to_target: float = math.nan
    # After `median_rows`: `{field: (min, max)}` over rounds of
    # `secs_to_target`, `examples_to_target`, `test_accuracy`; and the
    # rounds that reached the target.
    spread: dict = dataclasses.field(default_factory=dict)
    reached: int = 0
    rounds: int = 1


class _Probe:
    """Interval times and test accuracies; sockets, CPU and bytes after the first."""

    def __init__(self, replicas, pids, evaluate):
        import tf_keras

        probe = self

        class Callback(tf_keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                probe.evaluate_point(count_cpu=False)

            def on_epoch_begin(self, epoch, logs=None):
                probe.begin = time.monotonic()

            # `fit` joins the coordinator at the end of every epoch (one
            # evaluation interval), so each snapshot and evaluation sees every
            # scheduled step finished; both are outside the clock.
            def on_epoch_end(self, epoch, logs=None):
                probe.epoch_secs.append(time.monotonic() - probe.begin)
                last = epoch == self.params["epochs"] - 1
                if epoch in (0, self.params["epochs"] - 1):
                    probe.snap()
                # After the last snapshot, its CPU is outside the window.
                probe.evaluate_point(count_cpu=not last)

        self.callback = Callback()
        self.replicas = replicas
        self.pids = pids
        self.evaluate = evaluate
        self.begin = 0.0
        self.epoch_secs: list[float] = []
        self.accuracies: list[float] = []
        # CPU seconds per pid the evaluations took inside the measured window.
        self.eval_cpu: dict[int, float] = collections.Counter()
        self.snaps: list[tuple[list[traffic.TcpSocket], dict, int]] = []

    def evaluate_point(self, count_cpu):
        """Appends the test accuracy now (before training, after each interval)."""
        before = {pid: traffic.cpu_secs(pid) for pid in self.pids}
        self.accuracies.append(self.evaluate())
        if count_cpu:
            for pid in self.pids:
                self.eval_cpu[pid] += traffic.cpu_secs(pid) - before[pid]

    def snap(self):
        moved = 0
        if self.replicas:
            moved = sum(s.bytes_fetched + s.bytes_pushed for s in self.replicas.stats())
        cpu = {pid: traffic.cpu_secs(pid) for pid in self.pids}
        sockets = traffic.read_sockets() if self.replicas is not False else []
        self.snaps.append((sockets, cpu, moved))

    def curve(self):
        """`[(training secs, accuracy)]`; the first interval at the later ones' rate.

        The first interval holds the tracing of the training function (seconds
        on 2 cores, more for a cluster), a fixed cost that time to accuracy
        would otherwise charge to whichever row traces slowest; it counts at
        the median seconds of the later intervals (all of equal steps).
        """
        import statistics

        secs = list(self.epoch_secs)
        if len(secs) > 1:
            secs[0] = statistics.median(secs[1:])
        times = [0.0]
        for t in secs:
            times.append(times[-1] + t)
        return list(zip(times, self.accuracies))


def to_target(curve, examples_per_point: float, target: float) -> tuple[float, float]:
    """`(secs, examples)` to first reach `target` on `curve` (NaN: never).

    Args:
      curve: `[(training secs, test accuracy)]`, point k after
        `k * examples_per_point` training examples.
      examples_per_point: examples between two points.
      target: the test accuracy to reach.

    Returns:
      Seconds and examples, each linearly interpolated between the two points
      around the first crossing (`plots.time_to_target`).
    """
    accs = [a for _, a in curve]
    secs = plots.time_to_target([t for t, _ in curve], accs, target)
    examples = plots.time_to_target(
        [k * examples_per_point for k in range(len(curve))], accs, target
    )
    return secs, examples


def _row_kind(name: str) -> tuple[str, int | None, str | None]:
    """`"single"|"stock"|"n=16+outer"` -> `(kind, n, rule)`."""
    if name in ("single", "stock"):
        return name, None, None
    n, _, rule = name.partition("+")
    return "downpour", int(n[len("n=") :]), rule or None


def _downpour_config(n, rule, f):
    from tf_distbelief import downpour

    rules = {
        None: {},
        "outer": {
            "outer_learning_rate": f.outer_learning_rate,
            "outer_momentum": f.outer_momentum,
        },
        "dc": {"delay_compensation": f.delay_compensation},
        "stale": {"staleness_scaled": True},
    }[rule]
    return downpour.DownpourConfig(
        n_fetch=n,
        n_push=n,
        local_learning_rate=f.local_learning_rate,
        local_optimizer=f.local_optimizer,
        adagrad_accumulator=f.adagrad_accumulator,
        **rules,
    )


def _eval_every(f, model_name):
    return f.eval_every or (_QUICK_EVAL_EVERY if f.quick else _EVAL_EVERY)[model_name]


def _intervals(f, model_name):
    """Evaluation intervals of every row: `--steps / --eval_every`, rounded up."""
    steps = f.steps or (_QUICK_STEPS if f.quick else _STEPS)[model_name]
    return max(2, -(-steps // _eval_every(f, model_name)))


def _target(f, model_name):
    if f.target_accuracy is not None:
        return f.target_accuracy
    return (_QUICK_TARGET_ACCURACY if f.quick else _TARGET_ACCURACY)[model_name]


def _speech_classes(f):
    return min(f.speech_classes, _QUICK_SPEECH_CLASSES) if f.quick else f.speech_classes


def _load_data(model_name, f):
    import models
    from models import speech

    if model_name == "speech":
        return speech.load_data(
            num_test=_SPEECH_TEST_EXAMPLES, num_classes=_speech_classes(f)
        )
    return models.spec(model_name).load_data()


def _test_loss(model, x, y, batch_size=512):
    """Mean cross-entropy of the logits on `(x, y)`, on the coordinator."""
    import tensorflow as tf

    total = 0.0
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size], training=False)
        total += float(
            tf.reduce_sum(
                tf.nn.sparse_softmax_cross_entropy_with_logits(
                    y[i : i + batch_size], logits
                )
            )
        )
    return total / len(y)


def _single_process_fit(model, x, y, config, probe, intervals, steps):
    """Plain tf_keras `fit` in this process: the limit without a cluster."""
    import tensorflow as tf

    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=config.seed, reshuffle_each_iteration=True)
        .repeat()
        .batch(config.batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    model.fit(
        data,
        epochs=intervals,
        steps_per_epoch=steps,
        callbacks=[probe.callback],
        verbose=0,
    )


def _run(local, data, model_name, name, f, seed) -> Row:
    """Trains one row (fresh strategy or, for `single`, no cluster); returns it."""
    import statistics

    import models
    from tf_distbelief import job
    from tf_distbelief import strategy as strategy_lib
    from tf_distbelief.fit import training

    kind, n, rule = _row_kind(name)
    steps = _eval_every(f, model_name)
    intervals = _intervals(f, model_name)
    config = job.JobConfig(
        learning_rate=f.learning_rate or _LEARNING_RATE[model_name],
        batch_size=f.batch_size,
        steps_per_execution=f.steps_per_execution,
        num_ps=local.num_ps,
        seed=seed,
        downpour=None if n is None else _downpour_config(n, rule, f),
    ).validate()
    spec = models.spec(
        model_name,
        seed=seed,
        speech_hidden_units=f.speech_hidden_units,
        speech_classes=_speech_classes(f),
    )
    (x_train, y_train), (x_test, y_test) = data
    start = time.monotonic()
    roles = {os.getpid(): "chief"}
    if kind == "single":
        model = job.build_model(config, spec)
        model.compile(
            optimizer=job.build_optimizer(config),
            loss=spec.loss(),
            metrics=list(spec.metrics),
            steps_per_execution=config.steps_per_execution,
        )
        replicas = False  # No ps: no sockets, no bytes.
    else:
        strategy = strategy_lib.DistBeliefStrategy(
            local.resolver_for(),
            strategy_lib.make_partitioner(
                config.partitioner, local.num_ps, config.shard_bytes
            ),
        )
        model = job.compile_model(config, strategy, spec)
        replicas = getattr(model, "downpour", None)
        roles.update({p.pid: k for (k, _), p in local.processes.items()})
    # Kept until exit: a collected model's functions are removed from the
    # tasks, which the reconnected context no longer knows (noisy errors).
    _KEEP_ALIVE.append(model)
    probe = _Probe(
        replicas, list(roles), lambda: training.accuracy(model, x_test, y_test)
    )
    if kind == "single":
        _single_process_fit(model, x_train, y_train, config, probe, intervals, steps)
    else:
        training.fit(
            model,
            training.dataset_creator(x_train, y_train, config.batch_size, config.seed),
            epochs=intervals,
            steps_per_epoch=steps,
            batch_size=config.batch_size,
            callbacks=[probe.callback],
            print_fn=lambda *_: None,
        )
    (before, cpu0, moved0), (after, cpu1, moved1) = probe.snaps
    timed_steps = (intervals - 1) * steps
    examples = timed_steps * config.batch_size
    pids = {
        role: [p for p, r in roles.items() if r == role] for role in set(roles.values())
    }
    if kind == "single":
        socket_bytes = tensor_bytes = 0
    else:
        ps_ports = {
            int(address.rpartition(":")[2]): local.processes[("ps", i)].pid
            for i, address in enumerate(local.jobs["ps"])
        }
        socket_bytes = traffic.link_bytes(
            before, after, pids["worker"], pids["ps"], ps_ports
        ).total
    if kind == "stock":
        # Stock training reads every parameter and sends every gradient once
        # per step.
        model_bytes = sum(
            v.shape.num_elements() * v.dtype.size for v in model.trainable_variables
        )
        tensor_bytes = 2 * model_bytes * timed_steps
    elif kind == "downpour":
        tensor_bytes = moved1 - moved0
    cpu_ms = {
        role: sum(cpu1[p] - cpu0[p] - probe.eval_cpu[p] for p in role_pids)
        * 1e3
        / timed_steps
        for role, role_pids in pids.items()
    }
    rate = statistics.median(
        steps * config.batch_size / s for s in probe.epoch_secs[1:]
    )
    curve = probe.curve()
    target = _target(f, model_name)
    secs, examples_to = to_target(curve, steps * config.batch_size, target)
    return Row(
        model=model_name,
        name=name,
        examples_per_sec=rate,
        socket_bytes_per_example=socket_bytes / examples,
        tensor_bytes_per_example=tensor_bytes / examples,
        cpu_ms_per_step=cpu_ms,
        test_accuracy=curve[-1][1],
        test_loss=_test_loss(model, x_test, y_test),
        wall_secs=time.monotonic() - start,
        curve=curve,
        target=target,
        secs_to_target=secs,
        examples_to_target=examples_to,
        reached=int(not math.isnan(secs)),
    )


def _median_reached(values: list[float]) -> float:
    """Median where NaN (not reached) counts as slower than any round; NaN if so."""
    import statistics

    value = statistics.median(math.inf if math.isnan(v) else v for v in values)
    return math.nan if math.isinf(value) else value


def median_rows(rows: list[Row]) -> list[Row]:
    """One row per `(model, name)`, in first-seen order: medians over rounds.

    `speedup` is the median over rounds of each round's examples/s over that
    round's stock examples/s (the i-th row of a configuration is round i): the
    two ran side by side, so a load change between rounds cancels out. The
    time to the target is the median over rounds, a round that did not reach
    it counting as the slowest; `spread` holds min and max over rounds.
    """
    import statistics

    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.name), []).append(r)
    result = []
    for (model, name), group in groups.items():
        stock = groups.get((model, "stock"), group)
        speedup = statistics.median(
            r.examples_per_sec / s.examples_per_sec for r, s in zip(group, stock)
        )

        def med(key, group=group):
            return statistics.median(getattr(r, key) for r in group)

        def spread(key, group=group):
            values = [getattr(r, key) for r in group]
            finite = [v for v in values if not math.isnan(v)]
            high = max(finite) if len(finite) == len(values) else math.nan
            return (min(finite) if finite else math.nan, high)

        roles = {k for r in group for k in r.cpu_ms_per_step}
        result.append(
            Row(
                model=model,
                name=name,
                examples_per_sec=med("examples_per_sec"),
                socket_bytes_per_example=med("socket_bytes_per_example"),
                tensor_bytes_per_example=med("tensor_bytes_per_example"),
                cpu_ms_per_step={
                    k: statistics.median(r.cpu_ms_per_step.get(k, 0.0) for r in group)
                    for k in sorted(roles)
                },
                test_accuracy=med("test_accuracy"),
                test_loss=med("test_loss"),
                wall_secs=sum(r.wall_secs for r in group),
                speedup=speedup,
                curve=downpour_figures.median_curve([r.curve for r in group]),
                target=group[0].target,
                secs_to_target=_median_reached([r.secs_to_target for r in group]),
                examples_to_target=_median_reached(
                    [r.examples_to_target for r in group]
                ),
                spread={
                    k: spread(k)
                    for k in ("secs_to_target", "examples_to_target", "test_accuracy")
                },
                reached=sum(r.reached for r in group),
                rounds=len(group),
            )
        )
    return result


def _fmt(value: float, fmt: str) -> str:
    return "not reached" if math.isnan(value) else format(value, fmt)


def _fmt_range(low: float, high: float, fmt: str) -> str:
    return f"{_fmt(low, fmt)}-{'n.r.' if math.isnan(high) else format(high, fmt)}"


def format_headline(rows: list[Row], header: str) -> str:
    """The time-to-accuracy table, Markdown: medians over rounds, [min-max].

    `x stock`, `x single`: seconds to the target over the `stock` and `single`
    rows' (of the same model, medians); `B x stock`: socket bytes per example
    over stock's; `acc vs n=1`: final test accuracy minus the `n=1` row's, in
    points (equal examples).
    """
    lines = [
        header,
        "",
        "| model | row | target | secs to target | examples to target | reached "
        "| x stock | x single | final acc | acc vs n=1 | ex/s | x stock ex/s "
        "| x single ex/s | B/ex | B x stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_name = {(r.model, r.name): r for r in rows}
    for r in rows:
        stock = by_name.get((r.model, "stock"))
        single = by_name.get((r.model, "single"))
        n1 = by_name.get((r.model, "n=1"))
        lo, hi = r.spread.get("secs_to_target", (r.secs_to_target,) * 2)
        elo, ehi = r.spread.get("examples_to_target", (r.examples_to_target,) * 2)
        alo, ahi = r.spread.get("test_accuracy", (r.test_accuracy,) * 2)

        def ratio(value, base, fmt=".2f"):
            if base is None or math.isnan(value) or math.isnan(base) or not base:
                return "-"
            return _fmt(value / base, fmt)

        diff = "-"
        if n1 is not None:
            diff = f"{100 * (r.test_accuracy - n1.test_accuracy):+.1f}"
        lines.append(
            "| "
            + " | ".join(
                [
                    r.model,
                    r.name,
                    f"{r.target:.3f}",
                    f"{_fmt(r.secs_to_target, '.1f')} [{_fmt_range(lo, hi, '.1f')}]",
                    f"{_fmt(r.examples_to_target, '.0f')} "
                    f"[{_fmt_range(elo, ehi, '.0f')}]",
                    f"{r.reached}/{r.rounds}",
                    ratio(r.secs_to_target, stock and stock.secs_to_target),
                    ratio(r.secs_to_target, single and single.secs_to_target),
                    f"{r.test_accuracy:.4f} [{alo:.4f}-{ahi:.4f}]",
                    diff,
                    f"{r.examples_per_sec:.0f}",
                    ratio(r.examples_per_sec, stock and stock.examples_per_sec),
                    ratio(r.examples_per_sec, single and single.examples_per_sec),
                    f"{r.socket_bytes_per_example:.0f}",
                    ratio(
                        r.socket_bytes_per_example,
                        stock and stock.socket_bytes_per_example,
                        ".3f",
                    ),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def write_headline_csv(path: str, rows: list[Row]) -> str:
    """The headline table as CSV (one line per row, medians and min/max)."""
    fields = ("secs_to_target", "examples_to_target", "test_accuracy")
    return plots.write_csv(
        path,
        [
            "model",
            "row",
            "target",
            "secs_to_target",
            "secs_min",
            "secs_max",
            "examples_to_target",
            "examples_min",
            "examples_max",
            "test_accuracy",
            "acc_min",
            "acc_max",
            "reached",
            "rounds",
            "examples_per_sec",
            "socket_bytes_per_example",
        ],
        [
            [
                r.model,
                r.name,
                r.target,
                *[
                    v
                    for k in fields
                    for v in (getattr(r, k), *r.spread.get(k, (math.nan,) * 2))
                ],
                r.reached,
                r.rounds,
                r.examples_per_sec,
                r.socket_bytes_per_example,
            ]
            for r in rows
        ],
    )


def format_table(rows: list[Row], header: str) -> str:
    """The results table; ratios are to the `stock` row of the same model.

    `x stock` is `Row.speedup` where set, else the ratio of examples/s.
    """
    lines = [
        header,
        f"{'model':6} {'config':6} {'ex/s':>7} {'x stock':>7} {'sock B/ex':>10} "
        f"{'tensor B/ex':>11} {'B x stock':>9} {'CPU ms/step':>11} {'test acc':>8} "
        f"{'test loss':>9}",
    ]
    stock = {r.model: r for r in rows if r.name == "stock"}
    for r in rows:
        base = stock.get(r.model, r)
        speedup = r.speedup
        if speedup is None:
            speedup = r.examples_per_sec / base.examples_per_sec
        lines.append(
            f"{r.model:6} {r.name:6} {r.examples_per_sec:7.0f} {speedup:7.2f} "
            f"{r.socket_bytes_per_example:10.0f} {r.tensor_bytes_per_example:11.0f} "
            f"{r.socket_bytes_per_example / base.socket_bytes_per_example:9.3f} "
            f"{sum(r.cpu_ms_per_step.values()):11.1f} {r.test_accuracy:8.4f} "
            f"{r.test_loss:9.3f}"
        )
    return "\n".join(lines)


def _check_rows(names: list[str]) -> bool:
    """absl validator: refuses unknown `--rows` when the flags are parsed."""
    known = _known_rows()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise flags.ValidationError(
            f"--rows: unknown {unknown}; known: {','.join(known)}"
        )
    return True


def _rows(f) -> list[str]:
    return f.rows or list(_QUICK_ROWS if f.quick else _DEFAULT_ROWS)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    import tensorflow as tf

    from tf_distbelief import cluster

    tf.get_logger().setLevel("ERROR")
    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    bad = [m for m in f.models if m not in _MODELS]
    if bad:
        raise app.UsageError(f"--models must be among {_MODELS}. Received: {bad}")
    names = _rows(f)
    rounds = f.rounds or (1 if f.quick else 3)
    rows = []
    round_rows = []
    data = {m: _load_data(m, f) for m in f.models}
    with cluster.LocalCluster(
        num_workers=2, num_ps=f.num_ps, intra_op_threads=f.task_intra_op_threads
    ) as local:
        # Rounds interleave the rows, so that a change in the load of the
        # machine spreads over all of them.
        for round_index in range(rounds):
            for model_name in f.models:
                for name in names:
                    seed = f.first_seed + round_index
                    r = _run(local, data[model_name], model_name, name, f, seed)
                    rows.append(r)
                    round_rows.append((round_index, r))
                    print(
                        f"round {round_index + 1}/{rounds} {r.model} {r.name}: "
                        f"{_fmt(r.secs_to_target, '.1f')} s to {r.target:.3f}, "
                        f"final {r.test_accuracy:.4f}, "
                        f"{r.examples_per_sec:.0f} ex/s, {r.wall_secs:.0f} s wall",
                        flush=True,
                    )
        rows = median_rows(rows)
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        steps = ", ".join(
            f"{m} {_intervals(f, m)} x {_eval_every(f, m)}" for m in f.models
        )
        header = (
            f"cores={os.cpu_count()} load={load} workers=2 ps={f.num_ps} "
            f"batch={f.batch_size} steps_per_execution={f.steps_per_execution} "
            f"steps=({steps}) medians of {rounds} rounds (seeds {f.first_seed}-"
            f"{f.first_seed + rounds - 1}) lr="
            + ",".join(f"{m}:{f.learning_rate or _LEARNING_RATE[m]}" for m in f.models)
            + f" speech=440-{f.speech_hidden_units}x4-{_speech_classes(f)} "
            f"outer={f.outer_learning_rate}/{f.outer_momentum} "
            f"dc={f.delay_compensation}"
        )
        for line in format_headline(rows, header).splitlines():
            print(line, flush=True)
        if f.throughput_table:
            print(flush=True)
            print(format_table(rows, "throughput (medians over rounds):"), flush=True)
        if f.cpu_breakdown:
            for r in rows:
                cpu = " ".join(
                    f"{k}={v:.1f}" for k, v in sorted(r.cpu_ms_per_step.items())
                )
                print(f"{r.model} {r.name}: CPU ms/step {cpu}")
        if f.out_dir:
            targets = {m: _target(f, m) for m in f.models}
            paths = [
                write_headline_csv(
                    os.path.join(f.out_dir, "downpour_time_to_accuracy.csv"), rows
                ),
                *downpour_figures.write_outputs(
                    f.out_dir, rows, round_rows, header, targets
                ),
            ]
            for path in paths:
                print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(console.exiting(main, keep=(app.UsageError,)))
