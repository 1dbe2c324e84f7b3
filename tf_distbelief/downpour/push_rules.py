"""Downpour's push rules on the ps: outer Nesterov, delay compensation, staleness.

The TF side of the `DownpourConfig` push rules (each off by default; the
papers and the exact rules are in `DownpourConfig`'s docstring, the NumPy
reference in `schedule.simulate` and `push_rules_reference`):

* `outer_learning_rate`: a push is the replica's pseudo-gradient (its local
  steps summed, `base.VariableKind.local_ops`) and the ps applies SGD with
  Nesterov momentum to it (`ResourceApplyKerasMomentum`, tf_keras
  `SGD(nesterov=True)`'s update) in place of the compiled optimizer. The
  momentum is a slot of the compiled optimizer, made by its
  `add_variable_from_reference`: on the variable's ps shard, coalesced into
  one `ShardedVariable` per sharded variable in the optimizer's variables, so
  checkpoints save and `resume.restore` restores it like AdaGrad's
  accumulators (whole, into any number of ps tasks).
* `delay_compensation`: DC-ASGD's `G + lambda * G * G * (w_now - w_fetched)`,
  computed on the ps. `w_fetched` is a ps-side copy per replica of the values
  it last fetched: a variable of shape `[num_workers, *shard_shape]` next to
  each shard, whose row `worker` each fetch writes from the very tensor it
  sends (`DenseVariables.pull`). No byte more on the network; ps memory
  `num_workers` copies of the model. Not checkpointed: every replica fetches
  first after a resume, which rewrites its row.
* `staleness_scaled`: the push's step divided by `max(staleness, 1)`.

Row-sparse variables take none of them (`check_row_sparse`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.adagrad import optimizer as adagrad
from tf_distbelief.downpour import base
from tf_distbelief.downpour.config import DownpourConfig
from tf_distbelief.tf_internals import optimizers as tf_optimizers

__all__ = ["MOMENTUM_SLOT", "PushRules", "check_row_sparse", "create"]

# The name of the outer optimizer's slots in the compiled optimizer
# (`outer_momentum/<variable>`).
MOMENTUM_SLOT = "outer_momentum"


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
      config: the `DownpourConfig`.
      optimizer: the compiled tf_keras optimizer (holds the momentum slots).
      variables: the dense `DownpourVariable` shards, in the kind's order.
      num_workers: workers in the cluster (rows of the fetched copies).
      strategy: the strategy (its `colocate_vars_with`).

    Attributes:
      momentums: the outer optimizer's `m` per variable, or `[]`.
      fetched: per variable, the `[num_workers, ...]` copy of the values each
        replica last fetched, or `[]`.
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
        self.outer = config.outer_learning_rate is not None
        self.momentums = []
        if self.outer:
            self.momentums = [
                optimizer.add_variable_from_reference(v, MOMENTUM_SLOT)
                for v in self.variables
            ]
        self.fetched = []
        if config.delay_compensation:
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
        return bool(self.config.push_rules)

    @property
    def reads_staleness_first(self) -> bool:
        """True when a push needs its staleness before it is applied."""
        return self.config.staleness_scaled

    def record_fetch(self, j: int, value_on_ps: tf.Tensor, worker) -> list:
        """Ops writing replica `worker`'s copy of variable `j` (DC-ASGD).

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
                    _handle(self.fetched[j]),
                    index,
                    tf.expand_dims(value_on_ps, 0),
                )
            ]

    def apply(self, grads: list, squares: list, steps: int, staleness, worker):
        """Applies one push of dense `grads` (on their ps tasks) by the rules.

        Args:
          grads: the pushed gradients (pseudo-gradients with the outer
            optimizer), tensors on the variables' ps tasks, clipped.
          squares: the pushed squares per variable, or Nones.
          steps: the gradients summed per push as AdaGrad counts them
            (`n_push` with `adagrad_accumulator="mean"`, else 1).
          staleness: the push's staleness (int64 scalar), read before it is
            applied, or None when `reads_staleness_first` is False.
          worker: the replica's worker index, an integer scalar tensor.
        """
        cfg, opt = self.config, self.optimizer
        for j, (g, sq, v) in enumerate(zip(grads, squares, self.variables)):
            with tf.device(v.device):
                if cfg.delay_compensation:
                    lam = tf.cast(cfg.delay_compensation, v.dtype)
                    index = tf.reshape(tf.cast(worker, tf.int64), [1])
                    w_fetched = base.gather(_handle(self.fetched[j]), index, v.dtype)
                    w_now = base.read(v.handle, v.dtype)
                    g = g + lam * g * g * (w_now - w_fetched[0])
                scale = None
                if cfg.staleness_scaled:
                    most = tf.maximum(staleness, tf.constant(1, staleness.dtype))
                    scale = 1 / tf.cast(most, v.dtype)
                if self.outer:
                    if scale is not None:
                        g = g * scale
                    tf.raw_ops.ResourceApplyKerasMomentum(
                        var=v.handle,
                        accum=self.momentums[j].handle,
                        lr=tf.cast(cfg.outer_learning_rate, v.dtype),
                        grad=g,
                        momentum=tf.cast(cfg.outer_momentum, v.dtype),
                        use_locking=False,
                        use_nesterov=True,
                    )
                elif scale is not None and isinstance(opt, adagrad.Adagrad):
                    # The step, not the accumulator, is divided.
                    if sq is None:
                        sq = g * g / tf.cast(steps, v.dtype)
                    opt.apply_gradient_and_squares(g * scale, sq, v)
                elif scale is not None:
                    tf_optimizers.update_step(opt, g * scale, v)
                elif sq is not None:
                    opt.apply_gradient_and_squares(g, sq, v)
                elif steps > 1 and isinstance(opt, adagrad.Adagrad):
                    opt.apply_summed_gradient(g, v, steps)
                else:
                    tf_optimizers.update_step(opt, g, v)


def _handle(variable):
    """The resource handle of a ps variable, wrapped (`DownpourVariable`) or not."""
    return variable.get().handle if hasattr(variable, "get") else variable.handle
