"""Trains a tf_keras model with Sandblaster L-BFGS (Dean et al. 2012, §4.2).

`SandblasterTrainer` runs `lbfgs.minimize` on the coordinator (this process,
the `chief`), on vectors sharded over the ps tasks (`ps_vectors.PsVectorOps`),
with `objective.SandblasterObjective` as the function it minimises: each
evaluation runs in work portions on the workers. It starts from the model's
weights and writes the result back into them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief import checks, console, paths
from tf_distbelief.faults import preemption
from tf_distbelief.sandblaster import checkpoint as checkpoint_lib
from tf_distbelief.sandblaster import config as config_lib
from tf_distbelief.sandblaster import lbfgs, schedule
from tf_distbelief.sandblaster import objective as objective_lib
from tf_distbelief.sandblaster import portion as portion_lib

__all__ = ["SandblasterTrainer"]


class SandblasterTrainer:
    """Trains a tf_keras model with Sandblaster L-BFGS (Dean et al. 2012, §4.2).

    Full-batch L-BFGS (`lbfgs.minimize`, strong Wolfe line search) on the mean
    training loss plus the model's regularisation losses; the parameters and the
    L-BFGS history live on the ps (`ps_vectors.PsVectorOps`), objective
    evaluations run in portions on the workers (`SandblasterObjective`).

    The model may be compiled or not (only its loss is used: `loss_fn=None`
    takes the compiled one); build it after creating the strategy (connecting
    drops earlier variables) and outside `strategy.scope()`. `fit` starts
    from the model's current weights and writes the result back into them: the
    only two parameter-sized transfers through the coordinator.

    Example:
      ```
      with tfdb.cluster.LocalCluster(num_workers=2, num_ps=2) as local:
        strategy = tfdb.DistBeliefStrategy(local.resolver)
        model = digits.build_model()  # tf_distbelief.demos; after it connected.
        trainer = sandblaster.SandblasterTrainer(
            strategy, model,
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            x_train, y_train,
            sandblaster.SandblasterConfig(history=10, max_iters=200, portions=32))
        result = trainer.fit()  # The trained weights are in `model`.
        print(result.loss, trainer.stats)
      ```

    Args:
      strategy: a `DistBeliefStrategy` (or ParameterServerStrategy); this
        process is its coordinator.
      model: a tf_keras model, built after `strategy` was created and outside
        `strategy.scope()`.
      loss_fn: the loss (`SandblasterObjective`); None takes the compiled one.
      x: training features, `[num_examples, ...]`; required.
      y: training targets, `[num_examples, ...]`; required.
      config: the `SandblasterConfig`; None means its defaults.
      portions: if given, replaces `config.portions`; at most `num_examples`.
      history: if given, replaces `config.history`, the `(s, y)` pairs L-BFGS
        keeps on the ps.
      backup_tasks: if given, replaces `config.backup_tasks`.
      num_shards: ps shards of every vector; None means one per ps task.
      portion_delay_fn: for tests and benchmarks only, a
        `portion.PortionDelayFn` run in every portion (a straggler); None
        (default) adds nothing.

    Attributes:
      model: the model, holding the result after `fit`.
      config: the `SandblasterConfig` in effect (keyword arguments applied).
      objective: the `SandblasterObjective`.

    Raises:
      ValueError: `x` or `y` missing, or see `SandblasterConfig` and
        `SandblasterObjective`.
      TypeError: `config` is not a `SandblasterConfig`, or see
        `SandblasterConfig` and `SandblasterObjective`.
    """

    def __init__(
        self,
        strategy: tf.distribute.experimental.ParameterServerStrategy,
        model: tf_keras.Model,
        loss_fn: objective_lib.LossFn | None = None,
        x: np.ndarray | None = None,
        y: np.ndarray | None = None,
        config: config_lib.SandblasterConfig | None = None,
        *,
        portions: int | None = None,
        history: int | None = None,
        backup_tasks: bool | None = None,
        num_shards: int | None = None,
        portion_delay_fn: portion_lib.PortionDelayFn | None = None,
    ):
        if x is None or y is None:
            raise ValueError("Arguments `x` and `y` (the training set) are required.")
        if config is None:
            config = config_lib.SandblasterConfig()
        if not isinstance(config, config_lib.SandblasterConfig):
            raise checks.argument_error(
                "config", "a `SandblasterConfig` or None", config
            )
        overrides = {
            "portions": portions,
            "history": history,
            "backup_tasks": backup_tasks,
        }
        self.config = dataclasses.replace(
            config, **{k: v for k, v in overrides.items() if v is not None}
        )
        self.model = model
        self.objective = objective_lib.SandblasterObjective(
            strategy,
            model,
            loss_fn,
            x,
            y,
            portions=self.config.portions,
            backup_tasks=self.config.backup_tasks,
            num_shards=num_shards,
            portion_delay_fn=portion_delay_fn,
            stall_timeout_secs=self.config.stall_timeout_secs,
        )

    @property
    def stats(self) -> schedule.SandblasterStats:
        """The objective's `SandblasterStats`, summed over every `fit`."""
        return self.objective.stats

    def fit(
        self,
        max_iters: int | None = None,
        gtol: float = 1e-5,
        ftol: float = 2.220446049250313e-09,
        record_iterates: bool = False,
        model_dir: str | None = None,
        print_fn: Callable[[str], None] = console.echo,
    ) -> lbfgs.LbfgsResult:
        """Runs L-BFGS from the model's weights; leaves the result in the model.

        With `model_dir`, the L-BFGS state is checkpointed in
        `model_dir/sandblaster` every `config.checkpoint_every_iters`
        iterations and at the end, and a run that finds a checkpoint there
        resumes from it instead of the model's weights (it prints which): its
        iterates are those of a run that never stopped, and `max_iters` counts
        the iterations of all runs together, so a rerun after a chief loss
        ends where an uninterrupted run ends (`sandblaster.checkpoint`).

        Args:
          max_iters: most L-BFGS iterations; None means `config.max_iters`.
          gtol: see `lbfgs.minimize` (the default is SciPy L-BFGS-B's
            stopping rule).
          ftol: see `lbfgs.minimize` (the default is SciPy L-BFGS-B's
            stopping rule).
          record_iterates: see `lbfgs.minimize`.
          model_dir: where checkpoints go and are resumed from; None writes
            none.
          print_fn: where the lines go: the checkpoint resumed from, and
            every `config.log_every_iters` iterations `lbfgs iteration
            3/100: loss 0.412345, gradient norm 0.0123, 7 evaluations, 4.2 s`
            (the iteration and evaluations counted over all runs, as
            `max_iters`; the seconds since this `fit` started). Default:
            stdout, flushed.

        Returns:
          The `lbfgs.LbfgsResult`; its `x` is a `PsVector` on the ps.

        Raises:
          resume.RestoreError: the latest checkpoint in `model_dir` was written
            for another model or `history`, or does not restore exactly.
          errors.NonFiniteError: a state to checkpoint holds NaN or inf.
          TimeoutError: no work portion finished within
            `config.stall_timeout_secs` (no worker left to run them).
          RuntimeError: `objective.EVALUATION_ATTEMPTS` evaluations in a row
            lost gradient slots (workers restarting).
          paths.ModelDirInUseError: another process trains into `model_dir`
            (`paths.ModelDirLock`, held for the run).
        """
        with paths.model_dir_lock(model_dir, print_fn):
            return self._fit(
                max_iters, gtol, ftol, record_iterates, model_dir, print_fn
            )

    def _fit(self, max_iters, gtol, ftol, record_iterates, model_dir, print_fn):
        """`fit`, holding the model_dir's lock."""
        if max_iters is None:
            max_iters = self.config.max_iters
        ops, layout = self.objective.ops, self.objective.layout
        checkpointer, state = None, None
        if model_dir:
            checkpointer = checkpoint_lib.LbfgsCheckpointer(
                ops,
                paths.sandblaster_dir(model_dir),
                history=self.config.history,
                model=checkpoint_lib.describe_model(layout.variables),
                every_iters=self.config.checkpoint_every_iters,
            )
            state = checkpointer.restore(like=self.objective.grad)
            if state is not None:
                print_fn(
                    f"Resumed L-BFGS from {checkpointer.latest_checkpoint} at "
                    f"iteration {state.num_iters} (loss {state.loss:.6g})"
                )
        after = _after_iteration(
            checkpointer, self.config.log_every_iters, max_iters, print_fn
        )
        callback, saving = after, contextlib.nullcontext()
        if checkpointer:
            # A preemption's signal saves the iteration reached at the end
            # of the iteration in flight (`faults.preemption`).
            reached = [state]

            def save_at_signal() -> tuple[int, bool]:
                if reached[0] is None:  # No iteration yet, none restored.
                    return 0, False
                written = checkpointer.save(reached[0], force=True)
                return reached[0].num_iters, written is not None

            def after_or_save(state):
                reached[0] = state
                after(state)
                if preemption.requested():
                    preemption.save_and_stop(save_at_signal, "iteration")

            callback = after_or_save
            saving = preemption.saving(save_at_signal, unit="iteration")
        with saving:
            result = lbfgs.minimize(
                self.objective,
                None if state else ops.from_numpy(layout.read()),
                ops,
                m=self.config.history,
                max_iters=max_iters,
                gtol=gtol,
                ftol=ftol,
                record_iterates=record_iterates,
                initial_state=state,
                callback=callback,
                two_loop=self.config.two_loop,
            )
        if checkpointer:
            checkpointer.save(result.state, force=True)
        layout.write(ops.to_numpy(result.x))
        # Late backup losers still hold gradient slots; let them finish so the
        # counters are final and nothing runs after `fit` returns.
        self.objective.join()
        return result


def _after_iteration(checkpointer, log_every_iters, max_iters, print_fn):
    """`lbfgs.minimize`'s callback: the checkpoint (`checkpointer` or None) and
    the progress line of an iteration (see `SandblasterTrainer.fit`)."""
    start = time.monotonic()

    def after(state) -> None:
        if checkpointer is not None:
            checkpointer.save(state)
        if log_every_iters and state.num_iters % log_every_iters == 0:
            print_fn(
                f"lbfgs iteration {state.num_iters}/{max_iters}: loss "
                f"{state.loss:.6g}, gradient norm {state.grad_norm:.3g}, "
                f"{state.num_evals} evaluations, {time.monotonic() - start:.1f} s"
            )

    return after
