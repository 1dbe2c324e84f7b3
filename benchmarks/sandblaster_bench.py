r"""Sandblaster L-BFGS: backup tasks against a straggler, and L-BFGS-B for scale.

Dean et al. 2012, section 4.2: cutting a batch into many portions lets fast
replicas do more of it, and backup tasks stop one slow replica from holding up
the end of the batch. This benchmark starts its own `LocalCluster` (as many
workers as the largest count it uses, 2 ps) and prints three tables:

* where one no-straggler evaluation's time goes (`sandblaster_phases`: the
  copy of x, scheduling, waiting for the workers, the reduction of the
  accepted gradient slots, the coordinator's own Python), with a parameter
  fetch and no-op portions timed alone;
* batch time (one objective evaluation: the whole training set, `--portions`
  portions) with no straggler, then with worker 1 made `--slowdown` times
  slower (each of its portions sleeps `(slowdown - 1) x` its compute time,
  `benchmarks.stragglers.slow_worker` passed as `portion_delay_fn`), without and
  with backup tasks, as ratios to the no-straggler time (median of
  `--batches` batches after one warm-up), `--straggler_runs` times for each
  worker count of `--straggler_workers`. With W workers a 5x straggler leaves
  `W - 1 + 1/5` workers' throughput: backup tasks can remove the wait for its
  last portion, not that loss, so the best ratio is about `W / (W - 0.8)`
  (1.67x for 2 workers, 1.25x for 4) unless the workers share cores;
* iterations, evaluations and wall time to a fixed loss for Sandblaster,
  one run per `WORKERSxPORTIONS` entry of `--target_runs`, and for SciPy's
  L-BFGS-B in this one process on the same objective (the same model,
  evaluated by one `tf.function` over the whole batch). The target is the
  loss SciPy reaches after `--target_iters` iterations. Each optimizer's
  first evaluation, which traces (and for Sandblaster sends the portion
  function to the workers), is made before its clock starts and reported
  apart.

Every task, the coordinator included, runs with one intra-op thread
(`TF_NUM_INTRAOP_THREADS=1`), so a worker is one core, like one of the paper's
machines, and SciPy gets one core too.

The problem: a tanh MLP (`--features` -> `--hidden` -> 10, float32) on
`--examples` synthetic examples labelled by a random teacher network.

With several `--num_workers` or `--num_ps` counts (lists; the tables above
use the first of each), or `--scaling_only` (that table alone), a fourth
table: `--scaling_iters` L-BFGS iterations (backup tasks on, one evaluation
off the clock first) on each worker count, on a cluster of each ps count,
without and (2 workers or more) with the last worker `--slowdown` times
slower: seconds per iteration and the speed-up over the fewest workers,
evaluations, the coordinator's round trips to the ps (its vector operations
and copies of x) and functions scheduled on the workers (portions and backup
copies) per iteration, and its process CPU milliseconds per iteration;
written to `sandblaster_scaling.csv`.

`--phases_only` prints only the first table. The L-BFGS runs use `--two_loop`
(vector-free by default) and report the round trips to the ps their vector
work made per iteration.

With `--out_dir` (default `benchmarks/results/`) it also writes
`sandblaster.csv` (the last table), `sandblaster_stragglers.csv`,
`sandblaster_loss.csv` (loss against time of
both optimizers), `sandblaster_batch.png` (batch seconds with and without the
straggler, without and with backup tasks) and `sandblaster_loss.png` (training
loss against wall-clock seconds, the paper's Figure 4 form, with the target).

Usage:
  python benchmarks/sandblaster_bench.py --portions=32 --slowdown=5
  python benchmarks/sandblaster_bench.py --examples=8192 --hidden=256 \
      --batches=2 --target_iters=20 --max_iters=30   # quick
  python benchmarks/sandblaster_bench.py --scaling_only --num_workers=1,2,4,8 \
      --num_ps=2
"""

import os
import sys

# Before TensorFlow starts, and inherited by the cluster's child processes.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The repository root, for `benchmarks.stragglers` and `tf_distbelief`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools
import time

import numpy as np
import scipy.optimize
from absl import app, flags

