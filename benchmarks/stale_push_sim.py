r"""Stale outer pushes, corrected three ways, in NumPy: which correction to keep.

With the outer optimizer (`outer_learning_rate`, Nesterov on the pushed
pseudo-gradient) and more replicas than two, most pushes are stale: other
replicas' outer steps happened since the pushing replica fetched. This
script compares, without a cluster, on the test fixture's softmax model
(`tests/fixtures/downpour.py`: 6 features, 3 classes) trained on examples
labelled by a noisy linear teacher (3,072 to train, 1,024 held out), with
`--replicas` replicas, `n_fetch = n_push = --n`, SGD inner steps, one replica
`--straggler_slowdown` times slower (its steps come that much rarer in the
order), for `--steps` local steps in all; printed: the held-out loss, mean
and per seed. Variants (`--variants`):

* `none`: no correction;
* `stale`: `staleness_scaled` (every entry over the staleness);
* `damp<lambda>`: `stale_damping` (entries whose step goes the outer
  momentum's way divided by `1 + lambda * s`);
* `against<lambda>`: the other side, HeLoCo-style (entries whose step goes
  against the momentum damped), a rule registered here only;
* `ahead<a>`: momentum look-ahead: a fetch gets `w + a * mu * m`, the ps
  extrapolated along its momentum (written out here; `schedule.simulate`
  fetches `w`).

All but `ahead` run through `schedule.simulate`, the NumPy reference the
trainer matches; the `ahead` loop with `a = 0` is checked against it.

Usage:
  python benchmarks/stale_push_sim.py    # about 10 s
  python benchmarks/stale_push_sim.py --outer_learning_rate=0.35
  python benchmarks/stale_push_sim.py --straggler_slowdown=1
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_TRAIN_EXAMPLES, _TEST_EXAMPLES, _BATCH_SIZE = 3072, 1024, 4
_VARIANTS = ("none", "stale", "damp0.25", "damp1", "damp4", "against1", "ahead4")


def define_flags():
    flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"], "Seeds (data, order).")
    flags.DEFINE_list("variants", list(_VARIANTS), "Variants (module docstring).")
    flags.DEFINE_integer("replicas", 8, "Replicas.", lower_bound=2)
    flags.DEFINE_integer("n", 4, "n_fetch = n_push.", lower_bound=2)
    flags.DEFINE_integer("steps", 2048, "Local steps, all replicas.", lower_bound=1)
    flags.DEFINE_float("outer_learning_rate", 0.7, "Outer lr.", lower_bound=0.0)
    flags.DEFINE_float("outer_momentum", 0.9, "Outer Nesterov momentum.")
    flags.DEFINE_float("local_learning_rate", 0.1, "Inner SGD step size.")
    flags.DEFINE_float(
        "straggler_slowdown", 4.0, "Replica 0's steps last this many times longer."
    )


def _data(seed):
    import numpy as np

    from tests.fixtures.downpour import NUM_CLASSES, NUM_FEATURES

    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(NUM_FEATURES, NUM_CLASSES))
    x = rng.normal(size=(_TRAIN_EXAMPLES + _TEST_EXAMPLES, NUM_FEATURES))
    y = np.argmax(x @ teacher + 0.5 * rng.normal(size=(len(x), NUM_CLASSES)), 1)
    params = [
        rng.normal(size=(NUM_FEATURES, NUM_CLASSES)) * 0.1,
        rng.normal(size=NUM_CLASSES) * 0.1,
    ]
    return x, y, params


def _loss(params, x, y):
    import numpy as np

    z = x @ params[0] + params[1]
    z = z - z.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]))


def _order(replicas, slowdown, steps):
    """Who steps next: the replica whose clock is earliest (ties: lowest)."""
    clock, order = [0.0] * replicas, []
    for _ in range(steps):
        r = min(range(replicas), key=lambda i: (clock[i], i))
        order.append(r)
        clock[r] += slowdown if r == 0 else 1.0
    return order


def _look_ahead(params, batches, order, f, ahead):
    """Asynchronous outer Nesterov, SGD inner steps; a fetch gets
    `w + ahead * mu * m`."""
    import numpy as np

    from tests.fixtures.downpour import _softmax_grad
    from tf_distbelief.downpour.push_rules import outer_nesterov

    mu, n = f.outer_momentum, f.n
    ps = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in ps]
    its = [iter(b) for b in batches]
    cache, start, steps = [None] * len(batches), [None] * len(batches), [0] * 99
    for r in order:
        if steps[r] % n == 0:
            cache[r] = [w + ahead * mu * mi for w, mi in zip(ps, m)]
            start[r] = [c.copy() for c in cache[r]]
        g = _softmax_grad(cache[r], next(its[r]))
        cache[r] = [c - f.local_learning_rate * gi for c, gi in zip(cache[r], g)]
        if (steps[r] + 1) % n == 0:
            delta = [s - c for s, c in zip(start[r], cache[r])]
            ps, m = outer_nesterov.nesterov(ps, m, delta, f.outer_learning_rate, mu)
        steps[r] += 1
    return ps


def _against_rule():
    """`stale_damping`'s other side, as a rule registered for this script."""
    import numpy as np

    from tf_distbelief.downpour.push_rules import rule, stale_damping

    class Against(stale_damping.StaleDamping):
        name = "stale_damping_against"
        settings = (rule.Setting("stale_damping_against", 0.0, "float", ""),)

        def __init__(self, config):
            self.lam = float(config.stale_damping_against)

        @classmethod
        def check(cls, config):
            rule.check_float("stale_damping_against", config.stale_damping_against)

        def reference_correct(self, grads, params, fetched, staleness, state=None):
            return [
                np.where(d * m > 0, d / (1.0 + self.lam * staleness), d)
                for d, m in zip(grads, state)
            ]

    return Against


