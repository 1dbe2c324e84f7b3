r"""The outer rule against the replica count, in NumPy: which rule keeps accuracy.

With the outer optimizer (Nesterov on each pushed pseudo-gradient) every push
is one outer step, so `W` replicas take `W` outer steps per round of local
steps where DiLoCo (Douillard et al. 2023) takes one on their average: the
outer step per example grows with `W`, and the pushes grow staler. This
script trains the speech-shaped model of `benchmarks/downpour_modes.py`
(`_speech_problem`, each replica its own shuffle, batch 32, AdaGrad local
steps, `n_fetch = n_push = n`) with `schedule.simulate`, the NumPy reference
of the cluster, for `--steps` local steps in all whatever `W` (equal
examples), and prints the test accuracy per rule, `W`, `n` and order, mean
and per seed. Orders (`--orders`): `rr` round robin (`W` steps in turn;
push staleness `0..W-1`), `random` each step's replica drawn at random, with
`steps / W` steps each. Rules (`--rules`):

* `base`: today's outer rule, `--outer_learning_rate` (0.35),
  `--outer_momentum` (0.9);
* `damp`: the same with `stale_damping = 1`;
* `lin`: the outer learning rate times `2 / W` (the outer step per example
  of `W = 2` kept);
* `sqrt`: the outer learning rate times `sqrt(2 / W)`;
* `mom`: the outer momentum lowered as asynchrony adds its own (Mitliagkas
  et al. 2016, "Asynchrony begets momentum"), `mu_W = max(0, 1 - (1 - mu) *
  W / 2)`, the outer learning rate raised to keep `lr / (1 - mu)` (the
  step per example of a steady direction): `lr * (1 - mu_W) / (1 - mu)`;
* `lin_damp`: `lin` with `stale_damping = 1` (not in the default list);
* `delayed`: Async Local-SGD's delayed Nesterov (Liu et al. 2024, section
  3), with its delay the replica count: each push steps `-eta * D / W`, and
  every `W`-th push also updates the momentum with the mean of the last `W`
  pushes, `m <- mu * m - eta * mean`, and steps `mu * m`: one round of `W`
  pushes moves as one tf_keras Nesterov step on their mean, at `eta = 2 *
  outer_learning_rate` (the `W = 2` round robin's step per round). A rule
  registered by this script only.

Usage:
  python benchmarks/outer_replicas_sim.py        # the README's grid
  python benchmarks/outer_replicas_sim.py --seeds=0 --replicas=2,8 --n=16 \
    --rules=base,lin --orders=rr --steps=1024    # a smoke run
"""

from __future__ import annotations

import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks import downpour_modes, stale_push_sim  # noqa: E402

_RULES = ("base", "damp", "lin", "sqrt", "mom", "delayed", "lin_damp")
# The rules that are `base` at W = 2 (not run there; the table shows base's).
_SAME_AT_2 = ("lin", "sqrt", "mom")
_PS_LEARNING_RATE = 0.2  # AdaGrad gamma, the local step's default, as downpour_modes.


def define_flags():
    flags.DEFINE_list("seeds", ["0", "1"], "Seeds (model, data order, step order).")
    flags.DEFINE_list("replicas", ["2", "4", "8", "16"], "Replica counts W.")
    flags.DEFINE_list("n", ["16", "64"], "n_fetch = n_push values.")
    flags.DEFINE_list("rules", list(_RULES[:-1]), "Rules (module docstring).")
    flags.DEFINE_list("orders", ["rr", "random"], "Step orders: rr, random.")
    flags.DEFINE_integer(
        "steps", 2048, "Local steps of all replicas together.", lower_bound=1
    )
    flags.DEFINE_float("outer_learning_rate", 0.35, "The outer lr at W = 2.")
    flags.DEFINE_float("outer_momentum", 0.9, "Outer Nesterov momentum.")
    flags.DEFINE_float(
        "local_learning_rate",
        None,
        "The local AdaGrad step size (default: the ps AdaGrad's 0.2).",
        lower_bound=0.0,
    )
    flags.DEFINE_integer("hidden_units", 256, "Speech model width.", lower_bound=1)
    flags.DEFINE_integer("classes", 8192, "Speech model softmax width.", lower_bound=2)


def _delayed_rule():
    """Delayed Nesterov (module docstring) as a rule registered for this script."""
    import numpy as np

    from tf_distbelief.downpour.push_rules import outer_nesterov, rule

    class Delayed(outer_nesterov.OuterNesterov):
        name = "outer_delay"
        title = "delayed Nesterov"
        settings = (
            rule.Setting("outer_delay", 0, "int", ""),
            rule.Setting("outer_delay_learning_rate", 0.0, "float", ""),
        )

        def __init__(self, config):
            self.learning_rate = float(config.outer_delay_learning_rate)
            self.momentum = float(config.outer_momentum)
            self.delay = int(config.outer_delay)

        @classmethod
        def is_on(cls, config):
            return config.outer_delay > 0

        @classmethod
        def check(cls, config):
            rule.check_int("outer_delay", config.outer_delay, 0)

        def reference_state(self, params):
            zeros = [np.zeros_like(p) for p in params]
            return {"m": zeros, "sum": [z.copy() for z in zeros], "pushes": 0}

        def reference_update(self, params, state, grads):
            eta, mu, k = self.learning_rate, self.momentum, self.delay
            params = [p - eta * g / k for p, g in zip(params, grads)]
            total = [s + g for s, g in zip(state["sum"], grads)]
            if state["pushes"] + 1 < k:
                return params, {**state, "sum": total, "pushes": state["pushes"] + 1}
            m = [mu * m - eta * s / k for m, s in zip(state["m"], total)]
            params = [p + mu * mi for p, mi in zip(params, m)]
            return params, {"m": m, "sum": [0 * s for s in total], "pushes": 0}

    return Delayed