from benchmarks import cluster_counts, plots, sandblaster_phases
from tf_distbelief import console


def define_flags():
    flags.DEFINE_integer("examples", 32768, "Training examples.", lower_bound=64)
    flags.DEFINE_integer("features", 256, "Input features.", lower_bound=1)
    flags.DEFINE_integer("hidden", 1024, "Hidden units.", lower_bound=1)
    flags.DEFINE_integer("portions", 16, "Work portions per batch.", lower_bound=1)
    flags.DEFINE_float("slowdown", 5.0, "Straggler slowdown factor.", lower_bound=1)
    flags.DEFINE_integer("batches", 4, "Timed batches per setting.", lower_bound=1)
    flags.DEFINE_integer(
        "straggler_runs", 3, "Runs of the three straggler settings.", lower_bound=1
    )
    flags.DEFINE_list(
        "straggler_workers",
        ["2", "4"],
        "Worker counts of the straggler runs (worker 1 is the straggler).",
    )
    flags.DEFINE_integer(
        "target_iters",
        25,
        "SciPy iterations that define the target loss.",
        lower_bound=1,
    )
    flags.DEFINE_integer("max_iters", 60, "Most Sandblaster iterations.", lower_bound=1)
    flags.DEFINE_list(
        "num_workers",
        ["2"],
        "Worker counts: the first is the tables' (phases, batch figure); with "
        "several (or --scaling_only) the scaling table runs L-BFGS on each.",
    )
    flags.register_validator("num_workers", cluster_counts.check_counts("num_workers"))
    flags.DEFINE_list(
        "target_runs",
        ["2x16", "2x4", "2x2", "1x4", "1x2", "1x1"],
        "Sandblaster runs to SciPy's target loss, each WORKERSxPORTIONS (each "
        "portion costs a scheduled function's round trip, so fewer portions "
        "trade straggler tolerance for speed).",
    )
    flags.register_validator("target_runs", _check_target_runs)
    flags.DEFINE_list(
        "num_ps",
        ["2"],
        "Parameter-server task counts: the first is the tables'; the scaling "
        "table runs on a cluster of each.",
    )
    flags.register_validator("num_ps", cluster_counts.check_counts("num_ps"))
    flags.DEFINE_integer(
        "scaling_iters",
        10,
        "L-BFGS iterations of each scaling run (after one evaluation off the clock).",
        lower_bound=1,
    )
    flags.DEFINE_bool(
        "scaling_only",
        False,
        "Print only the scaling table (every --num_workers and --num_ps count).",
    )
    flags.DEFINE_integer("seed", 0, "Data and initialisation seed.")
    flags.DEFINE_enum(
        "two_loop",
        "vector_free",
        ["vector_free", "vectors"],
        "L-BFGS two-loop recursion: vector-free (Chen et al. 2014) or on vectors.",
    )
    flags.DEFINE_bool("phases_only", False, "Print only the phases of one evaluation.")
    flags.DEFINE_string(
        "out_dir", plots.DEFAULT_OUT_DIR, "CSV and PNG output folder ('' for none)."
    )


FLAGS = flags.FLAGS


