"""What L-BFGS carries from one iteration to the next, to resume a run (pure).

`lbfgs.minimize` keeps its whole state between two iterations in one
`LbfgsState`: the iterate, the gradient there and the `(s, y)` history as
backend vectors (`vector_ops.VectorOps` owns them: on the ps tasks in
Sandblaster, Dean et al. 2012, section 4.2), and a few python numbers. The
line search starts afresh at every iteration, so nothing of it is carried.

`minimize` hands the state to its `callback` after every iteration and takes
one back as `initial_state`: a run resumed from the state saved after
iteration `k` computes the same iterates as one that never stopped. Saving the
state (Sandblaster: `sandblaster.checkpoint`) is left to the caller.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Generic

import numpy as np

from tf_distbelief import checks
from tf_distbelief.sandblaster import vector_ops

__all__ = ["LbfgsState", "check_state"]


@dataclasses.dataclass
class LbfgsState(Generic[vector_ops.Vector]):
    """The state of `lbfgs.minimize` between two iterations.

    Nocedal & Wright, Algorithm 7.5: at iteration `k`, everything the next
    iteration reads. The vectors are handles of the run's `VectorOps`; the
    rest are python numbers.

    Attributes:
      x: the iterate `x_k`, `[n]`.
      grad: the gradient `g_k` at `x_k`, `[n]`.
      s_history: parameter differences `s_i = x_{i+1} - x_i`, oldest first, at
        most `m` vectors `[n]`.
      y_history: gradient differences `y_i = g_{i+1} - g_i`, same order and
        length as `s_history`.
      rho_history: `1 / s_i·y_i`, same order and length as `s_history`.
      gamma: scale of the next initial inverse Hessian, `s·y / y·y` of the
        newest pair (Nocedal & Wright, eq. 7.20); 1.0 before the first pair.
      loss: `f(x_k)`.
      grad_norm: `|g_k|`, Euclidean.
      num_iters: accepted steps so far, `k`.
      num_evals: calls to `fun_and_grad` so far, the one at `x_0` included.
      num_skipped_pairs: pairs the curvature rule left out so far.
      loss_history: `f(x_0), ..., f(x_k)`, `k + 1` floats; the last two decide
        the `ftol` stopping rule.
      step_history: accepted line-search steps, `k` floats.
      gram: the vector-free mode's dot products of the basis
        `[s_0 .. s_{p-1}, y_0 .. y_{p-1}, g]` (`two_loop.basis`),
        `[2p+1, 2p+1]` float64 NumPy, `p` the number of pairs; None in the
        `"vectors"` mode, or when not known yet (the vector-free mode then
        rebuilds it from the vectors with one `VectorOps.gram` call).
        Checkpointed with the state, so a resumed run reads the very numbers
        an uninterrupted one would.
    """

    x: vector_ops.Vector
    grad: vector_ops.Vector
    s_history: list
    y_history: list
    rho_history: list[float]
    gamma: float
    loss: float
    grad_norm: float
    num_iters: int
    num_evals: int
    num_skipped_pairs: int
    loss_history: list[float]
    step_history: list[float]
    gram: np.ndarray | None = None

    @property
    def num_pairs(self) -> int:
        """Number of `(s, y)` pairs in the history."""
        return len(self.rho_history)

    def copy(self, ops: vector_ops.VectorOps) -> LbfgsState:
        """A deep copy: an in-memory checkpoint (`callback` hands out the live
        state).

        Args:
          ops: the backend that owns the vectors; makes the copies.

        Returns:
          An `LbfgsState` with new vectors and new lists, equal to this one.
        """
        scalars = {
            name: list(value) if isinstance(value, list) else value
            for name, value in self.scalars().items()
        }
        return LbfgsState(
            x=ops.copy(self.x),
            grad=ops.copy(self.grad),
            s_history=[ops.copy(v) for v in self.s_history],
            y_history=[ops.copy(v) for v in self.y_history],
            gram=None if self.gram is None else np.array(self.gram),
            **scalars,
        )

    def scalars(self) -> dict:
        """The state's numbers (every field but the vectors and `gram`), by name."""
        vectors = ("x", "grad", "s_history", "y_history", "gram")
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in vectors
        }


def check_state(state: LbfgsState, m: int) -> None:
    """Raises unless `state` can continue a run whose memory is `m`.

    Args:
      state: the state to resume from.
      m: the memory of the run that resumes (`lbfgs.minimize`'s `m`).

    Raises:
      TypeError: `state` is not an `LbfgsState`.
      ValueError: naming the field: more pairs than `m`, histories of different
        lengths, counters that disagree with the histories, a `gram` not
        `[2p+1, 2p+1]`, or a number that is not finite (a state that no run
        of `minimize` leaves behind).
    """
    if not isinstance(state, LbfgsState):
        raise checks.argument_error(
            "initial_state",
            "an `LbfgsState` or None",
            state,
            shown=type(state).__name__,
        )
    lengths = (len(state.s_history), len(state.y_history), len(state.rho_history))
    if len(set(lengths)) != 1:
        raise ValueError(
            "Fields `s_history`, `y_history` and `rho_history` of `initial_state` "
            f"must have the same length. Received lengths: {lengths}"
        )
    if state.num_pairs > m:
        raise ValueError(
            f"Field `rho_history` of `initial_state` holds {state.num_pairs} pairs, "
            f"more than the memory `m`={m}: resume with the `m` of the run that "
            "wrote it."
        )
    if state.num_iters < 0 or len(state.loss_history) != state.num_iters + 1:
        raise ValueError(
            "Field `loss_history` of `initial_state` must hold `num_iters` + 1 "
            f"losses. Received {len(state.loss_history)} for num_iters="
            f"{state.num_iters}"
        )
    if len(state.step_history) != state.num_iters:
        raise ValueError(
            "Field `step_history` of `initial_state` must hold `num_iters` steps. "
            f"Received {len(state.step_history)} for num_iters={state.num_iters}"
        )
    if state.gram is not None:
        side = 2 * state.num_pairs + 1
        shape = np.shape(state.gram)
        if shape != (side, side):
            raise checks.argument_error(
                "initial_state",
                f"[2p+1, 2p+1] = [{side}, {side}] for its {state.num_pairs} pairs",
                shape,
                what="shape",
                field="gram",
            )
        if not np.all(np.isfinite(state.gram)):
            raise checks.argument_error(
                "initial_state", "finite", state.gram, field="gram"
            )
    numbers = {
        "loss": state.loss,
        "grad_norm": state.grad_norm,
        "gamma": state.gamma,
        **{f"rho_history[{i}]": r for i, r in enumerate(state.rho_history)},
    }
    for name, value in numbers.items():
        if not math.isfinite(value):
            raise checks.argument_error("initial_state", "finite", value, field=name)
