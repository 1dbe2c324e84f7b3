r"""Downpour SGD against stock parameter-server training, side by side.

Dean et al. 2012, section 4.1: a replica that fetches the parameters every
`n_fetch` steps and pushes its accumulated gradient every `n_push` steps moves
about `1/n` of the bytes of stock parameter-server training (which reads every
parameter and sends every gradient at every step) and spends less time on the
network. This benchmark measures it on one `LocalCluster` (2 workers, 1 ps by
default), in one run, for each model:

* `stock`: `DistBeliefStrategy` without Downpour (TensorFlow's
  `ParameterServerStrategy` training: variables on the ps, every step reads them
  and applies its gradient there);
* `n=1`, `n=4`, `n=16`: Downpour with `n_fetch = n_push = n`.

Each configuration gets a fresh strategy (`LocalCluster.resolver_for`: a new
chief port on the same ps and worker tasks), trains one untimed warm-up epoch
(tracing), then `--timed_epochs` timed epochs, and is evaluated on the test set:
every configuration sees the same number of examples. `--repeats` rounds run
all configurations in turn (each trains anew) and the table shows medians: the
machine is shared, and its load moves rates by tens of percent.

Columns:

* `ex/s`: training examples per second (both workers), the median over the
  timed epochs (and over rounds); `x stock`: the ratio to the stock row of the
  same model in the same round, the median over rounds.
* `sock B/ex`: worker<->ps bytes per example on the sockets: the kernel's
  per-connection TCP counters (`ss -tinpH state established`: `bytes_acked`
  sent, `bytes_received` received), for every connection between a worker
  process and a ps process (told apart by process id and peer port), summed
  both ways, difference over the timed epochs. It includes gRPC framing and
  the fixed per-step messages (step ids, dead-branch signals, loop control).
* `tensor B/ex`: the same from tensor sizes: stock moves the model twice per
  step (read the parameters, send the gradient); Downpour counts its fetches
  and pushes (`Downpour.stats`) times the model size.
* `B x stock`: socket bytes per example over the stock row's.
* `CPU ms/step`: CPU time of the chief, workers and ps together per step
  (`psutil`; the chief's test-set evaluations for the curves are left out);
  on 2 cores the rates follow it (`--cpu_breakdown` splits it by process
  kind).
* `test acc`, `test loss`: on the test set after the warm-up and timed epochs.
  On the speech data the most frequent class is about 10% of the examples
  (`models/speech.py`: Zipf-distributed classes, a Gaussian cluster each).

The speech-shaped model (`models/speech.py`) defaults to 4 hidden layers of 256
units and 8192 classes (2.4M parameters, 9.7 MB) instead of the paper's 2560
units (42M), so that it trains on a 2-core machine; `--quick` uses 2048 classes.

Figures (`--out_dir`, default `benchmarks/results/`; `benchmarks/downpour_figures.py`):
after every epoch (and before the first) the chief evaluates the test accuracy,
outside the timed span, which gives the curves of

* `downpour_<model>_accuracy.png`: test accuracy against wall-clock training
  seconds per configuration (the paper's Figure 4 form; medians over rounds);
* `downpour_<model>_time_to_target.png`: seconds to a fixed test accuracy per
  configuration (Figure 5's measure; `--target_accuracy`, by default the best
  accuracy every configuration reached);
* `downpour_<model>_bytes.png`: worker<->ps bytes per example by n (log axis);

and `downpour.csv` (the table), `downpour_curves.csv` (every round's curve).

On stderr, TensorFlow logs "Failed to remove function remotely" for functions
of an earlier configuration's context (each configuration reconnects); they
are harmless.

Usage:
  python benchmarks/downpour_bench.py            # about 10 minutes, 2 cores
  python benchmarks/downpour_bench.py --quick    # about 3 minutes
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import time
from collections.abc import Iterable, Mapping

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from benchmarks import downpour_figures, plots  # noqa: E402

# Steps per epoch (both workers) of a full and a `--quick` run: multiples of 2
# workers x 20 steps per execution, so that the workers get as many scheduled
# functions; each epoch ends with a join (a worker may idle for up to one
# scheduled function), so an epoch should hold many functions per worker.
_STEPS_PER_EPOCH = {"digits": 400, "speech": 240}
_QUICK_STEPS_PER_EPOCH = {"digits": 160, "speech": 80}
_QUICK_SPEECH_CLASSES = 2048
# Test examples of the speech data: at an accuracy of 0.18 the sampling error
# is 0.4 points (0.9 with `models/speech.py`'s default of 2,000).
_SPEECH_TEST_EXAMPLES = 10_000
# AdaGrad gamma per model: the 4 sigmoid layers of the speech model learn
# slowly at digits' 0.1, and at 0.5 the asynchronous runs often stay at the
# most frequent class.
_LEARNING_RATE = {"digits": 0.1, "speech": 0.2}
_MODELS = ("digits", "speech")

Endpoint = tuple[str, int]
_KEEP_ALIVE = []


# --- Socket counters: pure functions, tested in tests/test_downpour_bench.py --


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    """One established TCP socket, as `ss -tinpH state established` shows it.

    Attributes:
      local: `(host, port)` of this end.
      peer: `(host, port)` of the other end.
      pids: process ids holding the socket (empty when `ss` may not see them).
      bytes_acked: bytes this end sent that the peer acknowledged.
      bytes_received: bytes this end received.
    """

    local: Endpoint
    peer: Endpoint
    pids: tuple[int, ...]
    bytes_acked: int
    bytes_received: int


_PID = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


def _endpoint(text: str) -> Endpoint:
    """`127.0.0.1:80`, `[::1]:80`, `[::ffff:127.0.0.1]:80` -> `(host, port)`."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if host.startswith("::ffff:"):  # An IPv4 peer of an IPv6 socket.
        host = host[len("::ffff:") :]
    return host.split("%")[0], int(port)