def make_data(examples, features, seed):
    """`x`: `[examples, features]` float32; `y`: labels of a random teacher MLP."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, features)).astype(np.float32)
    teacher = rng.normal(size=(features, 64)) / np.sqrt(features)
    logits = np.tanh(x @ teacher) @ rng.normal(size=(64, 10))
    return x, np.argmax(logits + rng.gumbel(size=logits.shape), axis=1)


def build_model(features, hidden, seed):
    import tf_keras

    init = tf_keras.initializers.GlorotUniform
    return tf_keras.Sequential(
        [
            tf_keras.layers.InputLayer(input_shape=(features,)),
            tf_keras.layers.Dense(hidden, "tanh", kernel_initializer=init(seed)),
            tf_keras.layers.Dense(10, kernel_initializer=init(seed + 1)),
        ]
    )


def batch_secs(objective, x_vector, batches):
    objective(x_vector)  # Warm-up: registers the function on the workers.
    start = len(objective.stats.evaluation_secs)
    for _ in range(batches):
        objective(x_vector)
    return float(np.median(objective.stats.evaluation_secs[start:]))


def scipy_run(model, loss_fn, x, y, target_iters):
    """L-BFGS-B in this process.

    Returns:
      `(loss per iteration, secs per iteration, evaluations, secs of the
      first evaluation, which traces the function, off the clock)`.
    """
    import tensorflow as tf

    from tf_distbelief.sandblaster import flat_params

    layout = flat_params.FlatLayout(model)

    @tf.function
    def fun_and_grad(params):
        with tf.GradientTape() as tape:
            tape.watch(params)
            with flat_params.evaluate_at(layout, params):
                per_example = loss_fn(y, model(x, training=False))
                loss = tf.reduce_mean(tf.cast(per_example, tf.float64))
        return loss, tape.gradient(loss, params)

    def numpy_fun(w):
        loss, grad = fun_and_grad(tf.constant(w))
        return float(loss), grad.numpy()

    x0 = layout.read()
    first = time.monotonic()
    numpy_fun(x0)  # Trace outside the timing.
    first = time.monotonic() - first
    losses, times = [numpy_fun(x0)[0]], [0.0]
    start = time.monotonic()

    def callback(intermediate_result):
        losses.append(float(intermediate_result.fun))
        times.append(time.monotonic() - start)

    result = scipy.optimize.minimize(
        numpy_fun,
        x0,
        jac=True,
        method="L-BFGS-B",
        callback=callback,
        options={"maxiter": target_iters, "gtol": 0.0, "ftol": 0.0},
    )
    return losses, times, result.nfev, first


def first_at_or_below(values, target):
    return next((i for i, v in enumerate(values) if v <= target), None)


def _straggler_runs(make_objective, runs, batches, workers):
    """Rows of batch seconds: no straggler, then a straggler without/with backups.

    Returns:
      `(rows, batch_times)`: a row per run (`[run, secs, ratio, ratio,
      backups]`), and `(setting, secs)` of the last run for the figure.
    """
    from benchmarks import stragglers

    straggler = stragglers.slow_worker(1, straggler_slowdown=FLAGS.slowdown)
    settings = [
        ("no straggler, backup tasks", {"backup_tasks": True}),
        (
            f"worker 1 {FLAGS.slowdown:g}x slower, no backup tasks",
            {"backup_tasks": False, "portion_delay_fn": straggler},
        ),
        (
            f"worker 1 {FLAGS.slowdown:g}x slower, backup tasks",
            {"backup_tasks": True, "portion_delay_fn": straggler},
        ),
    ]
    rows = []
    for run in range(1, runs + 1):
        secs, backups, batch_times = [], "", []
        for name, kwargs in settings:
            obj = make_objective(**kwargs)
            x_vector = obj.ops.from_numpy(obj.layout.read())
            secs.append(batch_secs(obj, x_vector, batches))
            obj.join()
            if kwargs.get("portion_delay_fn") and kwargs["backup_tasks"]:
                s = obj.stats
                backups = f"{s.backup_copies_scheduled / s.evaluations:.1f}"
            batch_times.append((name, secs[-1]))
            obj.close()
        rows.append(
            [
                str(workers),
                str(run),
                f"{secs[0]:.3f}",
                f"{secs[1] / secs[0]:.2f}x",
                f"{secs[2] / secs[0]:.2f}x",
                backups,
            ]
        )
        print(f"straggler run {run}: {rows[-1]}", flush=True)
    return rows, batch_times


def _sandblaster_to_target(make_objective, target, workers, portions):
    """Runs Sandblaster L-BFGS; returns `(row values, (secs, losses) curve)`.

    One evaluation at the start point comes first, off the clock, as SciPy's
    (`scipy_run` traces its function by evaluating it once): the first
    evaluation sends the portion function, with the training set in it, to
    every worker. Its seconds are reported apart.
    """
    from tf_distbelief.sandblaster import lbfgs

    obj = make_objective(portions=portions, backup_tasks=True)
    x0 = obj.ops.from_numpy(obj.layout.read())
    cold = time.monotonic()
    obj(x0)
    cold = time.monotonic() - cold
    obj.stats.evaluation_secs.clear()
    eval_log = []
    start = time.monotonic()

    def logged(vector):
        loss, grad = obj(vector)
        eval_log.append((time.monotonic() - start, loss))
        return loss, grad

    obj.ops.round_trips.clear()
    result = lbfgs.minimize(
        logged,
        x0,
        obj.ops,
        m=10,
        max_iters=FLAGS.max_iters,
        gtol=0.0,
        ftol=0.0,
        two_loop=FLAGS.two_loop,
    )
    # The objective's own copy of x (one `assign` per evaluation) is
    # evaluation work, not the L-BFGS vector work.
    vector_trips = sum(obj.ops.round_trips.values()) - result.num_evals
    iters = first_at_or_below(result.loss_history, target)
    evals = first_at_or_below([loss for _, loss in eval_log], target)
    secs = eval_log[evals][0] if evals is not None else float("nan")
    obj.close()
    row = {
        "run": f"Sandblaster L-BFGS, {workers} worker{'s' * (workers > 1)}, "
        f"{portions} portions ({FLAGS.two_loop}, "
        f"{vector_trips / max(result.num_iters, 1):.1f} ps round trips/iter)",
        "iters": iters,
        "evals": None if evals is None else evals + 1,
        "secs_per_eval": float(np.median(obj.stats.evaluation_secs)),
        "secs": secs,
        "first_eval_secs": cold,
    }
    curve = ([t for t, _ in eval_log], [loss for _, loss in eval_log])
    return row, curve


def _scaling_run(make_objective, workers, ps, slowdown=None):
    """`--scaling_iters` L-BFGS iterations on `workers` workers; returns a row.

    One evaluation at the start point comes first, off the clock (it sends the
    portion function to the workers). With `slowdown`, the last worker is
    that many times slower (`stragglers.slow_worker`); backup tasks are on.

    Returns:
      `{"workers", "ps", "straggler", "secs_per_iter", "evals_per_iter",
      "ps_trips_per_iter", "functions_per_iter", "cpu_ms_per_iter", "loss"}`:
      the coordinator's round trips to the ps (vector operations and the
      copy of x, `ps_vectors` counts them) and functions scheduled on the
      workers (portions and backup copies), and its process CPU, per
      iteration.
    """
    from benchmarks import stragglers
    from tf_distbelief.sandblaster import lbfgs

    kwargs = {"backup_tasks": True}
    if slowdown is not None:
        kwargs["portion_delay_fn"] = stragglers.slow_worker(
            workers - 1, straggler_slowdown=slowdown
        )
    obj = make_objective(**kwargs)
    x0 = obj.ops.from_numpy(obj.layout.read())
    obj(x0)
    stats = obj.stats
    functions = stats.portions_scheduled + stats.backup_copies_scheduled
    obj.ops.round_trips.clear()
    cpu, start = time.process_time(), time.monotonic()
    result = lbfgs.minimize(
        obj,
        x0,
        obj.ops,
        m=10,
        max_iters=FLAGS.scaling_iters,
        gtol=0.0,
        ftol=0.0,
        two_loop=FLAGS.two_loop,
    )
    secs, cpu = time.monotonic() - start, time.process_time() - cpu
    functions = stats.portions_scheduled + stats.backup_copies_scheduled - functions
    trips = sum(obj.ops.round_trips.values())
    obj.close()
    iters = max(result.num_iters, 1)
    return {
        "workers": workers,
        "ps": ps,
        "straggler": slowdown,
        "secs_per_iter": secs / iters,
        "evals_per_iter": result.num_evals / iters,
        "ps_trips_per_iter": trips / iters,
        "functions_per_iter": functions / iters,
        "cpu_ms_per_iter": 1e3 * cpu / iters,
        "loss": result.loss_history[-1],
    }


def _scaling_table(runs):
    """Header and cells of the scaling runs (`_scaling_run`'s rows).

    `x fewest`: seconds per iteration of the no-straggler run at the fewest
    workers of the same ps count over this run's (a speed-up);
    `x no straggler`: this run's seconds per iteration over the no-straggler
    run's of the same worker and ps count ("-" for that run itself).
    """
    header = [
        "ps",
        "workers",
        "straggler",
        "secs/iter",
        "x fewest",
        "x no straggler",
        "evals/iter",
        "ps round trips/iter",
        "functions/iter",
        "chief CPU ms/iter",
        "loss",
    ]
    plain = {(r["ps"], r["workers"]): r for r in runs if r["straggler"] is None}
    rows = []
    for r in runs:
        fewest = min((w for p, w in plain if p == r["ps"]), default=None)
        base = plain.get((r["ps"], fewest))
        same = plain.get((r["ps"], r["workers"]))
        slowed = r["straggler"] is not None
        rows.append(
            [
                str(r["ps"]),
                str(r["workers"]),
                f"last {r['straggler']:g}x slower" if slowed else "-",
                f"{r['secs_per_iter']:.3f}",
                "-"
                if base is None
                else f"{base['secs_per_iter'] / r['secs_per_iter']:.2f}",
                f"{r['secs_per_iter'] / same['secs_per_iter']:.2f}"
                if slowed and same
                else "-",
                f"{r['evals_per_iter']:.2f}",
                f"{r['ps_trips_per_iter']:.1f}",
                f"{r['functions_per_iter']:.1f}",
                f"{r['cpu_ms_per_iter']:.0f}",
                f"{r['loss']:.4g}",
            ]
        )
    return header, rows


def _parse_target_runs(runs: list[str]) -> list[tuple[int, int]]:
    """`--target_runs` as `(workers, portions)` pairs, both >= 1.

    Raises:
      ValueError: `runs` is empty, or an entry is not `WORKERSxPORTIONS` of
        positive integers.
    """
    if not runs:
        raise ValueError("--target_runs needs at least one WORKERSxPORTIONS entry")
    parsed = []
    for run in runs:
        try:
            workers, portions = (int(n) for n in run.lower().split("x"))
        except ValueError:
            workers = portions = 0
        if workers < 1 or portions < 1:
            raise ValueError(
                "--target_runs takes WORKERSxPORTIONS entries of positive "
                f"integers, e.g. 2x16,1x4. Received: {run!r}"
            )
        parsed.append((workers, portions))
    return parsed


def _check_target_runs(runs: list[str]) -> bool:
    """absl validator: refuses a bad `--target_runs` when the flags are parsed."""
    try:
        _parse_target_runs(runs)
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


def main(argv):
    del argv
    import tf_keras

    from tf_distbelief import cluster

    x, y = make_data(FLAGS.examples, FLAGS.features, FLAGS.seed)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    straggler_workers = [int(w) for w in FLAGS.straggler_workers]
    if min(straggler_workers, default=2) < 2:
        raise app.UsageError(
            "--straggler_workers must list counts >= 2 (worker 1 is the "
            f"straggler). Received: {FLAGS.straggler_workers}"
        )
    target_runs = _parse_target_runs(FLAGS.target_runs)
    workers_list, ps_list = (
        cluster_counts.counts(FLAGS.num_workers),
        cluster_counts.counts(FLAGS.num_ps),
    )
    num_workers, num_ps = workers_list[0], ps_list[0]
    if FLAGS.scaling_only or len(workers_list) > 1 or len(ps_list) > 1:
        # Last, or alone: each ps count on a cluster of its own.
        scaling = functools.partial(_scaling, workers_list, ps_list, x, y, loss_fn)
    else:
        scaling = None
    if FLAGS.scaling_only:
        scaling()
        return
    most = max([num_workers, *straggler_workers, *(w for w, _ in target_runs)])
    with cluster.LocalCluster(most, num_ps) as local:
        objective_on = _objective_factory(local, x, y, loss_fn)
        make_objective = objective_on(num_workers)
        obj = make_objective(backup_tasks=True)
        x_vector = obj.ops.from_numpy(obj.layout.read())
        batch_secs(obj, x_vector, 1)
        _print_table(
            f"One evaluation, no straggler ({FLAGS.examples} examples, "
            f"{FLAGS.portions} portions, {num_workers} workers, "
            f"{num_ps} ps; mean of {FLAGS.batches}):",
            ["phase", "secs per evaluation", "share"],
            sandblaster_phases.evaluation_phases(obj, x_vector, FLAGS.batches),
        )
        obj.close()
        whole = make_objective(portions=1, backup_tasks=False)
        one, together = sandblaster_phases.parallel_capacity(whole, FLAGS.batches)
        whole.close()
        capacity = num_workers * one / together
        print(
            f"\nThese cores: one whole-batch evaluation on one worker {one:.3f} s; "
            f"{num_workers} at once, one per worker, {together:.3f} s: "
            f"{num_workers} workers give {capacity:.2f}x one worker's "
            f"throughput, so an evaluation on them takes at least "
            f"{1 / capacity:.2f}x one worker's time (median of {FLAGS.batches}).",
            flush=True,
        )
        if FLAGS.phases_only:
            return
        straggler_rows, batch_times = [], []
        for workers in straggler_workers:
            rows, times = _straggler_runs(
                objective_on(workers), FLAGS.straggler_runs, FLAGS.batches, workers
            )
            straggler_rows += rows
            if workers == num_workers or not batch_times:
                batch_times = times

        # Convergence: SciPy first (it defines the target), then Sandblaster.
        model = build_model(FLAGS.features, FLAGS.hidden, FLAGS.seed)
        scipy_losses, scipy_secs, scipy_evals, scipy_first_secs = scipy_run(
            model, loss_fn.call, x, y, FLAGS.target_iters
        )
        target = scipy_losses[-1]
        scipy_iters = first_at_or_below(scipy_losses, target)
        scipy_row = {
            "run": "SciPy L-BFGS-B, 1 process, 1 core",
            "iters": scipy_iters,
            "evals": scipy_evals,
            "secs_per_eval": scipy_secs[-1] / scipy_evals,
            "secs": scipy_secs[scipy_iters],
            "first_eval_secs": scipy_first_secs,
        }
        results, curves = [], {}
        for workers, portions in target_runs:
            row, curve = _sandblaster_to_target(
                objective_on(workers), target, workers, portions
            )
            results.append(row)
            label = f"{workers} worker{'s' * (workers > 1)}, {portions} portions"
            curves[f"Sandblaster L-BFGS ({label})"] = curve
        results.append(scipy_row)
        curves["SciPy L-BFGS-B (1 core)"] = (scipy_secs, scipy_losses)

    params = (FLAGS.features + 1) * FLAGS.hidden + (FLAGS.hidden + 1) * 10
    print(
        f"\nSandblaster L-BFGS: {FLAGS.examples} examples, {params} parameters, "
        f"{FLAGS.portions} portions, {num_workers} workers, {num_ps} "
        f"ps, 1 intra-op thread per task; target loss {target:.4g} (SciPy after "
        f"{FLAGS.target_iters} iterations)",
        flush=True,
    )
    straggler_header = [
        "workers",
        "run",
        "batch secs, no straggler",
        f"{FLAGS.slowdown:g}x straggler, no backups",
        f"{FLAGS.slowdown:g}x straggler, backup tasks",
        "backups/batch",
    ]
    _print_table(
        f"Batch time with worker 1 made {FLAGS.slowdown:g}x slower, as a ratio to "
        f"the no-straggler batch (median of {FLAGS.batches} batches per setting):",
        straggler_header,
        straggler_rows,
    )
    header = [
        "run",
        "iters to target",
        "evals to target",
        "secs per eval",
        "secs to target",
        "x SciPy",
        "first eval secs (untimed)",
    ]
    rows = [
        [
            r["run"],
            str(r["iters"]),
            str(r["evals"]),
            f"{r['secs_per_eval']:.3f}",
            f"{r['secs']:.1f}",
            f"{r['secs'] / scipy_row['secs']:.2f}x",
            f"{r['first_eval_secs']:.2f}",
        ]
        for r in results
    ]
    _print_table("To SciPy's target loss:", header, rows)
    if FLAGS.out_dir:
        _write_outputs(
            FLAGS.out_dir,
            header,
            rows,
            straggler_header,
            straggler_rows,
            batch_times,
            curves,
            target,
            num_workers,
        )
    if scaling is not None:
        scaling()


def _objective_factory(local, x, y, loss_fn):
    """`objective_on(workers)`: a maker of `SandblasterObjective`s on the first
    `workers` workers of `local` (one strategy per worker count)."""
    from tf_distbelief import strategy as strategy_lib
    from tf_distbelief.sandblaster import objective as sandblaster

    strategies = {}

    def objective_on(workers):
        def make(portions=FLAGS.portions, **kwargs):
            if workers not in strategies:
                strategies[workers] = strategy_lib.DistBeliefStrategy(
                    local.resolver_for(num_workers=workers)
                )
            model = build_model(FLAGS.features, FLAGS.hidden, FLAGS.seed)
            return sandblaster.SandblasterObjective(
                strategies[workers],
                model,
                loss_fn,
                x,
                y,
                portions=portions,
                **kwargs,
            )

        return make

    return objective_on


def _scaling(workers_list, ps_list, x, y, loss_fn):
    """The scaling table: L-BFGS iterations on each worker and ps count, with
    and (2 workers or more) without the last worker `--slowdown` times slower;
    printed, and with `--out_dir` written to `sandblaster_scaling.csv`."""
    from tf_distbelief import cluster

    runs = []
    for ps in ps_list:
        with cluster.LocalCluster(max(workers_list), ps) as local:
            objective_on = _objective_factory(local, x, y, loss_fn)
            for workers in workers_list:
                slowdowns = [None] + ([FLAGS.slowdown] if workers > 1 else [])
                for slowdown in slowdowns:
                    runs.append(
                        _scaling_run(objective_on(workers), workers, ps, slowdown)
                    )
                    print(f"scaling run: {runs[-1]}", flush=True)
    header, rows = _scaling_table(runs)
    _print_table(
        f"Scaling: {FLAGS.scaling_iters} L-BFGS iterations ({FLAGS.examples} "
        f"examples, {FLAGS.portions} portions, backup tasks, {FLAGS.two_loop}) "
        f"per worker and ps count; x fewest: secs/iter at the fewest workers "
        f"(same ps count, no straggler) over this run's:",
        header,
        rows,
    )
    if FLAGS.out_dir:
        path = plots.write_csv(
            os.path.join(FLAGS.out_dir, "sandblaster_scaling.csv"), header, rows
        )
        print(f"wrote {path}", flush=True)


def _print_table(title, header, rows):
    if title:
        print(f"\n{title}\n", flush=True)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(
            "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |",
            flush=True,
        )


def _write_outputs(
    out_dir,
    header,
    rows,
    straggler_header,
    straggler_rows,
    batch_times,
    curves,
    target,
    num_workers,
):
    """The tables and loss curves as CSV; the batch-time and loss figures."""
    plots.write_csv(os.path.join(out_dir, "sandblaster.csv"), header, rows)
    plots.write_csv(
        os.path.join(out_dir, "sandblaster_stragglers.csv"),
        straggler_header,
        straggler_rows,
    )
    plots.write_csv(
        os.path.join(out_dir, "sandblaster_loss.csv"),
        ["optimizer", "secs", "loss"],
        [[name, t, v] for name, (ts, vs) in curves.items() for t, v in zip(ts, vs)],
    )
    note = plots.machine_note()
    labels = [name.replace(", ", "\n") for name, _ in batch_times]
    paths = [
        plots.bar_plot(
            os.path.join(out_dir, "sandblaster_batch.png"),
            labels,
            {"batch": [secs for _, secs in batch_times]},
            title=(
                f"Sandblaster: one batch ({FLAGS.portions} portions), "
                f"{num_workers} workers (section 4.2)"
            ),
            xlabel="",
            ylabel="batch time (s, median)",
            note=note,
        ),
        plots.line_plot(
            os.path.join(out_dir, "sandblaster_loss.png"),
            curves,
            title="Training loss against time (Figure 4 form)",
            xlabel="wall-clock seconds",
            ylabel="training loss",
            hline=(target, f"target {target:.4g}"),
            logy=True,
            note=note,
        ),
    ]
    for path in paths:
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(console.exiting(main, keep=(app.UsageError,)))
