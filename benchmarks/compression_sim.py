r"""Compressed outer pushes in NumPy: bytes per example against accuracy.

Which way of compressing Downpour's exchange to build, chosen without a
cluster: every variant of `tf_distbelief.downpour.update_stream` (the NumPy
reference of the update-stream fetch, the parameter-space residual, DGC's
momentum correction, compact positions) against `n=16+outer` uncompressed,
on `benchmarks/downpour_modes.py`'s problem: the speech-shaped MLP on
`tf_distbelief.demos.speech`'s data, 2 replicas taking whole steps in turn,
batch 32, `n_fetch = n_push = 16`, the replica's local AdaGrad (gamma 0.2) and
the outer rule at lr `--outer_learning_rate`, momentum `--outer_momentum`.
Each variant runs `--steps` steps per seed and is evaluated (test accuracy,
bytes per example so far) after each of `--eval_steps`: the same examples
for every variant. `gap` is the mean over the seeds of the accuracy's
difference to `outer` of the same seed, in points; `x fewer` is `outer`'s
bytes per example over the variant's; `B/ex>1st` leaves out each replica's
first fetch (the whole model, which every variant pays once). Variants
(`VARIANTS`, `--variants`):

* `outer`: uncompressed pushes, whole fetches (`n=16+outer`): the baseline;
* `ef1`: today's rule at the outer rule's settings: the top 1% in 2 bits,
  error feedback, the cache reset to the ps at each fetch, int32 positions,
  whole fetches;
* `ps<k>`: the top k% in 2 bits with the parameter-space residual, fetches
  of the update stream, the positions in the fewest bytes (`auto`);
  `ps1w`: `ps1` with a density warm-up over 8 pushes; `ps1r`: `ps1` with an
  error reset every 16 pushes;
* `dgc5`: DGC's momentum correction (0.9 on the replica, none on the ps) of
  the top 5% in 2 bits, update-stream fetches, `auto` positions.

With `--out_dir` (default `benchmarks/results/`) it writes every seed's
numbers as `compression_sim.csv`, after each seed, and the Pareto figure (gap
against bytes per example, one marker per variant and evaluation) as
`compression_sim.png`. With `--resume` the runs already in that CSV are kept
and only the missing (seed, variant) pairs run: a table can be built over
several invocations, and each row says which seeds it averages.

Usage:
  python benchmarks/compression_sim.py     # about an hour on 2 cores
  python benchmarks/compression_sim.py --seeds=0 --steps=64 --eval_steps=32,64
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks import downpour_modes, plots  # noqa: E402

_N = 16  # n_fetch = n_push, as n=16+outer.
# The target: within 1 point of `outer` at no more than 1/30 of its bytes.
_GAP_POINTS, _BYTES_RATIO = 1.0, 30.0
_Q2 = {"bits": 2}
_STREAM = {"residual": "parameter", "fetch": "stream", "positions": "auto"}
# name: (`Exchange` keyword arguments, the outer momentum on the ps or None
# for `--outer_momentum`).
VARIANTS = {
    "outer": ({}, None),
    "ef1": ({"fraction": 0.01, **_Q2}, None),
    **{f"ps{k}": ({"fraction": k / 100, **_Q2, **_STREAM}, None) for k in (1, 2, 3, 5)},
    "ps1w": ({"fraction": 0.01, **_Q2, **_STREAM, "warmup_pushes": 8}, None),
    "ps1r": ({"fraction": 0.01, **_Q2, **_STREAM, "error_reset": 16}, None),
    "dgc5": (
        {
            "fraction": 0.05,
            **_Q2,
            "dgc_momentum": 0.9,
            "fetch": "stream",
            "positions": "auto",
        },
        0.0,
    ),
}


def define_flags():
    flags.DEFINE_list("seeds", ["0", "1", "2", "3"], "Seeds to average over.")
    flags.DEFINE_integer(
        "steps", 2880, "Steps of both replicas together.", lower_bound=2
    )
    flags.DEFINE_list(
        "eval_steps", ["960", "2880"], "Steps after which to evaluate (<= --steps)."
    )
    flags.DEFINE_list(
        "variants", list(VARIANTS), "Variants (`VARIANTS`); `outer` is the baseline."
    )
    flags.DEFINE_integer("hidden_units", 256, "Speech model width.", lower_bound=1)
    flags.DEFINE_integer("classes", 8192, "Speech model softmax width.", lower_bound=2)
    flags.DEFINE_float("outer_learning_rate", 0.35, "Outer lr.", lower_bound=0.0)
    flags.DEFINE_float("outer_momentum", 0.9, "Outer Nesterov momentum.")
    flags.DEFINE_string(
        "out_dir", plots.DEFAULT_OUT_DIR, "CSV and PNG output folder ('' for none)."
    )
    flags.DEFINE_bool(
        "resume",
        False,
        "Keep the runs already in --out_dir's compression_sim.csv and run only "
        "the (seed, variant) pairs missing there; the table covers them all.",
    )


def _check(f):
    unknown = [v for v in f.variants if v not in VARIANTS]
    if unknown or "outer" not in f.variants:
        raise app.UsageError(
            f"--variants: {unknown} not among {sorted(VARIANTS)}, or no `outer`"
        )
    evals = sorted({int(s) for s in f.eval_steps})
    if not evals or evals[-1] > f.steps or evals[0] < 1:
        raise app.UsageError(f"--eval_steps must be in 1..--steps: {f.eval_steps}")
    return evals


_CSV = "compression_sim.csv"
_HEADER = (
    "seed",
    "variant",
    "steps",
    "test_accuracy",
    "bytes_per_example",
    "bytes_per_example_after_first_fetches",
)


def _read_csv(path):
    """`{(seed, variant, step): (accuracy, B/ex, B/ex after the first
    fetches)}` from a `compression_sim.csv`."""
    import csv

    with open(path, newline="") as f:
        return {
            (int(r["seed"]), r["variant"], int(r["steps"])): tuple(
                float(r[k]) for k in _HEADER[3:]
            )
            for r in csv.DictReader(f)
        }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    evals = _check(f)
    seeds = [int(s) for s in f.seeds]
    variants = ["outer"] + [v for v in f.variants if v != "outer"]
    csv_path = os.path.join(f.out_dir, _CSV) if f.out_dir else None
    # (seed, variant, step) -> (accuracy, B/ex, B/ex after the first fetches).
    got = {}
    if f.resume and csv_path and os.path.exists(csv_path):
        got = _read_csv(csv_path)
    for seed in seeds:
        todo = [v for v in variants if any((seed, v, s) not in got for s in evals)]
        if todo:
            _run_seed(f, seed, todo, evals, got)
        if csv_path:
            plots.write_csv(csv_path, _HEADER, [[*k, *got[k]] for k in sorted(got)])
    rows = _table(got)
    print(
        f"speech 440-{f.hidden_units}x4-{f.classes}, 2 replicas, n={_N}, batch "
        f"{downpour_modes._BATCH_SIZE}, outer lr {f.outer_learning_rate} momentum "
        f"{f.outer_momentum}"
    )
    print(
        f"{'variant':8} {'steps':>5} {'seeds':>7} {'test acc':>8} {'gap pts':>8} "
        f"{'sd':>5} {'B/ex':>8} {'x fewer':>8} {'B/ex>1st':>8} target"
    )
    for variant, step, used, acc, gap, sd, per_example, fewer, later, met in rows:
        print(
            f"{variant:8} {step:5d} {used:>7} {acc:8.4f} {gap:+8.2f} {sd:5.2f} "
            f"{per_example:8,.0f} {fewer:8.1f} {later:8,.0f} {'met' if met else '-'}"
        )
    if f.out_dir:
        _write_figure(f.out_dir, rows)


def _run_seed(f, seed, variants, evals, got):
    """Runs `variants` on `seed`'s problem; fills `got`."""
    from tf_distbelief.downpour import config as downpour_config
    from tf_distbelief.downpour import update_stream

    batch = downpour_modes._BATCH_SIZE
    params, grad_fn, accuracy_fn, train = downpour_modes._speech_problem(
        f.hidden_units, f.classes, seed
    )
    batches = [downpour_modes._batches(train, r, f.steps // 2, seed) for r in range(2)]
    first = sum(p.nbytes for p in params)  # Each replica's first fetch.
    for variant in variants:
        kwargs, momentum = VARIANTS[variant]
        config = downpour_config.DownpourConfig(
            _N,
            _N,
            outer_learning_rate=f.outer_learning_rate,
            outer_momentum=f.outer_momentum if momentum is None else momentum,
        )
        start = time.monotonic()

        def evaluate(done, ps, stats, variant=variant):
            if done in evals:
                moved = sum(s.bytes_pushed + s.bytes_fetched for s in stats)
                got[seed, variant, done] = (
                    accuracy_fn(ps),
                    moved / (done * batch),
                    (moved - len(stats) * first) / (done * batch),
                )

        update_stream.simulate(
            params,
            grad_fn,
            batches,
            config,
            update_stream.Exchange(**kwargs),
            ps_learning_rate=downpour_modes._LEARNING_RATE,
            after_step=evaluate,
        )
        each = ", ".join(
            f"{step}: {got[seed, variant, step][0]:.4f} "
            f"{got[seed, variant, step][1]:,.0f} B/ex"
            for step in evals
        )
        print(
            f"seed {seed} {variant}: {each} ({time.monotonic() - start:.0f} s)",
            flush=True,
        )


def _table(got):
    """Rows `(variant, step, seeds, accuracy, gap, sd, bytes/ex, x fewer,
    bytes/ex after the first fetches, met)` of every variant and step in
    `got`, over the seeds that ran both the variant and `outer` (`seeds`
    names them): means; the gap and its sd in points against `outer` of the
    same seed."""
    rows = []
    variants = list(dict.fromkeys(v for _, v, _ in sorted(got, key=_order)))
    for step in sorted({t for _, v, t in got if v == "outer"}):
        base = {s: got[s, v, t] for s, v, t in got if v == "outer" and t == step}
        base_bytes = statistics.mean(b[1] for b in base.values())
        for variant in variants:
            seeds = sorted(s for s, v, t in got if (v, t) == (variant, step))
            seeds = [s for s in seeds if s in base]
            if not seeds:
                continue
            mine = [got[s, variant, step] for s in seeds]
            gaps = [100 * (m[0] - base[s][0]) for s, m in zip(seeds, mine)]
            gap = statistics.mean(gaps)
            sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
            per_example = statistics.mean(m[1] for m in mine)
            fewer = base_bytes / per_example
            used = ",".join(map(str, seeds))
            rows.append(
                (variant, step, used, statistics.mean(m[0] for m in mine), gap, sd)
                + (per_example, fewer, statistics.mean(m[2] for m in mine))
                + (gap >= -_GAP_POINTS and fewer >= _BYTES_RATIO,)
            )
    return rows


def _order(key):
    """`VARIANTS`' order of a `(seed, variant, step)` key's variant."""
    names = list(VARIANTS)
    return names.index(key[1]) if key[1] in names else len(names), key


def _write_figure(out_dir, rows):
    """The Pareto figure: the gap against bytes per example."""
    base = {step: r[6] for r in rows for step in [r[1]] if r[0] == "outer"}
    path = plots.scatter_plot(
        os.path.join(out_dir, "compression_sim.png"),
        {
            f"after {step} steps": [(r[6], r[4], r[0]) for r in rows if r[1] == step]
            for step in sorted(base)
        },
        title=f"Compressed outer pushes (simulated, 2 replicas, n={_N})",
        xlabel="bytes per example (log)",
        ylabel="accuracy gap to n=16+outer (points)",
        hline=(-_GAP_POINTS, "1 point behind"),
        vline=(min(base.values()) / _BYTES_RATIO, "1/30 of n=16+outer's bytes"),
        logx=True,
    )
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
