r"""Downpour SGD against stock and single-process training: time to accuracy.

Dean et al. 2012 judge the methods by the time to reach a fixed test accuracy
(Figure 5). Each row trains anew on one `LocalCluster` (`--num_workers`
workers, default 2, `--num_ps` ps, one intra-op thread per task) for
`--steps` steps of both workers together, evaluating the test accuracy of the
ps values every `--eval_every` steps off the clock; `--rounds` rounds (seed
`--first_seed + r`) give medians and `[min-max]`. Rows (`--rows`):

* `single`: plain tf_keras `fit` in this process, no cluster (run once, at
  the first NIC rate: it has no network);
* `stock`: `DistBeliefStrategy` without Downpour (parameter-server training);
* `n=<n>` (1, 4, 16, 32, 64): Downpour with `n_fetch = n_push = n`;
* `n=<n>+outer`, `+dc`, `+stale`: with a push rule (outer Nesterov, DC-ASGD
  delay compensation, staleness-scaled step);
* `n=<n>+outer+topk`, `+outer+q8`, `+outer+topk+q8`, `+outer+topk+q2`: the
  outer rule's pushes compressed (top-k of `--top_k_fraction`, 8- or 2-bit
  values), with update-stream fetches.
* `n=<n>+outer+damp`: the outer rule with `--stale_damping` (a stale push
  damped where it repeats the outer momentum; the outer rule's default
  damping is lambda 1); `n=<n>+outer+undamped`: with `stale_damping=0`, the
  outer rule as it ran before its damping became the default;
* `n=<n>+outer0+topk+sparse`, `n=<n>+outer0+topk+q2+sparse`: pushes as
  SparseLoCo sends them (the outer rule without momentum, `+outer0`, top-k,
  2-bit values) and sparse fetches (`sparse_fetches`: a fetch sends only the
  entries the ps changed since the replica's last one);
* any `n=<n>...` row with `/straggler=<k>` (e.g. `n=16+outer/straggler=4`):
  heterogeneous workers, the last worker `k` times slower (each of its
  scheduled functions sleeps `k - 1` times its own duration after it,
  `stragglers.slow_worker` through `Downpour.step_delay_fn`).

`--nic_rates=unlimited,10gbit,1gbit,100mbit` runs every row behind emulated
NICs of each rate (`LocalCluster(nic_bandwidth=)`; `--ps_nic_rate` for the ps
tasks), first entering a private network namespace; `--max_row_secs` cuts a
row off after the evaluation interval that passes that many training seconds
("not reached in T s", counting as T), for every row or per row
(`150,stock=480`); `--calibration_secs` runs the unlimited rows (but
`single`) one round each, cut off after that many seconds, only to calibrate
the planner where running them to the target costs too long (the paper's
42M-parameter model); `--stop_at_target` ends a row at its
first evaluation at or above the target (a time-to-accuracy run needs nothing
after it; its examples/s and bytes are measured over the steps it ran). Next
to each row the planner (`tf_distbelief.planner`) predicts its examples/s
(`downpour_network.py` says how it is calibrated: on the host's loopback
TCP rate, measured at the start, and `--step_jitter_ms`, which
`benchmarks/step_jitter.py` measures).

`--num_workers=1,2,4,8` and `--num_ps=4` (lists) run every row on a cluster
of each worker count and ps count (`--steps` and `--eval_every` are for 2
workers: with W, each worker runs as many steps); each cluster gets the tables
and outputs below (in `workers_<W>_ps_<P>/` when several), and with several
worker counts the speed-up against replicas follows (Dean et al. 2012, Figure
3's form): per row and worker count, examples/s over the same row's at the
fewest workers, seconds and examples to the target, Downpour's push staleness
(ps updates by other replicas between a replica's fetch and its push, from
the replicas' counters: the mean over the measured window's pushes and the
largest of the row), socket bytes per example, the chief's CPU per function
the coordinator ran on the workers, and the largest proportional set size of
a chief, ps and worker task (`benchmarks.task_memory`, read at the end of
the row; the chief keeps every earlier row's model, so its figure grows from
row to row); `downpour_replicas.csv` and per model, NIC rate and ps
count `downpour_<model>_replicas_<nic>_ps<P>.png`, with the ideal line.

Printed: the headline table (seconds and examples to `--target_accuracy`,
ratios to stock and single, final accuracy, ex/s, bytes per example; a `nic`
column when shaped), the throughput table (`--throughput_table`: socket and
tensor bytes, CPU ms per step; `--cpu_breakdown` by process kind), and with
several rates the bandwidth table (measured vs predicted ex/s, bottleneck)
and the best Downpour row per rate against stock and single.

Outputs (`--out_dir`, default `benchmarks/results/`):
`downpour_time_to_accuracy.csv`, and per NIC rate (in `nic_<rate>/` when
several) `downpour.csv`, `downpour_curves.csv` and per model
`downpour_<model>_{accuracy,time_to_target,bytes}.png`; with several rates
`downpour_bandwidth.csv` and `downpour_<model>_bandwidth.png` (seconds to
target against the NIC rate, log axes). Measured figures: benchmarks/README.md.

TensorFlow logs "Failed to remove function remotely" for an earlier row's
functions (each row reconnects); harmless.

Usage:
  python benchmarks/downpour_bench.py            # about 20 minutes, 2 idle cores
  python benchmarks/downpour_bench.py --quick    # about 3 minutes
  python benchmarks/downpour_bench.py --rows=stock,n=16,n=16+outer --rounds=3
  python benchmarks/downpour_bench.py --rows=stock,n=64+outer \
      --num_workers=1,2,4,8 --num_ps=4 --rounds=1
  python benchmarks/downpour_bench.py --rows=single,stock,n=16+outer \
      --nic_rates=unlimited,1gbit,100mbit --rounds=1 --max_row_secs=150
  python benchmarks/downpour_bench.py \
      --rows=single,stock,n=4,n=4+outer,n=16,n=16+outer,n=64,n=64+outer \
      --nic_rates=unlimited,10gbit,1gbit,100mbit --rounds=3 \
      --max_row_secs=450 --stop_at_target   # about 2.5 hours, 2 idle cores
"""

