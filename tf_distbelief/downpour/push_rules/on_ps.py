"""The push rules on the ps, in TensorFlow: `PushRules`, one per replica.

The composition of `rule` (corrections, the step's factors, then the rule
replacing the ps optimizer or the ps optimizer's scaled step), with each
rule's TF hooks, on each variable's ps task; `reference` is the NumPy side.
For rules that `needs_fetched`, a ps-side copy per replica of the values it
last fetched: a variable of shape `[num_workers, *shard_shape]` next to each
shard, whose row `worker` each fetch writes from the very tensor it sends
(`DenseVariables.pull`). Row-sparse variables take no rule
(`check_row_sparse`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.downpour import base
from tf_distbelief.downpour.config import DownpourConfig
from tf_distbelief.downpour.push_rules import rule

__all__ = ["PushRules", "check_row_sparse", "corrected", "create"]


def check_row_sparse(config: DownpourConfig, row_sparse_names: list[str]) -> None:
    """Raises if a push rule is on and there are row-sparse variables.

    Raises:
      ValueError: naming the rules and the tables.
    """
    if config.push_rules and row_sparse_names:
        raise ValueError(
            f"Push rules {', '.join(config.push_rules)} take no row-sparse "
            "variables (embedding tables, fetched and pushed by rows). Received "
            f"row-sparse: {', '.join(row_sparse_names)}. Pass `row_sparse=[]` to "
            "move the tables whole, or turn the rules off."
        )


def corrected(rules, grad, variable, fetched, staleness, state_of):
    """Steps 1 and 2 of a push on one variable: `grad` corrected by each rule
    (`PushRule.correct`, in order), and the product of the rules' factors of
    the step (`PushRule.scale`).

    The ps applies a push through it (`PushRules.apply`), and a replica
    replaying the ps's log of pushes (`downpour.stream_fetch`) through it
    again, on its mirrors, so that both compute the same ops on the same
    values.

    Args:
      rules: the `PushRule`s in effect, in order.
      grad: the pushed gradient of `variable`, a tensor on the device that
        computes the update.
      variable: the variable (its dtype).
      fetched: the value the pushing replica last fetched, or None.
      staleness: the push's staleness (int64 scalar), or None.
      state_of: `name -> ` the named rule's state entry of the variable (a
        rule's `reads_state`; e.g. the outer momentum, or its mirror).

    Returns:
      `(grad, scale)`: the corrected gradient, and the factor (a tensor of
      the variable's dtype) or None when no rule scales the step.
    """
    return rule.compose(
        rules,
        grad,
        lambda r, g, **state: r.correct(g, variable, fetched, staleness, **state),
        lambda r: r.scale(staleness, variable.dtype),
        state_of,
    )


def create(config, optimizer, dense: list, rows: list, strategy):
    """The `PushRules` of a replica's variables, or None when all rules are off.

    Args:
      config: the `DownpourConfig`.
      optimizer: the compiled optimizer, built.
      dense: the dense variables (shards).
      rows: the row-sparse ones.
      strategy: the `DistBeliefStrategy` (`num_workers`); under its scope.

    Raises:
      ValueError: a rule is on and `rows` is not empty (`check_row_sparse`).
    """
    check_row_sparse(config, [v.name for v in rows])
    if not config.push_rules:
        return None
    return PushRules(config, optimizer, dense, strategy.num_workers, strategy)


class PushRules:
    """The ps state and ops of the push rules for a replica's dense variables.

    Create it under the strategy's scope, after the optimizer is built.

    Args:
      config: the `DownpourConfig` (its `rules`).
      optimizer: the compiled tf_keras optimizer (holds the rules' slots).
      variables: the dense `DownpourVariable` shards, in the kind's order.
      num_workers: workers in the cluster (rows of the fetched copies).
      strategy: the strategy (its `colocate_vars_with`).

    Attributes:
      rules: the `rule.PushRule`s in effect.
      states: per rule, its `ps_state` (one entry per variable, or `[]`);
        also the attribute named by the rule's `state_name`, if any (e.g.
        `momentums`, the outer optimizer's `m` per variable).
      fetched: per variable, the `[num_workers, ...]` copy of the values each
        replica last fetched, or `[]` when no rule needs it.
    """

    def __init__(
        self,
        config: DownpourConfig,
        optimizer,
        variables: list,
        num_workers: int,
        strategy: tf.distribute.Strategy,
    ):
        self.config = config
        self.optimizer = optimizer
        self.variables = list(variables)
        self.rules = config.rules
        self.states = [
            r.ps_state(optimizer, self.variables, strategy) for r in self.rules
        ]
        for r, state in zip(self.rules, self.states):
            if r.state_name:
                setattr(self, r.state_name, state)
        self.updater = next(
            (k for k, r in enumerate(self.rules) if r.replaces_optimizer), None
        )
        self.index = {r.name: k for k, r in enumerate(self.rules)}
        self.fetched = []
        if any(r.needs_fetched for r in self.rules):
            for v in self.variables:
                with strategy.extended.colocate_vars_with(v):
                    self.fetched.append(
                        tf.Variable(
                            tf.zeros([num_workers, *v.shape], v.dtype),
                            trainable=False,
                            name=f"downpour/fetched/{base.slug(v.name)}",
                        )
                    )

    @property
    def any(self) -> bool:
        """True when a push rule is on."""
        return bool(self.rules)

    @property
    def reads_staleness_first(self) -> bool:
        """True when a push needs its staleness before it is applied."""
        return any(r.needs_staleness for r in self.rules)

    def record_fetch(self, j: int, value_on_ps: tf.Tensor, worker) -> list:
        """Ops writing replica `worker`'s copy of variable `j` (`needs_fetched`).

        Args:
          j: the variable's index.
          value_on_ps: the value fetched, as read on the variable's ps task.
          worker: the replica's worker index, an integer scalar tensor.
        """
        if not self.fetched:
            return []
        with tf.device(self.variables[j].device):
            index = tf.reshape(tf.cast(worker, tf.int64), [1])
            return [
                base.scatter(
                    "Update",
                    base.ps_handle(self.fetched[j]),
                    index,
                    tf.expand_dims(value_on_ps, 0),
                )
            ]

    def apply(self, grads: list, squares: list, steps: int, staleness, worker):
        """Applies one push of dense `grads` (on their ps tasks) by the rules.

        Args:
          grads: the pushed gradients (pseudo-gradients with a rule that
            `pushes_deltas`), tensors on the variables' ps tasks, clipped.
          squares: the pushed squares per variable, or Nones.
          steps: the gradients summed per push as AdaGrad counts them
            (`n_push` with `adagrad_accumulator="mean"`, else 1).
          staleness: the push's staleness (int64 scalar), read before it is
            applied, or None when `reads_staleness_first` is False.
          worker: the replica's worker index, an integer scalar tensor.

        Returns:
          Per variable, the op of the rule that replaces the ps optimizer
          (its `update`), or None where the ps optimizer applied the push.
        """
        opt = self.optimizer
        updates = []
        for j, (g, sq, v) in enumerate(zip(grads, squares, self.variables)):
            with tf.device(v.device):
                w_fetched = None
                if self.fetched:
                    index = tf.reshape(tf.cast(worker, tf.int64), [1])
                    w_fetched = base.gather(
                        base.ps_handle(self.fetched[j]), index, v.dtype
                    )
                    w_fetched = w_fetched[0]
                g, scale = corrected(
                    self.rules,
                    g,
                    v,
                    w_fetched,
                    staleness,
                    lambda name, j=j: self.states[self.index[name]][j],
                )
                if self.updater is not None:
                    if scale is not None:
                        g = g * scale
                    k = self.updater
                    updates.append(self.rules[k].update(v, self.states[k][j], g))
                else:  # The step, not AdaGrad's accumulator, is scaled.
                    base.apply_push(opt, g, sq, v, steps, scale)
                    updates.append(None)
        return updates
