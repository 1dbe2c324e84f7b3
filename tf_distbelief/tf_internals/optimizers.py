"""tf_keras optimizer internals: clipping, one variable's update, the apply.

Used by Downpour's push (`downpour.exchange`, `downpour.push_rules`) and by
the non-finite guard (`faults.nonfinite`).
"""

from __future__ import annotations

import tf_keras

from tf_distbelief.tf_internals import _shapes


def clip_gradients(optimizer, grads: list) -> list:
    """Applies a tf_keras optimizer's `clipnorm`/`clipvalue` settings to `grads`.

    Downpour applies a push with the optimizer's per-variable update, outside
    `apply_gradients` (which fails inside `tf.cond` on a per-worker variable).
    Public route checked: none; `apply_gradients` clips and applies together.
    """
    return optimizer._clip_gradients(grads)


def update_step(optimizer, gradient, variable):
    """One tf_keras optimizer update of `variable` by `gradient`, in place.

    Public route checked: `update_step` is public but, on a variable created
    under a strategy, tf_keras dispatches it through the distribution context
    (`_distributed_apply_gradients_fn`), which cannot run on a ps shard inside
    a scheduled function's `tf.cond`; `_update_step` is the per-variable rule.
    """
    return optimizer._update_step(gradient, variable)


def wrap_distributed_apply(optimizer, wrapper) -> None:
    """Routes a tf_keras optimizer's cross-replica apply through `wrapper`.

    After this, the optimizer's update of all its variables for one step runs
    `wrapper(apply, distribution, grads_and_vars, **kwargs)`, where `apply` is
    the optimizer's own function (it updates every variable on its ps shard
    and returns the advanced `iterations`). The non-finite guard puts one
    `tf.cond` around it, so that a step with a NaN/inf gradient changes no ps
    variable and no slot. Public route checked: `apply_gradients` inside a
    `tf.cond` fails under ParameterServerStrategy (its `merge_call` in a cond
    branch raises RuntimeError), and wrapping `apply_gradients` can check the
    gradients but not skip the update; `_distributed_apply_gradients_fn` is
    what tf_keras runs in the cross-replica context, where a `tf.cond` around
    the updates works.
    """
    apply = optimizer._distributed_apply_gradients_fn

    def guarded(distribution, grads_and_vars, **kwargs):
        return wrapper(apply, distribution, grads_and_vars, **kwargs)

    optimizer._distributed_apply_gradients_fn = guarded


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    optimizer = tf_keras.optimizers.Optimizer
    _shapes.expect(
        "optimizers",
        [
            (
                "tf_keras Optimizer._clip_gradients",
                callable(getattr(optimizer, "_clip_gradients", None)),
            ),
            (
                "tf_keras Optimizer._update_step",
                callable(getattr(optimizer, "_update_step", None)),
            ),
            (
                "tf_keras Optimizer._distributed_apply_gradients_fn",
                "_distributed_apply_gradients_fn" in _shapes.source_names(optimizer),
            ),
        ],
    )