from __future__ import annotations

import collections
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks import (  # noqa: E402
    cluster_counts,
    downpour_figures,
    downpour_network,
    plots,
    traffic,
)
from benchmarks.downpour_tables import (  # noqa: E402
    UNLIMITED,
    Row,
    format_headline,
    format_replicas,
    format_table,
    median_rows,
    replica_rows,
    to_target,
    write_headline_csv,
    write_replicas_csv,
)
from tf_distbelief import console  # noqa: E402  (no TensorFlow)
from tf_distbelief.cluster.network import isolation  # noqa: E402  (no TensorFlow)

if __name__ == "__main__":
    # An emulated NIC needs the private network namespace: re-execute in it
    # while no TensorFlow is loaded and no thread runs (launch/train.py does
    # the same); unshaped runs stay in the host's namespace, as before.
    if downpour_network.shaped_in_argv(sys.argv):
        isolation.enter_private_network()

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
# n_fetch = n_push = n), "n=<n>+<rule>" (with a push rule); a Downpour row
# with "/straggler=<k>" has its last worker k times slower.
_STRAGGLER = "/straggler="
_RULES = ("outer", "dc", "stale")
# Compressed outer pushes (`+outer+topk`...): the pseudo-gradient sends no
# squares, so AdaGrad's default 'squares' accumulator mode is kept.
_COMPRESSED = ("outer+topk", "outer+q8", "outer+topk+q8", "outer+topk+q2")
# The outer rule with its stale-push correction (`+outer+damp`): lambda 1
# did best in docs/downpour.md's simulation ("Stale pushes and the outer
# momentum").
_DAMPED = ("outer+damp",)
_STALE_DAMPING = 1.0
# Sparse pushes and fetches (`+sparse`): the outer rule without momentum
# (`+outer0`; momentum would move every entry at every push), applying each
# pseudo-gradient as it is, as DiLoCo's plain averaging does, with the error
# feedback of the compression in place of the momentum (SparseLoCo).
_SPARSE = ("outer0+topk+sparse", "outer0+topk+q2+sparse")
_OUTER0_LEARNING_RATE = 1.0
# The `+topk` rows' fraction: 1% of each tensor, top-k's usual regime (Lin et
# al. 2018 send 0.1%, with momentum correction).
_TOP_K_FRACTION = 0.01
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
_NS = (1, 4, 8, 16, 32, 64)


def _known_rows():
    names = ["single", "stock"]
    for n in _NS:
        names.append(f"n={n}")
        names += [f"n={n}+{r}" for r in _RULES if not (n == 1 and r == "outer")]
        names += [f"n={n}+{r}" for r in _COMPRESSED + _DAMPED + _SPARSE if n > 1]
    return names


_QUICK_SPEECH_CLASSES = 2048
# Test examples of the speech data: at an accuracy of 0.18 the sampling error
# is 0.4 points (0.9 with `tf_distbelief/demos/speech.py`'s default of 2,000).
_SPEECH_TEST_EXAMPLES = 10_000
# AdaGrad gamma per model: the 4 sigmoid layers of the speech model learn
# slowly at digits' 0.1, and at 0.5 the asynchronous runs often stay at the
# most frequent class.
_LEARNING_RATE = {"digits": 0.1, "speech": 0.2}
_MODELS = ("digits", "speech")