def main(argv):
    del argv
    import numpy as np

    from tests.fixtures.downpour import _softmax_grad
    from tf_distbelief.downpour import config as config_lib
    from tf_distbelief.downpour import schedule
    from tf_distbelief.downpour.push_rules import rule

    f = flags.FLAGS
    losses = {v: [] for v in f.variants}
    outer = {
        "local_learning_rate": f.local_learning_rate,
        "local_optimizer": "sgd",
        "outer_learning_rate": f.outer_learning_rate,
        "outer_momentum": f.outer_momentum,
    }
    with rule.registered(_against_rule()):
        for seed in map(int, f.seeds):
            x, y, params = _data(seed)
            test = (x[_TRAIN_EXAMPLES:], y[_TRAIN_EXAMPLES:])
            order = _order(f.replicas, f.straggler_slowdown, f.steps)
            rng = np.random.default_rng(seed)
            batches = []
            for r in range(f.replicas):
                ids = rng.integers(0, _TRAIN_EXAMPLES, (order.count(r), _BATCH_SIZE))
                batches.append([(x[i], y[i]) for i in ids])
            checked = False
            for variant in f.variants:
                if variant.startswith("ahead"):
                    got = _look_ahead(params, batches, order, f, float(variant[5:]))
                    losses[variant].append(_loss(got, *test))
                    continue
                setting = {
                    "none": {},
                    "stale": {"staleness_scaled": True},
                }.get(variant)
                if setting is None and variant.startswith("damp"):
                    setting = {"stale_damping": float(variant[4:])}
                elif setting is None and variant.startswith("against"):
                    setting = {"stale_damping_against": float(variant[7:])}
                config = config_lib.DownpourConfig(f.n, f.n, **outer, **setting)
                got, stats = schedule.simulate(
                    params,
                    _softmax_grad,
                    batches,
                    config,
                    schedule.sgd_ps(1.0),
                    order=order,
                )
                losses[variant].append(_loss(got, *test))
                if variant == "none" and not checked:
                    plain = _look_ahead(params, batches, order, f, 0.0)
                    assert all(
                        np.allclose(a, b, atol=1e-10) for a, b in zip(got, plain)
                    )
                    checked = True
                    pushes = sum(s.pushes for s in stats)
                    print(
                        f"seed {seed}: mean staleness "
                        f"{sum(s.staleness_sum for s in stats) / pushes:.2f}, replica "
                        f"0's {stats[0].staleness_sum / max(stats[0].pushes, 1):.2f}"
                    )
    start = np.mean([_loss(_data(s)[2], *_data(s)[:2]) for s in map(int, f.seeds)])
    print(f"initial loss (all examples) {start:.4f}")
    for variant, values in losses.items():
        each = " ".join(f"{v:.4f}" for v in values)
        print(f"{variant:12s} held-out loss {np.mean(values):.4f}  ({each})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
