r"""Step time of model-parallel replicas with 1, 2 and 4 partitions.

Dean et al. 2012, section 3 and Figure 3: a locally connected model gains from
being split over many machines, a fully connected speech model much less. This
benchmark times one training step (forward, backward and a plain SGD update, in a
`tf.function`) of two models, split over 1, 2 and 4 logical CPU devices:

* `lc`: two wide locally connected layers (`PartitionedLocallyConnected2D`, output
  rows split into blocks). The first gives its output as blocks
  (`output_blocks=True`) and the second takes them, so the activations between them
  stay partitioned, as in the paper: only the halo crosses.
* `mlp`: the speech model's shape: 440 inputs (11 frames of 40 filter banks), 4
  sigmoid hidden layers, softmax (`PartitionedDense`, units split).

Each (set-up, partition count) runs in its own child process, since TensorFlow fixes
its threads and devices when it initialises:

* `scaling`: every partition gets one core's worth of threads. All CPU devices of a
  process share one intra-op pool, so the child sets `intra_op_parallelism_threads=1`
  (each op runs single-threaded) and `inter_op_parallelism_threads=P` (up to P ops,
  one per partition, run at once). The baseline is 1 partition with 1 thread of each:
  one core. This is the paper's set-up (one machine per partition), scaled down;
  with fewer cores than partitions the speed-up is capped at the number of cores.
* `overhead`: TensorFlow's default threads (all cores) for every partition count.
  Partitioning then brings no extra compute; the ratio shows its cost.

On a shared, noisy machine a single timing says little, so all children are started
first, build and warm up their models, and then wait; the parent asks them in turn
(1, 2, 4 partitions of both set-ups, for each model; then again) for `--repeats`
timings of `--steps` steps each, so that load changes hit every configuration
alike. A timing is the median step time of its steps; the table shows the median
over repeats and, in brackets, the spread (max - min) of the repeats as a share of
the median.

Bytes per step are forward plus backward, from `partition_math`, in two columns:
`needed` is what a DistBelief network whose layers stay partitioned would move (for
locally connected layers the halo: into the first layer's blocks from the input
regions the others own, and between the layers from the first layer's output blocks,
`cross_partition_bytes`; for dense layers each partition's copy of the input it does
not hold); `moved` adds what the models move because a layer takes its input whole
on the replica's default device or concatenates its output there: for `lc` the
scatter of the input to the first layer's blocks and the gather of the second
layer's output (`scatter_gather_bytes`), for `mlp` the gather of every layer's
output.

With `--out_dir` (default `benchmarks/results/`) it also writes the timings as
`model_parallel.csv` and the speed-up against the partition count as
`model_parallel_speedup.png` (`benchmarks/plots.py`).

Usage:
  python benchmarks/model_parallel_bench.py  # About 4 minutes on 2 idle cores.
  python benchmarks/model_parallel_bench.py --steps=2 --repeats=2  # quick
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import plots  # noqa: E402

_PARTITIONS = (1, 2, 4)
_MODELS = ("lc", "mlp")
# Flags a child needs from the parent's command line.
_SHARED_FLAGS = (
    "steps",
    "warmup_steps",
    "batch_size",
    "lc_size",
    "lc_channels",
    "lc_filters",
    "mlp_width",
    "mlp_classes",
)
_SPEECH_INPUTS = 440  # 11 frames x 40 log filter-bank energies (section 5).


def define_flags():
    flags.DEFINE_integer("steps", 4, "Timed steps per timing.", lower_bound=1)
    flags.DEFINE_integer(
        "repeats", 5, "Interleaved timings per configuration.", lower_bound=1
    )
    flags.DEFINE_integer("warmup_steps", 2, "Untimed steps first.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
    flags.DEFINE_integer(
        "lc_size", 40, "Rows and columns of the lc input.", lower_bound=9
    )
    flags.DEFINE_integer("lc_channels", 8, "Channels of the lc input.", lower_bound=1)
    flags.DEFINE_integer("lc_filters", 32, "Filters of each lc layer.", lower_bound=1)
    flags.DEFINE_integer(
        "mlp_width", 1024, "Hidden units (paper: 2560).", lower_bound=4
    )
    flags.DEFINE_integer(
        "mlp_classes", 8192, "Softmax classes (paper: 8192).", lower_bound=4
    )
    flags.DEFINE_string(
        "out_dir", plots.DEFAULT_OUT_DIR, "CSV and PNG output folder ('' for none)."
    )
    # Internal: set by the parent for its children.
    flags.DEFINE_enum("setup", None, ["scaling", "overhead"], "Child: set-up to run.")
    flags.DEFINE_integer("child_partitions", 0, "Child: scaling partition count.")


def _build(model, num_partitions, batch_size):
    """Returns `(step_fn, inputs, {"needed": bytes, "moved": bytes} per step)`."""
    import tensorflow as tf

    from tf_distbelief.model_parallel import dense as partitioned_dense
    from tf_distbelief.model_parallel import (
        locally_connected as partitioned_locally_connected,
    )
    from tf_distbelief.model_parallel import partition_math

    f = flags.FLAGS
    if model == "lc":
        x = tf.random.stateless_normal(
            [batch_size, f.lc_size, f.lc_size, f.lc_channels], seed=[1, 2]
        )
        layers = [
            partitioned_locally_connected.PartitionedLocallyConnected2D(
                f.lc_filters,
                5,
                num_partitions=num_partitions,
                activation="relu",
                output_blocks=True,  # Blocks stay on their devices for the next.
            ),
            partitioned_locally_connected.PartitionedLocallyConnected2D(
                f.lc_filters, 5, num_partitions=num_partitions
            ),
        ]

        def loss_fn(y):
            return tf.reduce_mean(tf.square(y))

    else:
        x = tf.random.stateless_normal([batch_size, _SPEECH_INPUTS], seed=[1, 2])
        labels = tf.random.stateless_uniform(
            [batch_size], [1, 3], maxval=f.mlp_classes, dtype=tf.int32
        )
        layers = [
            partitioned_dense.PartitionedDense(
                f.mlp_width, num_partitions, activation="sigmoid"
            )
            for _ in range(4)
        ] + [partitioned_dense.PartitionedDense(f.mlp_classes, num_partitions)]

        def loss_fn(logits):  # The softmax is in the loss.
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            )

    h = x
    for layer in layers:
        h = layer(h)
    variables = [v for layer in layers for v in layer.trainable_weights]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for layer in layers:
                h = layer(h)
            loss = loss_fn(h)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.01 * g)  # Runs where `v` lives.
        return loss

    # Forward and backward move the same bytes. The layers were called above, so
    # each knows whether its input came whole or as blocks.
    needed = 2 * sum(layer.cross_partition_bytes(batch_size) for layer in layers)
    whole_io = 0
    for layer in layers:
        if model == "lc":
            whole_io += layer.scatter_gather_bytes(batch_size)
        else:
            whole_io += partition_math.dense_gather_bytes(
                batch_size, layer.units, num_partitions
            )
    return step, x, {"needed": needed, "moved": needed + 2 * whole_io}


def _time_step(step, x, num_steps):
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _child(setup, partitions):
    """Runs in a fresh process: builds, warms up, then times on request.

    Prints one JSON line when ready (bytes per model), then reads model names from
    stdin, one per line, and answers each with one JSON line (median step secs).
    """
    import tensorflow as tf

    from tf_distbelief.model_parallel import devices as model_parallel

    f = flags.FLAGS
    model_parallel.configure_logical_cpus(max(_PARTITIONS))
    if setup == "scaling":
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(partitions)
    built = {m: _build(m, partitions, f.batch_size) for m in _MODELS}
    for step, x, _ in built.values():
        _time_step(step, x, f.warmup_steps)
    print(json.dumps({m: b[2] for m, b in built.items()}), flush=True)
    for line in sys.stdin:
        step, x, _ = built[line.strip()]
        print(json.dumps(_time_step(step, x, f.steps)), flush=True)


def _start_child(argv, setup, partitions):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # `app.run` strips flags from `argv`; pass the parsed values on explicitly.
    passed = [f"--{name}={flags.FLAGS[name].value}" for name in _SHARED_FLAGS]
    command = [sys.executable, os.path.abspath(__file__), *argv[1:], *passed]
    command += [f"--setup={setup}", f"--child_partitions={partitions}"]
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _ask(child, request=None):
    if request is not None:
        child.stdin.write(request + "\n")
        child.stdin.flush()
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"Benchmark child {child.args[-2:]} exited early.")
    return json.loads(line)


def main(argv):
    f = flags.FLAGS
    if f.setup:
        _child(f.setup, f.child_partitions)
        return
    start = time.monotonic()
    configs = [(s, p) for s in ("scaling", "overhead") for p in _PARTITIONS]
    children, nbytes = {}, {}  # nbytes: (model, partitions) -> bytes per step.
    try:
        # One at a time: building and warming up is not timed, but it is quicker
        # without the others competing.
        for setup, p in configs:
            children[(setup, p)] = _start_child(argv, setup, p)
            for model, b in _ask(children[(setup, p)]).items():
                nbytes[(model, p)] = b
        secs = {(m, *c): [] for m in _MODELS for c in configs}
        for _ in range(f.repeats):
            for model in _MODELS:
                for config, child in children.items():
                    secs[(model, *config)].append(_ask(child, model))
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait()
    _print_table(secs, nbytes, start)
    if f.out_dir:
        _write_outputs(f.out_dir, secs, nbytes)


def _write_outputs(out_dir, secs, nbytes):
    """`model_parallel.csv` and the speed-up figure (section 3, Figure 3's form)."""
    rows, series = [], {}
    for model in _MODELS:
        for setup in ("scaling", "overhead"):
            base = float(np.median(secs[(model, setup, 1)]))
            speedups = []
            for p in _PARTITIONS:
                times = secs[(model, setup, p)]
                median = float(np.median(times))
                speedups.append(base / median)
                rows.append(
                    [
                        model,
                        setup,
                        p,
                        median * 1e3,
                        (max(times) - min(times)) / median,
                        base / median,
                        nbytes[(model, p)]["needed"],
                        nbytes[(model, p)]["moved"],
                    ]
                )
            series[f"{model}, {setup}"] = (list(_PARTITIONS), speedups)
    plots.write_csv(
        os.path.join(out_dir, "model_parallel.csv"),
        [
            "model",
            "setup",
            "partitions",
            "step_ms",
            "spread",
            "speedup",
            "needed_bytes",
            "moved_bytes",
        ],
        rows,
    )
    series["ideal"] = (list(_PARTITIONS), [float(p) for p in _PARTITIONS])
    path = plots.line_plot(
        os.path.join(out_dir, "model_parallel_speedup.png"),
        series,
        title="Model parallelism: step speed-up over 1 partition (section 3)",
        xlabel="partitions (devices of one replica: GPUs if any, else logical CPUs)",
        ylabel="speed-up (median step time ratio)",
        note=plots.machine_note(),
        xticks=_PARTITIONS,
    )
    print(f"wrote {path}", flush=True)


def _print_table(secs, nbytes, start):
    f = flags.FLAGS
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"cores={os.cpu_count()} load={load} batch={f.batch_size}; "
        f"lc=2x LocallyConnected2D(5x5, {f.lc_filters}) on "
        f"{f.lc_size}x{f.lc_size}x{f.lc_channels}; "
        f"mlp=440-{f.mlp_width}x4-{f.mlp_classes}; median of {f.repeats} "
        f"interleaved timings of {f.steps} steps; {time.monotonic() - start:.0f} s"
    )
    print(
        f"{'model':5} {'parts':>5} {'needed MB':>9} {'moved MB':>8}"
        f" {'scaling ms (spread)':>20} {'speed-up':>8}"
        f" {'overhead ms (spread)':>21} {'speed-up':>8}"
    )
    for model in _MODELS:
        base = {s: np.median(secs[(model, s, 1)]) for s in ("scaling", "overhead")}
        for p in _PARTITIONS:
            b = nbytes[(model, p)]
            cells = []
            for setup in ("scaling", "overhead"):
                times = secs[(model, setup, p)]
                median = float(np.median(times))
                spread = (max(times) - min(times)) / median
                cells.append(
                    f"{median * 1e3:10.1f} ({spread:5.0%}) {base[setup] / median:8.2f}"
                )
            print(
                f"{model:5} {p:5d} {b['needed'] / 1e6:9.2f}"
                f" {b['moved'] / 1e6:8.2f} {cells[0]:>29} {cells[1]:>30}"
            )


if __name__ == "__main__":
    define_flags()
    app.run(main)