# Test examples per forward pass of an evaluation: each pass reads every ps
# variable, 9.7 MB for the speech model (20 passes of 512 would take 16 s
# behind a 100 Mbit/s NIC; 2 of 5,000 take 1.6 s).
_EVAL_BATCH = 5000

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
    flags.DEFINE_list(
        "num_workers",
        ["2"],
        "Worker counts (model replicas): every row runs on a LocalCluster of "
        "each count, with each --num_ps count; with several, the speed-up "
        "against replicas is printed and drawn.",
    )
    flags.register_validator("num_workers", cluster_counts.check_counts("num_workers"))
    flags.DEFINE_list("num_ps", ["1"], "ps task counts (see --num_workers).")
    flags.register_validator("num_ps", cluster_counts.check_counts("num_ps"))
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
        "2 x steps_per_execution keeps the workers even). With W workers "
        "(--num_workers), K x W / 2: each worker runs as many steps.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "steps",
        None,
        "Training steps of every row, both workers together (default: per "
        "model, speech 1600, digits 480; with W workers, x W / 2; rounded up "
        "to a multiple of --eval_every).",
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
    flags.DEFINE_float(
        "top_k_fraction",
        _TOP_K_FRACTION,
        "The `+topk` rows: DownpourConfig.top_k_fraction.",
        lower_bound=0.0,
        upper_bound=1.0,
    )
    flags.DEFINE_float(
        "stale_damping",
        _STALE_DAMPING,
        "The `+damp` rows: DownpourConfig.stale_damping.",
        lower_bound=0.0,
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
    flags.DEFINE_list(
        downpour_network.RATES_FLAG,
        [UNLIMITED],
        "NIC rates to run every row at, each on a new LocalCluster "
        "(nic_bandwidth): unlimited (the bare loopback), or a rate such as "
        "10gbit, 1gbit, 100mbit. Any shaped rate makes the benchmark enter a "
        "private network namespace first.",
    )
    flags.register_validator(downpour_network.RATES_FLAG, downpour_network.check_rates)
    flags.DEFINE_string(
        downpour_network.PS_RATE_FLAG,
        None,
        "The ps tasks' NIC rate at every shaped --nic_rates entry (default: "
        "that entry's rate); unlimited rows stay unshaped.",
    )
    flags.DEFINE_list(
        "max_row_secs",
        [],
        "Cut a row off after the evaluation interval whose end passes this "
        "many training seconds (reported as 'not reached in T s'): SECS for "
        "every row, ROW=SECS for one row (e.g. '150,stock=480'); default: "
        "every row runs all its steps.",
    )
    flags.register_validator("max_row_secs", _check_max_row_secs)
    flags.DEFINE_float(
        "step_jitter_ms",
        None,
        "The planner's step_jitter_secs (in ms): the standard deviation of a "
        "worker step's time on this cluster, as benchmarks/step_jitter.py "
        "measures it; default: the planner's (only the first exchange after "
        "a join in step).",
        lower_bound=0,
    )
    flags.DEFINE_float(
        "calibration_secs",
        None,
        "With an unlimited entry among --nic_rates: its rows other than "
        "`single` run one round only, cut off after this many training "
        "seconds, to calibrate the planner (their ex/s); for a model too large "
        "to run to the target at every rate (default: every unlimited row "
        "runs as the shaped ones do).",
    )
    flags.register_multi_flags_validator(
        ["calibration_secs", downpour_network.RATES_FLAG], _check_calibration
    )
    flags.DEFINE_bool(
        "stop_at_target",
        False,
        "Stop each row after the first evaluation at or above the target "
        "accuracy (the final accuracy is then that evaluation's); default: "
        "every row runs all its steps.",
    )
    flags.DEFINE_float(
        "target_accuracy",
        None,
        "Test accuracy of the time to accuracy (default: per model, "
        f"{_TARGET_ACCURACY}; --quick {_QUICK_TARGET_ACCURACY}).",
    )


class _Probe:
    """Interval times and test accuracies; sockets, CPU and bytes after the first.

    Also Downpour's counters and the functions the coordinator ran at each
    snapshot, and the tasks' memory at the last.

    Training stops after the interval that passes `max_secs` training seconds
    (cut off), or after the first evaluation at or above `stop_at` (the
    target reached).
    """

    def __init__(
        self, replicas, pids, evaluate, max_secs=None, stop_at=None, strategy=None
    ):
        import tf_keras

        probe = self

        class Callback(tf_keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                probe.evaluate_point(count_cpu=False)

            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 0:
                    probe.snap("begin")
                probe.begin = time.monotonic()

            # `fit` joins the coordinator at the end of every epoch (one
            # evaluation interval), so each snapshot and evaluation sees every
            # scheduled step finished; both are outside the clock. The cut-off
            # comes at an epoch's end too: steps already scheduled cannot be
            # taken back.
            def on_epoch_end(self, epoch, logs=None):
                probe.epoch_secs.append(time.monotonic() - probe.begin)
                end = epoch == self.params["epochs"] - 1
                if not end and max_secs and sum(probe.epoch_secs) >= max_secs:
                    self.model.stop_training = probe.cut = end = True
                if epoch == 0:
                    probe.snap("first")
                if end:
                    probe.snap("last")
                # After the last snapshot, its CPU is outside the window.
                counted = probe.evaluate_point(count_cpu=not end)
                if not end and stop_at is not None and probe.accuracies[-1] >= stop_at:
                    # After a later interval the evaluation's CPU is in the
                    # window and taken out of it; after the first, the window
                    # ends at "first", before it. Its bytes are the chief's,
                    # never counted.
                    self.model.stop_training = probe.stopped_at_target = True
                    probe.snap("last")
                    if epoch == 0:
                        probe.eval_cpu.subtract(counted)

        self.callback = Callback()
        self.replicas = replicas
        self.strategy = strategy
        self.pids = pids
        self.evaluate = evaluate
        self.begin = 0.0
        self.epoch_secs: list[float] = []
        self.accuracies: list[float] = []
        # CPU seconds per pid the evaluations took inside the measured window.
        self.eval_cpu: dict[int, float] = collections.Counter()
        # "begin" (before the first interval), "first" (after it), "last".
        self.snaps: dict[str, tuple[list[traffic.TcpSocket], dict, int]] = {}
        # At each snapshot: the replicas' counters (`Downpour.stats`) and the
        # functions the coordinator has run (None before it exists).
        self.stats: dict[str, list] = {}
        self.functions: dict[str, int | None] = {}
        # The largest PSS (MB) of a task of each kind at the end of the row.
        self.memory_mb: dict[str, float] = {}
        self.cut = False  # Stopped by `max_secs`.
        self.stopped_at_target = False  # Stopped by `stop_at`.

    def evaluate_point(self, count_cpu):
        """Appends the test accuracy now (before training, after each interval).

        Returns:
          `{pid: CPU seconds}` the evaluation added to `eval_cpu` (empty
          without `count_cpu`).
        """
        before = {pid: traffic.cpu_secs(pid) for pid in self.pids}
        self.accuracies.append(self.evaluate())
        counted = collections.Counter()
        if count_cpu:
            for pid in self.pids:
                counted[pid] = traffic.cpu_secs(pid) - before[pid]
            self.eval_cpu.update(counted)
        return counted

    def window_names(self) -> tuple[str, str]:
        """The measured window's snapshots: after the first interval to the
        end, or the first interval itself when it is the only one (cut off)."""
        return ("first", "last") if len(self.epoch_secs) > 1 else ("begin", "first")

    def window(self):
        """`(before, after)` snapshots of `window_names`."""
        before, after = self.window_names()
        return self.snaps[before], self.snaps[after]

    def staleness(self) -> tuple[float, float]:
        """Downpour's push staleness: `(mean over the window's pushes, max of
        the row)`; NaN without Downpour or without a push in the window."""
        before, after = (self.stats.get(k, []) for k in self.window_names())
        if not after:
            return math.nan, math.nan
        judged = sum(s.pushes + s.dropped_pushes for s in after) - sum(
            s.pushes + s.dropped_pushes for s in before
        )
        stale = sum(s.staleness_sum for s in after) - sum(
            s.staleness_sum for s in before
        )
        most = max(s.max_staleness_seen for s in after)
        return (stale / judged if judged else math.nan), float(most)

    def functions_run(self) -> int | None:
        """Functions the coordinator ran in the window (None: not counted)."""
        before, after = (self.functions.get(k) for k in self.window_names())
        return None if before is None or after is None else after - before

    def snap(self, name):
        moved = 0
        if self.replicas:
            stats = self.replicas.stats()
            self.stats[name] = stats
            moved = sum(s.bytes_fetched + s.bytes_pushed for s in stats)
        if self.strategy is not None:
            from tf_distbelief.tf_internals import coordinator

            progress = coordinator.CoordinatorProgress.of(self.strategy)
            self.functions[name] = None if progress is None else progress.finished
        cpu = {pid: traffic.cpu_secs(pid) for pid in self.pids}
        sockets = (
            traffic.read_sockets(pids=self.pids) if self.replicas is not False else []
        )
        self.snaps[name] = (sockets, cpu, moved)
        if name == "last":
            # After the window's CPU is read: reading the tasks' memory maps
            # takes the chief tens of milliseconds per task.
            from benchmarks import task_memory

            found = task_memory.sample(os.getpid())
            task_memory.merge_peaks(
                self.memory_mb, {k: v for k, v in found.items() if " " not in k}
            )

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


def _straggler(name: str) -> tuple[str, float | None]:
    """`"n=16+outer/straggler=4"` -> `("n=16+outer", 4.0)`; without the
    suffix `(name, None)`.

    Raises:
      ValueError: the slowdown is not a number >= 1.
    """
    base, suffix, slowdown = name.partition(_STRAGGLER)
    if not suffix:
        return name, None
    try:
        value = float(slowdown)
    except ValueError:
        value = math.nan
    if not value >= 1 or math.isinf(value):
        raise ValueError(
            f"Row {name!r}: the straggler's slowdown must be a number >= 1. "
            f"Received: {slowdown!r}"
        )
    return base, value


def _row_kind(name: str) -> tuple[str, int | None, str | None]:
    """`"single"|"stock"|"n=16+outer"` -> `(kind, n, rules)`, `rules` such as
    `"outer+topk"`; a `/straggler=<k>` suffix is ignored (`_straggler`)."""
    name, _ = _straggler(name)
    if name in ("single", "stock"):
        return name, None, None
    n, _, rule = name.partition("+")
    return "downpour", int(n[len("n=") :]), rule or None


def _downpour_config(n, rule, f):
    from tf_distbelief import downpour

    settings = {
        "outer": {
            "outer_learning_rate": f.outer_learning_rate,
            "outer_momentum": f.outer_momentum,
        },
        "dc": {"delay_compensation": f.delay_compensation},
        "stale": {"staleness_scaled": True},
        "topk": {"top_k_fraction": f.top_k_fraction},
        "damp": {"stale_damping": f.stale_damping},
        "undamped": {"stale_damping": 0.0},
        "q8": {"quantize_bits": 8},
        "outer0": {
            "outer_learning_rate": _OUTER0_LEARNING_RATE,
            "outer_momentum": 0.0,
        },
        "q2": {"quantize_bits": 2},
        "sparse": {"sparse_fetches": True},
    }
    rules = {}
    for name in rule.split("+") if rule else ():
        rules.update(settings[name])
    return downpour.DownpourConfig(
        n_fetch=n,
        n_push=n,
        local_learning_rate=f.local_learning_rate,
        local_optimizer=f.local_optimizer,
        adagrad_accumulator=f.adagrad_accumulator,
        **rules,
    )


def _per_workers(steps: int, workers: int) -> int:
    """`steps` of 2 workers for `workers` (each runs as many), at least 1."""
    return max(1, -(-steps * workers // 2))


def _eval_every(f, model_name, workers=2):
    """Steps between evaluations on `workers` workers (`--eval_every`)."""
    steps = f.eval_every or (_QUICK_EVAL_EVERY if f.quick else _EVAL_EVERY)[model_name]
    return _per_workers(steps, workers)


def _intervals(f, model_name, workers=2):
    """Evaluation intervals of every row: `--steps / --eval_every`, rounded up."""
    steps = f.steps or (_QUICK_STEPS if f.quick else _STEPS)[model_name]
    return max(
        2,
        -(-_per_workers(steps, workers) // _eval_every(f, model_name, workers)),
    )


def _target(f, model_name):
    if f.target_accuracy is not None:
        return f.target_accuracy
    return (_QUICK_TARGET_ACCURACY if f.quick else _TARGET_ACCURACY)[model_name]


def _speech_classes(f):
    return min(f.speech_classes, _QUICK_SPEECH_CLASSES) if f.quick else f.speech_classes


def _load_data(model_name, f):
    from tf_distbelief import demos
    from tf_distbelief.demos import speech

    if model_name == "speech":
        return speech.load_data(
            num_test=_SPEECH_TEST_EXAMPLES, num_classes=_speech_classes(f)
        )
    return demos.spec(model_name).load_data()


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


def _run(local, data, model_name, name, f, seed, nic=UNLIMITED, max_secs=None) -> Row:
    """Trains one row (fresh strategy or, for `single`, no cluster); returns it.

    `max_secs`, when given, replaces the row's `--max_row_secs` cut-off.
    """
    import statistics

    from tf_distbelief import demos, hooks, job
    from tf_distbelief import strategy as strategy_lib
    from tf_distbelief.fit import training

    kind, n, rule = _row_kind(name)
    # `single` trains as many examples as the rows of 2 workers.
    workers = 2 if kind == "single" else local.num_workers
    steps = _eval_every(f, model_name, workers)
    intervals = _intervals(f, model_name, workers)
    config = job.JobConfig(
        learning_rate=f.learning_rate or _LEARNING_RATE[model_name],
        batch_size=f.batch_size,
        steps_per_execution=f.steps_per_execution,
        num_ps=local.num_ps,
        seed=seed,
        downpour=None if n is None else _downpour_config(n, rule, f),
    ).validate()
    spec = demos.spec(
        model_name,
        seed=seed,
        speech_hidden_units=f.speech_hidden_units,
        speech_classes=_speech_classes(f),
    )
    (x_train, y_train), (x_test, y_test) = data
    start = time.monotonic()
    roles = {os.getpid(): "chief"}
    strategy = None
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
        # Downpour's state (its counters), None for stock training.
        replicas = hooks.of(model).state if kind == "downpour" else None
        _, slowdown = _straggler(name)
        if slowdown is not None:
            from benchmarks import stragglers

            replicas.step_delay_fn = stragglers.slow_worker(
                local.num_workers - 1, straggler_slowdown=slowdown
            )
        roles.update({p.pid: k for (k, _), p in local.processes.items()})
    # Kept until exit: a collected model's functions are removed from the
    # tasks, which the reconnected context no longer knows (noisy errors).
    _KEEP_ALIVE.append(model)
    caps = _max_row_secs(f.max_row_secs)
    probe = _Probe(
        replicas,
        list(roles),
        lambda: training.accuracy(model, x_test, y_test, _EVAL_BATCH),
        max_secs or caps.get(name, caps.get("")),
        _target(f, model_name) if f.stop_at_target else None,
        strategy=strategy,
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
    (before, cpu0, moved0), (after, cpu1, moved1) = probe.window()
    timed_steps = max(1, len(probe.epoch_secs) - 1) * steps
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
    num_params = sum(v.shape.num_elements() for v in model.trainable_variables)
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
        steps * config.batch_size / s
        for s in (probe.epoch_secs[1:] or probe.epoch_secs)
    )
    functions = probe.functions_run()
    chief_cpu_ms_per_function = math.nan
    if functions:
        chief_cpu_ms_per_function = cpu_ms["chief"] * timed_steps / functions
    staleness_mean, staleness_max = probe.staleness()
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
        test_loss=_test_loss(model, x_test, y_test, _EVAL_BATCH),
        wall_secs=time.monotonic() - start,
        curve=curve,
        target=target,
        secs_to_target=secs,
        examples_to_target=examples_to,
        reached=int(not math.isnan(secs)),
        nic=nic,
        num_params=num_params,
        cut_off_secs=curve[-1][0] if probe.cut else math.nan,
        num_workers=1 if kind == "single" else local.num_workers,
        num_ps=0 if kind == "single" else local.num_ps,
        staleness_mean=staleness_mean,
        staleness_max=staleness_max,
        chief_cpu_ms_per_function=chief_cpu_ms_per_function,
        memory_mb=probe.memory_mb,
    )


def _check_rows(names: list[str]) -> bool:
    """absl validator: refuses unknown `--rows` when the flags are parsed."""
    known = _known_rows()
    unknown = []
    for name in names:
        try:
            base, slowdown = _straggler(name)
        except ValueError as e:
            raise flags.ValidationError(f"--rows: {e}") from None
        if base not in known:
            unknown.append(name)
        elif slowdown is not None and not base.startswith("n="):
            raise flags.ValidationError(
                f"--rows: {name!r}: only Downpour rows (n=...) take "
                f"{_STRAGGLER}<k> (the delay runs in the Downpour step)"
            )
    if unknown:
        raise flags.ValidationError(
            f"--rows: unknown {unknown}; known: {','.join(known)} "
            f"(each n=... row also with {_STRAGGLER}<k>)"
        )
    return True


def _max_row_secs(entries: list[str]) -> dict:
    """`--max_row_secs` as `{row name: secs}`, `""` for every other row.

    Raises:
      ValueError: an entry that is not SECS or ROW=SECS with SECS > 0, or a
        second SECS or ROW.
    """
    caps = {}
    for entry in entries:
        name, _, secs = entry.rpartition("=")
        try:
            value = float(secs)
        except ValueError:
            value = math.nan
        if not value > 0 or math.isinf(value):
            raise ValueError(
                f"{entry!r}: SECS must be a number of seconds > 0 (SECS or ROW=SECS)"
            )
        if name in caps:
            raise ValueError(f"{entry!r}: {name or 'SECS'} given twice")
        caps[name] = value
    return caps


def _check_max_row_secs(entries: list[str]) -> bool:
    """absl validator of `--max_row_secs`: SECS and ROW=SECS entries."""
    try:
        caps = _max_row_secs(entries)
    except ValueError as e:
        raise flags.ValidationError(f"--max_row_secs: {e}") from None
    unknown = [n for n in caps if n and _straggler(n)[0] not in _known_rows()]
    if unknown:
        raise flags.ValidationError(
            f"--max_row_secs: unknown rows {unknown}; known: {','.join(_known_rows())}"
        )
    return True


def _calibration(f, nic: str, name: str) -> bool:
    """True for a row that runs only to calibrate the planner (`--calibration_secs`)."""
    return f.calibration_secs is not None and nic == UNLIMITED and name != "single"


def _check_calibration(values: dict) -> bool:
    """absl validator: `--calibration_secs` needs unlimited and a shaped rate."""
    rates, secs = values[downpour_network.RATES_FLAG], values["calibration_secs"]
    if secs is not None and not 0 < secs < math.inf:
        raise flags.ValidationError(
            f"--calibration_secs must be a number of seconds > 0. Received: {secs}"
        )
    if secs is not None and (UNLIMITED not in rates or rates == [UNLIMITED]):
        raise flags.ValidationError(
            f"--calibration_secs={values['calibration_secs']} calibrates the "
            f"planner on the unlimited rows for the shaped ones: --nic_rates "
            f"must hold unlimited and a shaped rate. Received: {','.join(rates)}"
        )
    return True


def _rows(f) -> list[str]:
    return f.rows or list(_QUICK_ROWS if f.quick else _DEFAULT_ROWS)


def _print_round(round_index, rounds, r):
    reached = not math.isnan(r.secs_to_target)
    secs = f"{r.secs_to_target:.1f} s to" if reached else "did not reach"
    cut = "" if math.isnan(r.cut_off_secs) else f" (cut off at {r.cut_off_secs:.0f} s)"
    nic = "" if r.nic == UNLIMITED else f" nic={r.nic}"
    print(
        f"round {round_index + 1}/{rounds} {r.model}{nic} {r.name}: "
        f"{secs} {r.target:.3f}{cut}, final {r.test_accuracy:.4f}, "
        f"{r.examples_per_sec:.0f} ex/s, {r.wall_secs:.0f} s wall",
        flush=True,
    )


def _header(f, rounds, workers=2, ps=1):
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    steps = ", ".join(
        f"{m} {_intervals(f, m, workers)} x {_eval_every(f, m, workers)}"
        for m in f.models
    )
    nic = ""
    if f.nic_rates != [UNLIMITED]:
        nic = f" nic={','.join(f.nic_rates)}"
        if f.ps_nic_rate:
            nic += f" ps_nic={f.ps_nic_rate}"
        if f.max_row_secs:
            nic += f" max_row_secs={','.join(f.max_row_secs)}"
        if f.calibration_secs is not None:
            nic += f" calibration_secs={f.calibration_secs:g} (unlimited: 1 round)"
    stop = " stop_at_target" if f.stop_at_target else ""
    return (
        f"cores={os.cpu_count()} load={load} workers={workers} ps={ps} "
        f"batch={f.batch_size} steps_per_execution={f.steps_per_execution} "
        f"steps=({steps}) medians of {rounds} rounds (seeds {f.first_seed}-"
        f"{f.first_seed + rounds - 1}) lr="
        + ",".join(f"{m}:{f.learning_rate or _LEARNING_RATE[m]}" for m in f.models)
        + f" speech=440-{f.speech_hidden_units}x4-{_speech_classes(f)} "
        f"outer={f.outer_learning_rate}/{f.outer_momentum} "
        f"dc={f.delay_compensation} topk={f.top_k_fraction} "
        f"damp={f.stale_damping}{nic}{stop}"
    )


def _write_outputs(f, rows, round_rows, header, predicted, out_dir):
    """One cluster's CSVs and figures in `out_dir`; per NIC rate in
    `nic_<rate>/` when several."""
    targets = {m: _target(f, m) for m in f.models}
    paths = [
        write_headline_csv(os.path.join(out_dir, "downpour_time_to_accuracy.csv"), rows)
    ]
    several = len(f.nic_rates) > 1
    for k, nic in enumerate(f.nic_rates):
        # `single` ran once, at the first rate; every rate's figures show it.
        def here(r, nic=nic, k=k):
            return r.nic == nic or (r.name == "single" and k > 0)

        folder = os.path.join(out_dir, f"nic_{nic}") if several else out_dir
        paths += downpour_figures.write_outputs(
            folder,
            [r for r in rows if here(r)],
            [(i, r) for i, r in round_rows if here(r)],
            header,
            targets,
        )
    if several:
        paths.append(
            downpour_network.write_bandwidth_csv(
                os.path.join(out_dir, "downpour_bandwidth.csv"), rows, predicted
            )
        )
        note = header.split(" workers=")[0] + " (shared machine: noisy timings)"
        for model in f.models:
            paths.append(
                downpour_figures.bandwidth_figure(
                    os.path.join(out_dir, f"downpour_{model}_bandwidth.png"),
                    [r for r in rows if r.model == model],
                    downpour_network.rate_bits,
                    note,
                )
            )
    for path in paths:
        print(f"wrote {path}", flush=True)


def _predictions(f, rows, loopback_bits, workers=2, ps=1):
    return downpour_network.predict_rows(
        rows,
        num_workers=workers,
        num_ps=ps,
        batch_size=f.batch_size,
        steps_per_execution=f.steps_per_execution,
        accumulator=f.adagrad_accumulator,
        ps_nic_rate=f.ps_nic_rate,
        # `fit` joins the workers at each evaluation (an epoch's end).
        steps_between_joins={
            m: _eval_every(f, m, workers) // workers for m in f.models
        },
        step_jitter_secs=(
            None
            if f.step_jitter_ms is None
            else {m: f.step_jitter_ms / 1e3 for m in f.models}
        ),
        loopback_bits_per_sec=loopback_bits,
        top_k_fraction=f.top_k_fraction,
    )


def _clusters(f) -> list[tuple[int, int]]:
    """`(workers, ps)` of every cluster: each ps count, each worker count."""
    return [
        (w, p)
        for p in cluster_counts.counts(f.num_ps)
        for w in cluster_counts.counts(f.num_workers)
    ]


def _report(f, rows, round_rows, rounds, workers, ps, loopback_bits, folder):
    """Prints one cluster's tables and writes its outputs under `folder`.

    Returns:
      Its rows' medians over rounds (`median_rows`).
    """
    rows = median_rows(rows)
    header = _header(f, rounds, workers, ps)
    for line in format_headline(rows, header).splitlines():
        print(line, flush=True)
    if f.throughput_table:
        print(flush=True)
        print(format_table(rows, "throughput (medians over rounds):"), flush=True)
    if f.cpu_breakdown:
        for r in rows:
            cpu = " ".join(f"{k}={v:.1f}" for k, v in sorted(r.cpu_ms_per_step.items()))
            print(f"{r.model} {r.nic} {r.name}: CPU ms/step {cpu}")
    predicted = _predictions(f, rows, loopback_bits, workers, ps)
    if len(f.nic_rates) > 1:
        print(flush=True)
        print(
            "time to target by NIC rate; predicted: the planner calibrated on "
            "the row's unlimited ex/s (else single's):",
            flush=True,
        )
        print(downpour_network.format_bandwidth(rows, predicted))
        for line in downpour_network.best_downpour_lines(rows):
            print(line, flush=True)
    if folder is not None:
        _write_outputs(f, rows, round_rows, header, predicted, folder)
    return rows


def _report_replicas(f, rows, rounds):
    """The speed-up against replicas: table, CSV and one figure per model,
    NIC rate and ps count (`--num_workers` of several counts)."""
    rows = replica_rows(rows)
    header = (
        f"speed-up against replicas (workers={','.join(f.num_workers)}; medians "
        f"of {rounds} rounds; x fewest: ex/s over the same row's at "
        f"{min(cluster_counts.counts(f.num_workers))} workers):"
    )
    print(flush=True)
    print(format_replicas(rows, header), flush=True)
    if not f.out_dir:
        return
    paths = [write_replicas_csv(os.path.join(f.out_dir, "downpour_replicas.csv"), rows)]
    note = plots.machine_note()
    for model, nic, ps in dict.fromkeys((r.model, r.nic, r.num_ps) for r in rows):
        paths.append(
            downpour_figures.speedup_figure(
                os.path.join(f.out_dir, f"downpour_{model}_replicas_{nic}_ps{ps}.png"),
                [r for r in rows if (r.model, r.nic, r.num_ps) == (model, nic, ps)],
                note,
            )
        )
    for path in paths:
        print(f"wrote {path}", flush=True)


def main(argv):
    console.start_quiet_script(argv)
    from tf_distbelief import cluster

    f = flags.FLAGS
    bad = [m for m in f.models if m not in _MODELS]
    if bad:
        raise app.UsageError(f"--models must be among {_MODELS}. Received: {bad}")
    if f.ps_nic_rate is not None:
        downpour_network.rate_bits(f.ps_nic_rate)  # Refused before any row runs.
    names = _rows(f)
    rounds = f.rounds or (1 if f.quick else 3)
    clusters = _clusters(f)
    rows = []
    round_rows = []
    data = {m: _load_data(m, f) for m in f.models}
    # On idle cores, before any cluster: the planner's unlimited NIC.
    loopback_bits = downpour_network.loopback_rate_bits()
    print(f"loopback TCP rate: {loopback_bits / 1e9:.1f} Gbit/s", flush=True)
    for k, nic in enumerate(f.nic_rates):
        shaped = nic != UNLIMITED
        for c, (workers, ps) in enumerate(clusters):
            with cluster.LocalCluster(
                num_workers=workers,
                num_ps=ps,
                intra_op_threads=f.task_intra_op_threads,
                nic_bandwidth=nic if shaped else None,
                ps_nic_bandwidth=f.ps_nic_rate if shaped else None,
            ) as local:
                # Rounds interleave the rows, so that a change in the load of
                # the machine spreads over all of them.
                for round_index in range(rounds):
                    for model_name in f.models:
                        for name in names:
                            if name == "single" and (k > 0 or c > 0):
                                # No network: once, at the first rate and cluster.
                                continue
                            calibration = _calibration(f, nic, name)
                            if calibration and round_index > 0:
                                continue  # The planner's calibration: one round.
                            seed = f.first_seed + round_index
                            r = _run(
                                local,
                                data[model_name],
                                model_name,
                                name,
                                f,
                                seed,
                                nic,
                                max_secs=f.calibration_secs if calibration else None,
                            )
                            rows.append(r)
                            round_rows.append((round_index, r))
                            _print_round(round_index, rounds, r)
    medians = []
    for workers, ps in clusters:
        # `single` ran once; every cluster's tables and figures show it.
        def here(r, workers=workers, ps=ps):
            return r.name == "single" or (r.num_workers, r.num_ps) == (workers, ps)

        folder = None
        if f.out_dir:
            folder = f.out_dir
            if len(clusters) > 1:
                folder = os.path.join(f.out_dir, f"workers_{workers}_ps_{ps}")
        medians += _report(
            f,
            [r for r in rows if here(r)],
            [(i, r) for i, r in round_rows if here(r)],
            rounds,
            workers,
            ps,
            loopback_bits,
            folder,
        )
    if len(cluster_counts.counts(f.num_workers)) > 1:
        _report_replicas(f, medians, rounds)


if __name__ == "__main__":
    define_flags()
    app.run(console.exiting(main, keep=(app.UsageError,)))