def parse_ss(text: str) -> list[TcpSocket]:
    """Parses the output of `ss -tinpH state established`.

    Each socket is a line `Recv-Q Send-Q local peer [users:((...pid=N...))]`
    followed by an indented line of TCP info. `ss` leaves out counters that are
    0, so a missing `bytes_acked` or `bytes_received` reads as 0.

    Args:
      text: the command's standard output.

    Returns:
      The sockets, in order.
    """
    sockets = []
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            if current is not None:
                sockets.append(TcpSocket(**current))
            fields = line.split()
            current = {
                "local": _endpoint(fields[2]),
                "peer": _endpoint(fields[3]),
                "pids": tuple(int(p) for p in _PID.findall(line)),
                "bytes_acked": 0,
                "bytes_received": 0,
            }
        elif current is not None:
            for name, value in _COUNTER.findall(line):
                current[name] = int(value)
    if current is not None:
        sockets.append(TcpSocket(**current))
    return sockets


def cpu_secs(pid: int) -> float:
    """User plus system CPU seconds of process `pid` (`psutil`)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def read_sockets() -> list[TcpSocket]:
    """Runs `ss -tinpH state established` and parses it."""
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"],
        check=True,
        capture_output=True,
        text=True,
    )
    return parse_ss(out.stdout)


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes between two groups of processes, seen from the first group.

    Attributes:
      sent: bytes the first group sent to the second (acknowledged).
      received: bytes the first group received from the second.
    """

    sent: int = 0
    received: int = 0

    @property
    def total(self) -> int:
        return self.sent + self.received