def _settings(rule_name, replicas, f):
    """The `DownpourConfig` keyword arguments of a rule at `W = replicas`."""
    lr, mu = f.outer_learning_rate, f.outer_momentum
    if rule_name == "delayed":
        return {
            "outer_delay": replicas,
            "outer_delay_learning_rate": 2 * lr,
            "outer_momentum": mu,
        }
    if rule_name == "mom":
        mu_w = max(0.0, 1 - (1 - mu) * replicas / 2)
        return {
            "outer_learning_rate": lr * (1 - mu_w) / (1 - mu),
            "outer_momentum": mu_w,
        }
    scale = {"lin": 2 / replicas, "lin_damp": 2 / replicas}
    scale["sqrt"] = math.sqrt(2 / replicas)
    out = {
        "outer_learning_rate": lr * scale.get(rule_name, 1.0),
        "outer_momentum": mu,
    }
    if rule_name in ("damp", "lin_damp"):
        out["stale_damping"] = 1.0
    return out


def _step_order(order, replicas, steps, seed):
    """Who steps when: `steps // replicas` steps each, in turn or at random."""
    import numpy as np

    if order == "rr":
        return stale_push_sim._order(replicas, 1.0, steps // replicas * replicas)
    if order != "random":
        raise app.UsageError(f"--orders: {order!r} is not rr or random")
    each = np.repeat(np.arange(replicas), steps // replicas)
    return np.random.default_rng([seed, replicas, 7]).permutation(each).tolist()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")

    from tf_distbelief.downpour import config as config_lib
    from tf_distbelief.downpour import schedule
    from tf_distbelief.downpour.push_rules import rule

    f = flags.FLAGS
    unknown = sorted(set(f.rules) - set(_RULES))
    if unknown:
        raise app.UsageError(f"--rules: {unknown} not among {_RULES}")
    results = {}  # (rule, order, n, W) -> [accuracy per seed]
    staleness = {}  # (order, n, W) -> [mean staleness per seed]
    with rule.registered(_delayed_rule()):
        for seed in map(int, f.seeds):
            params, grad_fn, accuracy_fn, train = downpour_modes._speech_problem(
                f.hidden_units, f.classes, seed
            )
            for replicas in map(int, f.replicas):
                each = f.steps // replicas
                batches = [
                    downpour_modes._batches(train, r, each, seed)
                    for r in range(replicas)
                ]
                for order in f.orders:
                    steps = _step_order(order, replicas, f.steps, seed)
                    for n in map(int, f.n):
                        for rule_name in f.rules:
                            if replicas == 2 and rule_name in _SAME_AT_2:
                                continue  # The same as base at W = 2.
                            start = time.monotonic()
                            config = config_lib.DownpourConfig(
                                n,
                                n,
                                local_optimizer="adagrad",
                                adagrad_accumulator="squares",
                                local_learning_rate=f.local_learning_rate,
                                **_settings(rule_name, replicas, f),
                            )
                            got, stats = schedule.simulate(
                                params,
                                grad_fn,
                                batches,
                                config,
                                schedule.adagrad_ps(_PS_LEARNING_RATE),
                                order=steps,
                            )
                            acc = accuracy_fn(got)
                            results.setdefault((rule_name, order, n, replicas), [])
                            results[rule_name, order, n, replicas].append(acc)
                            pushes = sum(s.pushes for s in stats)
                            stale = sum(s.staleness_sum for s in stats) / max(pushes, 1)
                            staleness.setdefault((order, n, replicas), {})[seed] = (
                                stale,
                                max(s.max_staleness_seen for s in stats),
                            )
                            print(
                                f"seed {seed} W={replicas} {order} n={n} "
                                f"{rule_name}: {acc:.4f} (staleness mean "
                                f"{stale:.2f}, {time.monotonic() - start:.0f} s)",
                                flush=True,
                            )
    _table(f, results, staleness)


def _table(f, results, staleness):
    """Prints the mean accuracy per rule (rows) and `W` (columns)."""
    import numpy as np

    widths = [int(w) for w in f.replicas]
    print(
        f"speech 440-{f.hidden_units}x4-{f.classes}, {f.steps} local steps of "
        f"{downpour_modes._BATCH_SIZE} in all, seeds {','.join(f.seeds)}; test "
        "accuracy, mean over seeds (per seed in brackets)"
    )
    for order in f.orders:
        for n in map(int, f.n):
            stale = []
            for w in widths:
                got = staleness.get((order, n, w), {})
                mean = np.mean([s for s, _ in got.values()]) if got else float("nan")
                top = max((m for _, m in got.values()), default=0)
                stale.append(f"W={w}: {mean:.1f} (max {top})")
            print(f"\norder {order}, n={n}; push staleness {', '.join(stale)}")
            print("| rule | " + " | ".join(f"W={w}" for w in widths) + " |")
            print("|---" * (len(widths) + 1) + "|")
            for rule_name in f.rules:
                cells = []
                for w in widths:
                    key = (rule_name, order, n, w)
                    if w == 2 and rule_name in _SAME_AT_2:
                        key = ("base", order, n, w)
                    accs = results.get(key)
                    if not accs:
                        cells.append("-")
                        continue
                    each = " ".join(f"{a:.3f}" for a in accs)
                    cells.append(f"{np.mean(accs):.4f} ({each})")
                print(f"| {rule_name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    define_flags()
    app.run(main)
