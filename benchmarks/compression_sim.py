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
for every variant. `gap` is the mean over seeds of the accuracy's difference
to `outer` of the same seed, in points; `x fewer` is `outer`'s bytes per
example over the variant's. Variants (`VARIANTS`, `--variants`):

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
numbers as `compression_sim.csv` and the Pareto figure (gap against bytes per
example, one marker per variant and evaluation) as `compression_sim.png`.

Usage:
  python benchmarks/compression_sim.py     # about 3 hours on 2 idle cores
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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tf_distbelief.downpour import config as downpour_config
    from tf_distbelief.downpour import update_stream

    f = flags.FLAGS
    evals = _check(f)
    seeds = [int(s) for s in f.seeds]
    variants = ["outer"] + [v for v in f.variants if v != "outer"]
    # (seed, variant, step) -> (accuracy, bytes per example).
    got = {}
    batch = downpour_modes._BATCH_SIZE
    for seed in seeds:
        params, grad_fn, accuracy_fn, train = downpour_modes._speech_problem(
            f.hidden_units, f.classes, seed
        )
        batches = [
            downpour_modes._batches(train, r, f.steps // 2, seed) for r in range(2)
        ]
        model_bytes = sum(p.nbytes for p in params)  # Each replica's first fetch.
        for variant in variants:
            kwargs, momentum = VARIANTS[variant]
            config = downpour_config.DownpourConfig(
                _N,
                _N,
                outer_learning_rate=f.outer_learning_rate,
                outer_momentum=f.outer_momentum if momentum is None else momentum,
            )
            start = time.monotonic()

            def evaluate(
                done,
                ps,
                stats,
                seed=seed,
                variant=variant,
                acc=accuracy_fn,
                first=model_bytes,
            ):
                if done in evals:
                    moved = sum(s.bytes_pushed + s.bytes_fetched for s in stats)
                    got[seed, variant, done] = (
                        acc(ps),
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
    rows = _table(got, seeds, variants, evals)
    print(
        f"speech 440-{f.hidden_units}x4-{f.classes}, 2 replicas, n={_N}, batch "
        f"{batch}, outer lr {f.outer_learning_rate} momentum {f.outer_momentum}, "
        f"seeds {f.seeds}"
    )
    print(
        f"{'variant':8} {'steps':>5} {'test acc':>8} {'gap pts':>8} {'sd':>5} "
        f"{'B/ex':>8} {'x fewer':>8} {'B/ex>1st':>8} target"
    )
    for variant, step, acc, gap, sd, per_example, fewer, later, met in rows:
        print(
            f"{variant:8} {step:5d} {acc:8.4f} {gap:+8.2f} {sd:5.2f} "
            f"{per_example:8,.0f} {fewer:8.1f} {later:8,.0f} {'met' if met else '-'}"
        )
    if f.out_dir:
        _write_outputs(f.out_dir, got, seeds, variants, rows)


def _table(got, seeds, variants, evals):
    """Rows `(variant, step, accuracy, gap, sd, bytes/ex, x fewer, bytes/ex
    after the first fetches, met)`: means over seeds; the gap and its sd in
    points against `outer`."""
    rows = []
    for step in evals:
        base_bytes = statistics.mean(got[s, "outer", step][1] for s in seeds)
        for variant in variants:
            accs = [got[s, variant, step][0] for s in seeds]
            gaps = [100 * (a - got[s, "outer", step][0]) for s, a in zip(seeds, accs)]
            per_example = statistics.mean(got[s, variant, step][1] for s in seeds)
            gap = statistics.mean(gaps)
            sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
            fewer = base_bytes / per_example
            later = statistics.mean(got[s, variant, step][2] for s in seeds)
            met = gap >= -_GAP_POINTS and fewer >= _BYTES_RATIO
            rows.append(
                (variant, step, statistics.mean(accs), gap, sd, per_example, fewer)
                + (later, met)
            )
    return rows


def _write_outputs(out_dir, got, seeds, variants, rows):
    """`compression_sim.csv` (every seed) and the Pareto figure."""
    plots.write_csv(
        os.path.join(out_dir, "compression_sim.csv"),
        [
            "seed",
            "variant",
            "steps",
            "test_accuracy",
            "bytes_per_example",
            "bytes_per_example_after_first_fetches",
        ],
        [[s, v, step, *got[s, v, step]] for (s, v, step) in sorted(got)],
    )
    base = {step: b for v, step, _, _, _, b, *_ in rows if v == "outer"}
    budget = min(base.values()) / _BYTES_RATIO
    path = plots.scatter_plot(
        os.path.join(out_dir, "compression_sim.png"),
        {
            f"after {step} steps": [
                (b, gap, v) for v, s, _, gap, _, b, *_ in rows if s == step
            ]
            for step in sorted(base)
        },
        title=(
            f"Compressed outer pushes (simulated, 2 replicas, n={_N}, seeds "
            f"{','.join(map(str, seeds))})"
        ),
        xlabel="bytes per example (log)",
        ylabel="accuracy gap to n=16+outer (points)",
        hline=(-_GAP_POINTS, "1 point behind"),
        vline=(budget, "1/30 of n=16+outer's bytes"),
        logx=True,
    )
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