def link_bytes(
    before: Iterable[TcpSocket],
    after: Iterable[TcpSocket],
    pids: Iterable[int],
    peer_pids: Iterable[int],
    peer_ports: Mapping[int, int] | None = None,
) -> LinkBytes:
    """Bytes moved between processes `pids` and `peer_pids` from `before` to `after`.

    Every connection between the two groups appears twice on loopback, once
    from each end; it is counted once, from the end owned by `pids`. The other
    end is attributed by its owner: the socket whose local endpoint is this
    socket's peer, or else `peer_ports` (the groups' listening ports, for a peer
    whose socket `ss` shows without a process). A connection opened after
    `before` counts from 0; one closed before `after` is lost (gRPC keeps its
    channels open, so none close during training).

    Args:
      before: the sockets at the start (`parse_ss`).
      after: the sockets at the end.
      pids: process ids of the first group (e.g. the workers).
      peer_pids: process ids of the second group (e.g. the ps tasks).
      peer_ports: optional `{listening port: pid}` of known servers.

    Returns:
      A `LinkBytes`.
    """
    after = list(after)
    pids, peer_pids = set(pids), set(peer_pids)
    owners: dict[Endpoint, set[int]] = collections.defaultdict(set)
    for s in after:
        owners[s.local].update(s.pids)
    ports = dict(peer_ports or {})
    start = {(s.local, s.peer): s for s in before}
    sent = received = 0
    for s in after:
        if not pids.intersection(s.pids):
            continue
        peer_owners = owners.get(s.peer) or {ports.get(s.peer[1])}
        if not peer_pids.intersection(peer_owners):
            continue
        old = start.get((s.local, s.peer))
        if old is None or old.bytes_acked > s.bytes_acked:
            old = TcpSocket(s.local, s.peer, s.pids, 0, 0)
        sent += s.bytes_acked - old.bytes_acked
        received += s.bytes_received - old.bytes_received
    return LinkBytes(sent, received)


# --- The benchmark -------------------------------------------------------------


