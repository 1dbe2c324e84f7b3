"""The outer optimizer on pushes: Nesterov SGD on the pushed parameter delta.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", algorithm 1); Async Local-SGD (Liu et al. 2024,
"Asynchronous Local-SGD Training for Language Modeling", section 3).

Settings (`DownpourConfig` keyword arguments and launch flags):

* `outer_learning_rate`: None (default): off. A float > 0: a push sends the
  replica's *pseudo-gradient*: the sum of its local steps since its last push
  (the cache's decrease), which with `n_fetch == n_push` and no dropped push
  is the parameter delta since the last fetch, `w_fetched - cache`; the ps
  applies SGD with Nesterov momentum to it in place of the compiled
  optimizer: `m <- mu * m - eta * D`, `w <- w + mu * m - eta * D` (tf_keras
  `SGD(nesterov=True)`; `eta` this rate, `mu` `outer_momentum`). Needs
  `n_fetch, n_push >= 2` and a local step (`local_learning_rate` not 0):
  otherwise the cache never moves and every push is 0. DiLoCo used 0.7 with
  0.9 momentum.
* `outer_momentum`: `mu`, in `[0, 1)`; default 0.9 (`OUTER_MOMENTUM`); read
  only with `outer_learning_rate`.

On the ps (TF's `ResourceApplyKerasMomentum`, tf_keras `SGD(nesterov=True)`'s
update) `m` is a slot of the compiled optimizer (`MOMENTUM_SLOT`), made by its
`add_variable_from_reference`: on the variable's ps shard, coalesced into one
`ShardedVariable` per sharded variable in the optimizer's variables, so
checkpoints save and `resume.restore` restores it like AdaGrad's
accumulators (whole, into any number of ps tasks). TensorFlow is imported by
the TF hooks only.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief import checks
from tf_distbelief.downpour.push_rules import rule

__all__ = ["MOMENTUM_SLOT", "OUTER_MOMENTUM", "OuterNesterov", "RULE", "nesterov"]

# The outer Nesterov momentum's default: DiLoCo's (Douillard et al. 2023,
# section 3) and Async Local-SGD's (Liu et al. 2024) 0.9.
OUTER_MOMENTUM = 0.9
# The name of the outer optimizer's slots in the compiled optimizer
# (`outer_momentum/<variable>`), as checkpoints hold them.
MOMENTUM_SLOT = "outer_momentum"


def nesterov(params, momentums, deltas, learning_rate, momentum):
    """SGD with Nesterov momentum on `deltas`, in NumPy.

    tf_keras `SGD(nesterov=True)`'s form (TF's `ResourceApplyKerasMomentum`):
    `m <- mu * m - eta * D`, `w <- w + mu * m - eta * D`.

    Args:
      params: the ps parameters, a list of arrays.
      momentums: `m`, one array per parameter (zeros at the start).
      deltas: `D`, one array per parameter.
      learning_rate: `eta`, `outer_learning_rate`.
      momentum: `mu`, `outer_momentum`.

    Returns:
      `(params, momentums)`, new lists.
    """
    momentums = [momentum * m - learning_rate * d for m, d in zip(momentums, deltas)]
    params = [
        w + momentum * m - learning_rate * d
        for w, m, d in zip(params, momentums, deltas)
    ]
    return params, momentums


class OuterNesterov(rule.PushRule):
    """Nesterov SGD on the pushed pseudo-gradient (module docstring).

    Args:
      config: a `DownpourConfig` with `outer_learning_rate` set.
    """

    name = "outer_learning_rate"
    title = "the outer optimizer"
    settings = (
        rule.Setting(
            "outer_learning_rate",
            None,
            "float",
            "Downpour push rule (DiLoCo, Douillard et al. 2023): pushes are the "
            "local steps' sum (the parameter delta of a round) and the ps applies "
            "Nesterov SGD with this rate to them (unset: off; needs --n_fetch, "
            "--n_push >= 2).",
            lower_bound=0.0,
        ),
        rule.Setting(
            "outer_momentum",
            OUTER_MOMENTUM,
            "float",
            "Downpour: the outer optimizer's Nesterov momentum, in [0, 1).",
            lower_bound=0.0,
            upper_bound=1.0,
        ),
    )
    pushes_deltas = True
    replaces_optimizer = True
    state_name = "momentums"  # `on_ps.PushRules.momentums`: `m` per variable.

    def __init__(self, config):
        super().__init__(config)
        self.learning_rate = float(config.outer_learning_rate)
        self.momentum = float(config.outer_momentum)

    @classmethod
    def is_on(cls, config) -> bool:
        return config.outer_learning_rate is not None

    @classmethod
    def check(cls, config) -> None:
        outer = config.outer_learning_rate
        if outer is not None:
            rule.check_float(
                "outer_learning_rate", outer, "None (no outer optimizer)", "> 0"
            )
        rule.check_float("outer_momentum", config.outer_momentum)
        if not 0 <= config.outer_momentum < 1:
            raise checks.argument_error(
                "outer_momentum", "in [0, 1)", config.outer_momentum
            )
        if outer is None:
            return
        if config.n_fetch < 2 or config.n_push < 2:
            raise ValueError(
                "Argument `outer_learning_rate` needs `n_fetch` and `n_push` >= 2 "
                "(local rounds): with 1 the cache is replaced or pushed before a "
                "local step moves it, and the pushed delta is 0. Received: "
                f"n_fetch={config.n_fetch}, n_push={config.n_push}"
            )
        if config.local_learning_rate == 0:
            raise ValueError(
                "Argument `outer_learning_rate` needs a local step: "
                "`local_learning_rate` 0 keeps the cache still and every "
                "pushed delta 0. Received: local_learning_rate=0"
            )

    def reference_state(self, params):
        return [np.zeros_like(p) for p in params]  # `m`.

    def reference_update(self, params, state, grads):
        return nesterov(params, state, grads, self.learning_rate, self.momentum)

    def ps_state(self, optimizer, variables, strategy):
        del strategy  # The slots go where the optimizer puts them: each shard.
        return [
            optimizer.add_variable_from_reference(v, MOMENTUM_SLOT) for v in variables
        ]

    def update(self, variable, state, grad):
        import tensorflow as tf

        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle,
            accum=state.handle,
            lr=tf.cast(self.learning_rate, variable.dtype),
            grad=grad,
            momentum=tf.cast(self.momentum, variable.dtype),
            use_locking=False,
            use_nesterov=True,
        )


RULE = OuterNesterov