def define_flags():
    flags.DEFINE_bool(
        "curves",
        True,
        "Evaluate the test accuracy after every epoch (the accuracy figures).",
    )
    flags.DEFINE_bool(
        "quick",
        False,
        "About 3 minutes: shorter epochs and a 2048-class speech model.",
    )
    flags.DEFINE_list("models", list(_MODELS), "Models to run: digits, speech.")
    flags.DEFINE_list("n", ["1", "4", "16"], "Downpour n_fetch = n_push values.")
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
        "timed_epochs", 3, "Timed epochs after the warm-up epoch.", lower_bound=1
    )
    flags.DEFINE_integer(
        "repeats",
        3,
        "Rounds over all configurations (each trains anew); the table shows "
        "medians over rounds.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "steps_per_epoch", None, "Steps per epoch (default: per model).", lower_bound=1
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
    flags.DEFINE_integer("speech_hidden_units", 256, "Speech model width.")
    flags.DEFINE_integer("speech_classes", 8192, "Speech model softmax width.")
    flags.DEFINE_bool(
        "cpu_breakdown", False, "Also print CPU ms per step of each process kind."
    )
    flags.DEFINE_string(
        "out_dir", plots.DEFAULT_OUT_DIR, "CSV and PNG output folder ('' for none)."
    )
    flags.DEFINE_float(
        "target_accuracy",
        None,
        "Test accuracy of the time-to-target figure (default: per model, the "
        "best accuracy every configuration reached).",
    )


@dataclasses.dataclass
class Row:
    """One configuration's measurements."""

    model: str
    name: str
    examples_per_sec: float  # Median over the timed epochs.
    socket_bytes_per_example: float
    tensor_bytes_per_example: float
    cpu_ms_per_step: dict  # {"chief"|"worker"|"ps": CPU ms per step}.
    test_accuracy: float
    test_loss: float
    wall_secs: float
    # Examples/s over the same round's stock row, median over rounds (set by
    # `median_rows`); None: the ratio of the rates.
    speedup: float | None = None
    # `(training secs, test accuracy)` before training and after each epoch;
    # the seconds leave the evaluations out (medians over rounds after
    # `median_rows`).
    curve: list = dataclasses.field(default_factory=list)


class _Probe:
    """Per-epoch times; sockets, CPU and Downpour bytes after warm-up and at the end."""

    def __init__(self, replicas, pids, evaluate=None):
        import tf_keras

        probe = self

        class Callback(tf_keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                probe.evaluate_point(count_cpu=False)

            def on_epoch_begin(self, epoch, logs=None):
                probe.begin = time.monotonic()

            # `fit` joins the coordinator at the end of every epoch, so each
            # snapshot sees every scheduled step finished; it is taken outside
            # the timed epochs.
            def on_epoch_end(self, epoch, logs=None):
                secs = time.monotonic() - probe.begin
                probe.train_secs += secs
                if epoch > 0:
                    probe.epoch_secs.append(secs)
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
        self.train_secs = 0.0
        self.epoch_secs: list[float] = []
        self.curve: list[tuple[float, float]] = []
        # CPU seconds per pid the evaluations took inside the measured window.
        self.eval_cpu: dict[int, float] = collections.Counter()
        self.snaps: list[tuple[list[TcpSocket], dict, int]] = []

    def evaluate_point(self, count_cpu):
        """Adds `(training secs so far, test accuracy)` to the curve."""
        if self.evaluate is None:
            return
        before = {pid: cpu_secs(pid) for pid in self.pids}
        self.curve.append((self.train_secs, self.evaluate()))
        if count_cpu:
            for pid in self.pids:
                self.eval_cpu[pid] += cpu_secs(pid) - before[pid]

    def snap(self):
        moved = 0
        if self.replicas is not None:
            moved = sum(s.bytes_fetched + s.bytes_pushed for s in self.replicas.stats())
        cpu = {pid: cpu_secs(pid) for pid in self.pids}
        self.snaps.append((read_sockets(), cpu, moved))


def _steps_per_epoch(f, model_name):
    if f.steps_per_epoch:
        return f.steps_per_epoch
    return (_QUICK_STEPS_PER_EPOCH if f.quick else _STEPS_PER_EPOCH)[model_name]


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


def _run(local, data, model_name, n, f) -> Row:
    """Trains one configuration on a fresh strategy; returns its row."""
    import statistics

    import models
    from tf_distbelief import downpour, job, training
    from tf_distbelief import strategy as strategy_lib

    steps = _steps_per_epoch(f, model_name)
    config = job.JobConfig(
        learning_rate=f.learning_rate or _LEARNING_RATE[model_name],
        batch_size=f.batch_size,
        steps_per_execution=f.steps_per_execution,
        num_ps=local.num_ps,
        downpour=None
        if n is None
        else downpour.DownpourConfig(
            n_fetch=n,
            n_push=n,
            local_learning_rate=f.local_learning_rate,
            local_optimizer=f.local_optimizer,
            adagrad_accumulator=f.adagrad_accumulator,
        ),
    ).validate()
    spec = models.spec(
        model_name,
        speech_hidden_units=f.speech_hidden_units,
        speech_classes=_speech_classes(f),
    )
    (x_train, y_train), (x_test, y_test) = data
    start = time.monotonic()
    strategy = strategy_lib.DistBeliefStrategy(
        local.resolver_for(),
        job.make_partitioner(config.partitioner, local.num_ps, config.shard_bytes),
    )
    model = job.compile_model(config, strategy, spec)
    # Kept until exit: a collected model's functions are removed from the
    # tasks, which the reconnected context no longer knows (noisy errors).
    _KEEP_ALIVE.append(model)
    replicas = getattr(model, "downpour", None)
    roles = {os.getpid(): "chief"}
    roles.update({p.pid: kind for (kind, _), p in local.processes.items()})
    probe = _Probe(
        replicas,
        list(roles),
        (lambda: training.accuracy(model, x_test, y_test)) if f.curves else None,
    )
    training.fit(
        model,
        training.dataset_creator(x_train, y_train, config.batch_size, config.seed),
        epochs=1 + f.timed_epochs,
        steps_per_epoch=steps,
        batch_size=config.batch_size,
        callbacks=[probe.callback],
        print_fn=lambda *_: None,
    )
    (before, cpu0, moved0), (after, cpu1, moved1) = probe.snaps
    timed_steps = f.timed_epochs * steps
    examples = timed_steps * config.batch_size
    pids = {
        role: [p for p, r in roles.items() if r == role] for role in set(roles.values())
    }
    ps_ports = {
        int(address.rpartition(":")[2]): local.processes[("ps", i)].pid
        for i, address in enumerate(local.jobs["ps"])
    }
    socket_bytes = link_bytes(before, after, pids["worker"], pids["ps"], ps_ports).total
    if replicas is None:
        # Stock training reads every parameter and sends every gradient once
        # per step.
        model_bytes = sum(
            v.shape.num_elements() * v.dtype.size for v in model.trainable_variables
        )
        tensor_bytes = 2 * model_bytes * timed_steps
    else:
        tensor_bytes = moved1 - moved0
    cpu_ms = {
        role: sum(cpu1[p] - cpu0[p] - probe.eval_cpu[p] for p in role_pids)
        * 1e3
        / timed_steps
        for role, role_pids in pids.items()
    }
    rate = statistics.median(steps * config.batch_size / s for s in probe.epoch_secs)
    return Row(
        model=model_name,
        name="stock" if n is None else f"n={n}",
        examples_per_sec=rate,
        socket_bytes_per_example=socket_bytes / examples,
        tensor_bytes_per_example=tensor_bytes / examples,
        cpu_ms_per_step=cpu_ms,
        test_accuracy=training.accuracy(model, x_test, y_test),
        test_loss=_test_loss(model, x_test, y_test),
        wall_secs=time.monotonic() - start,
        curve=probe.curve,
    )


def median_rows(rows: list[Row]) -> list[Row]:
    """One row per `(model, name)`, in first-seen order: medians over rounds.

    `speedup` is the median over rounds of each round's examples/s over that
    round's stock examples/s (the i-th row of a configuration is round i): the
    two ran side by side, so a load change between rounds cancels out.
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
            )
        )
    return result


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
    ns = [int(n) for n in f.n]
    rows = []
    round_rows = []
    data = {m: _load_data(m, f) for m in f.models}
    with cluster.LocalCluster(num_workers=2, num_ps=f.num_ps) as local:
        # Rounds interleave the configurations, so that a change in the load
        # of the machine spreads over all of them.
        for round_index in range(f.repeats):
            for model_name in f.models:
                for n in [None, *ns]:
                    r = _run(local, data[model_name], model_name, n, f)
                    rows.append(r)
                    round_rows.append((round_index, r))
                    print(
                        f"round {round_index + 1}/{f.repeats} {r.model} {r.name}: "
                        f"{r.examples_per_sec:.0f} ex/s, {r.wall_secs:.0f} s",
                        flush=True,
                    )
        rows = median_rows(rows)
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        epochs = ", ".join(f"{m} {_steps_per_epoch(f, m)}" for m in f.models)
        header = (
            f"cores={os.cpu_count()} load={load} workers=2 ps={f.num_ps} "
            f"batch={f.batch_size} steps_per_execution={f.steps_per_execution} "
            f"epochs=1+{f.timed_epochs} of ({epochs}) steps "
            f"medians of {f.repeats} rounds lr="
            + ",".join(f"{m}:{f.learning_rate or _LEARNING_RATE[m]}" for m in f.models)
            + " "
            f"speech=440-{f.speech_hidden_units}x4-{_speech_classes(f)}"
        )
        print(format_table(rows, header))
        if f.cpu_breakdown:
            for r in rows:
                cpu = " ".join(
                    f"{k}={v:.1f}" for k, v in sorted(r.cpu_ms_per_step.items())
                )
                print(f"{r.model} {r.name}: CPU ms/step {cpu}")
        if f.out_dir:
            for path in downpour_figures.write_outputs(
                f.out_dir, rows, round_rows, header, f.target_accuracy
            ):
                print(f"wrote {path}", flush=True)
        # TensorFlow's teardown would contact the ended tasks (see `job.main`).
        sys.stdout.flush()
        local.stop()
        os._exit(0)


if __name__ == "__main__":
    define_flags()
    app.run(main)
