"""L-BFGS written against an abstract vector space, for Sandblaster.

Sandblaster L-BFGS (Dean et al. 2012, section 4.2) runs the L-BFGS loop on a
coordinator that never holds the parameters: it issues a small set of vector
operations (dot product, scaling, axpy, element-wise add and multiply, copy) that
every parameter-server shard performs on its own slice, and it keeps only python
scalars. This module is that coordinator loop with the storage abstracted away:

* `minimize` is the driver (Nocedal & Wright, Algorithm 7.5). Its state
  between iterations is an `lbfgs_state.LbfgsState`: handed to a `callback`
  after every iteration, taken back as `initial_state` to resume a run exactly.

It works through the modules beside it, each the one import path of its names:

* `vector_ops.VectorOps` is the vector-space interface and
  `vector_ops.NumpyVectorOps` its single-process backend.
* `two_loop.two_loop_recursion` computes `H_k g` from the stored `(s_i, y_i)`
  pairs (Nocedal & Wright, Numerical Optimization, 2nd ed., Algorithm 7.4); by
  default `minimize` runs it vector-free on their dot products (Chen, Wang
  and Zhou, NIPS 2014), a few calls per iteration instead of `4 m`
  (`two_loop.TWO_LOOPS`).
* `line_search.wolfe_line_search` finds a step satisfying the strong Wolfe
  conditions on a scalar function (Nocedal & Wright, Algorithms 3.5 and 3.6).

The memory of L-BFGS, the number of `(s, y)` pairs kept, is `m` here, Nocedal &
Wright's symbol; the Sandblaster layers above call it `history`
(`SandblasterConfig.history`).

Example:

```python
ops = vector_ops.NumpyVectorOps()

def fun_and_grad(x):
  return float(x @ x), 2.0 * x

result = lbfgs.minimize(fun_and_grad, ops.from_numpy(np.ones(3)), ops)
ops.to_numpy(result.x)  # ~[0, 0, 0]
```
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Generic

import numpy as np

from tf_distbelief import checks
from tf_distbelief.sandblaster import lbfgs_state, line_search, vector_ops
from tf_distbelief.sandblaster import two_loop as two_loop_lib

__all__ = ["LbfgsResult", "minimize"]

# A pair (s, y) enters the history only if s·y > _CURVATURE_EPS * |s| * |y|, i.e.
# the cosine of the angle between s and y exceeds 1e-10. For s·y <= 0 the BFGS
# update would lose positive definiteness; for a tiny positive s·y, rho = 1 / s·y
# blows up and rounding does the same. Under the strong Wolfe conditions
# s·y >= (1 - c2) |s·g| > 0 in exact arithmetic, so the rule only fires on
# rounding or on a line search that fell back to a step short of Wolfe.
_CURVATURE_EPS = 1e-10


@dataclasses.dataclass
class LbfgsResult(Generic[vector_ops.Vector]):
    """Outcome of `minimize`.

    Attributes:
      x: the final iterate, a backend vector owned by the caller.
      loss: loss at `x`.
      grad_norm: Euclidean norm of the gradient at `x`.
      num_iters: number of accepted steps.
      num_evals: number of calls to `fun_and_grad`, the one at `x0` included.
      num_skipped_pairs: `(s, y)` pairs left out of the history by the curvature
        rule.
      converged: True if `gtol` or `ftol` stopped the run.
      message: why the run stopped.
      loss_history: losses at `x0, x_1, ..., x`, `num_iters + 1` floats.
      step_history: accepted line-search steps, `num_iters` floats.
      iterate_history: `x0, x_1, ..., x` as 1-D NumPy arrays if `minimize` was
        called with `record_iterates=True`, else empty; from a resumed run, the
        iterates from the resumed one on.
      state: the final `LbfgsState` (its `x` is `x`); pass it as
        `initial_state` to go on.
    """

    x: vector_ops.Vector
    loss: float
    grad_norm: float
    num_iters: int
    num_evals: int
    num_skipped_pairs: int
    converged: bool
    message: str
    loss_history: list[float]
    step_history: list[float]
    iterate_history: list[np.ndarray]
    state: lbfgs_state.LbfgsState | None = None


def minimize(
    fun_and_grad: Callable[[vector_ops.Vector], tuple[float, vector_ops.Vector]],
    x0: vector_ops.Vector | None,
    ops: vector_ops.VectorOps[vector_ops.Vector],
    m: int = 10,
    max_iters: int = 100,
    gtol: float = 1e-5,
    ftol: float = 2.220446049250313e-09,
    c1: float = 1e-4,
    c2: float = 0.9,
    max_line_search_evals: int = 25,
    record_iterates: bool = False,
    initial_state: lbfgs_state.LbfgsState | None = None,
    callback: Callable[[lbfgs_state.LbfgsState], None] | None = None,
    two_loop: str = "vector_free",
) -> LbfgsResult[vector_ops.Vector]:
    """Minimises a smooth function by L-BFGS with a strong Wolfe line search.

    Nocedal & Wright, Algorithm 7.5; the coordinator loop of Sandblaster L-BFGS
    (Dean et al. 2012, section 4.2). Each iteration

        d_k = -H_k g_k                          (`two_loop_recursion`)
        t_k = strong Wolfe step along d_k        (`wolfe_line_search`)
        x_{k+1} = x_k + t_k d_k
        s_k = x_{k+1} - x_k,  y_k = g_{k+1} - g_k,  rho_k = 1 / s_k·y_k

    with `H_k^0 = gamma_k I`, `gamma_k = s_{k-1}·y_{k-1} / y_{k-1}·y_{k-1}`. The last
    `m` pairs are kept as backend vectors; the oldest is evicted (its storage
    reused). A pair is skipped if `s_k·y_k <= 1e-10 |s_k| |y_k|` (curvature too
    small for a positive-definite update). With no pairs (the first iteration, or
    after a direction that is not a descent direction resets the history),
    `d = -g` and the first trial step is `min(1, 1/|g|)`, as in SciPy's L-BFGS-B;
    otherwise it is 1.

    The run stops when `|g| <= gtol`, when
    `(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1) <= ftol` (SciPy's L-BFGS-B rule and
    default, 1e7 times float64 epsilon), after `max_iters` steps, or when the line
    search finds no step with sufficient decrease. Each rule reads only the
    `LbfgsState` (the `ftol` rule the last two entries of its `loss_history`),
    so a run resumed from the state after iteration `k` (`initial_state`)
    computes the same iterates, and stops where, as one that never stopped;
    `max_iters` counts the iterations of both runs together.

    The backend holds `2 m + 7` vectors; the algorithm itself holds only
    floats (and, vector-free, the `(2m+1) x (2m+1)` dot products of the
    history and the gradient, `LbfgsState.gram`).

    Args:
      fun_and_grad: maps a vector `x` (read-only) to `(loss, grad)`: the loss as a
        float and the gradient as a backend vector. `minimize` copies `grad` before
        the next call, so the callback may reuse one gradient buffer. A non-finite
        loss or gradient marks `x` as outside the domain.
      x0: starting point; not modified. Ignored (may be None) with
        `initial_state`.
      ops: the vector backend that owns `x0` and the gradients.
      m: the memory, the number of `(s, y)` pairs kept (Sandblaster's
        `history`). Nocedal & Wright suggest 3 to 20.
      max_iters: most accepted steps.
      gtol: stop when the Euclidean gradient norm is at most this.
      ftol: stop when the relative loss decrease of a step is at most this.
      c1: sufficient-decrease constant of the line search.
      c2: curvature constant of the line search.
      max_line_search_evals: most loss evaluations per line search.
      record_iterates: if True, keep every iterate as a NumPy array in
        `iterate_history` (moves whole vectors; for tests).
      initial_state: if given, the run goes on from this `LbfgsState` (one that
        `callback` or `LbfgsResult.state` handed out, or one restored from a
        checkpoint) instead of evaluating `x0`; its vectors are taken over and
        overwritten.
      callback: called with the `LbfgsState` after every iteration (to write a
        checkpoint, say). The state is live: read it, and copy what must
        outlive the call; changing it changes the run.
      two_loop: how the vector work runs (`sandblaster.two_loop`):
        `"vector_free"` (default; Chen, Wang and Zhou, NIPS 2014) calls the
        backend twice per iteration plus twice per line-search evaluation;
        `"vectors"` runs `two_loop_recursion` on the vectors, about `4 m + 12`
        calls per iteration plus 4 per evaluation. The iterates agree up to
        rounding.

    Returns:
      An `LbfgsResult`.

    Raises:
      TypeError: if `ops` is not a `VectorOps`, `fun_and_grad` is not callable, or
        an integer argument is not an int.
      ValueError: on an argument out of range, a `two_loop` not in
        `TWO_LOOPS`, a non-finite loss or gradient at
        `x0`, or an `initial_state` that `lbfgs_state.check_state` rejects (more
        pairs than `m`, say).
    """
    checks.check_instance(
        "ops",
        ops,
        vector_ops.VectorOps,
        "a `VectorOps`",
        shown=lambda v: type(v).__name__,
    )
    checks.check_callable("fun_and_grad", fun_and_grad)
    checks.check_int("m", m, 1)
    checks.check_int("max_iters", max_iters, 0)
    checks.check_int("max_line_search_evals", max_line_search_evals, 1)
    checks.check_nonnegative("gtol", gtol)
    checks.check_nonnegative("ftol", ftol)
    line_search.check_wolfe_constants(c1, c2)
    if two_loop not in two_loop_lib.TWO_LOOPS:
        raise checks.argument_error(
            "two_loop", f"one of {two_loop_lib.TWO_LOOPS}", two_loop
        )

    checks.check_callable("callback", callback, allow_none=True)
    if initial_state is None:
        state = _start(fun_and_grad, x0, ops)
    else:
        lbfgs_state.check_state(initial_state, m)
        state = initial_state
    vector_work = two_loop_lib.make(two_loop, ops, state, m)

    d, x_trial, g_trial = (ops.zeros_like(state.x) for _ in range(3))
    s_new, y_new = ops.zeros_like(state.x), ops.zeros_like(state.x)
    iterate_history = [ops.to_numpy(state.x)] if record_iterates else []
    last_trial_step = math.nan

    def phi(t: float) -> tuple[float, float]:
        nonlocal last_trial_step
        last_trial_step = t
        vector_work.trial_point(state, t, d, x_trial)
        trial_loss, trial_grad = fun_and_grad(x_trial)
        return float(trial_loss), vector_work.slope(trial_grad, g_trial, d)

    converged, message = False, f"reached `max_iters`={max_iters}"
    while True:
        # Every stopping rule reads only `state`, so a run resumed from the
        # state after any iteration stops where an uninterrupted one does.
        if state.num_iters > 0:
            previous_loss, loss = state.loss_history[-2:]
            if (previous_loss - loss) <= ftol * max(abs(previous_loss), abs(loss), 1.0):
                converged, message = True, "relative loss decrease <= `ftol`"
                break
        if state.grad_norm <= gtol:
            converged = True
            message = f"gradient norm {state.grad_norm:.3g} <= `gtol`"
            break
        if state.num_iters >= max_iters:
            break
        dphi0 = vector_work.direction(state, d)
        s_history, y_history = state.s_history, state.y_history
        rho_history = state.rho_history
        step0 = 1.0 if s_history else min(1.0, 1.0 / state.grad_norm)

        search = line_search.wolfe_line_search(
            phi, state.loss, dphi0, step0, c1, c2, max_line_search_evals
        )
        state.num_evals += search.num_evals
        if search.step <= 0.0:
            message = "line search found no step with sufficient decrease"
            break
        if search.step != last_trial_step:
            # The search fell back to an earlier trial: recompute its point and
            # gradient.
            phi(search.step)
            state.num_evals += 1

        sy, yy, ss = vector_work.new_pair(state, x_trial, g_trial, s_new, y_new)
        keep_pair = sy > _CURVATURE_EPS * math.sqrt(ss * yy)
        evict = keep_pair and len(s_history) == m
        if keep_pair:
            if evict:
                s_new_next, y_new_next = s_history.pop(0), y_history.pop(0)
                rho_history.pop(0)
            else:
                s_new_next = vector_work.storage(state)
                y_new_next = vector_work.storage(state)
            s_history.append(s_new)
            y_history.append(y_new)
            rho_history.append(1.0 / sy)
            s_new, y_new = s_new_next, y_new_next
            state.gamma = sy / yy
        else:
            state.num_skipped_pairs += 1

        state.x, x_trial = x_trial, state.x
        state.grad, g_trial = g_trial, state.grad
        state.loss = search.phi
        state.grad_norm = math.sqrt(vector_work.stepped(state, keep_pair, evict))
        state.num_iters += 1
        state.loss_history.append(state.loss)
        state.step_history.append(search.step)
        if record_iterates:
            iterate_history.append(ops.to_numpy(state.x))
        if callback is not None:
            callback(state)

    return LbfgsResult(
        x=state.x,
        loss=state.loss,
        grad_norm=state.grad_norm,
        num_iters=state.num_iters,
        num_evals=state.num_evals,
        num_skipped_pairs=state.num_skipped_pairs,
        converged=converged,
        message=message,
        loss_history=list(state.loss_history),
        step_history=list(state.step_history),
        iterate_history=iterate_history,
        state=state,
    )


def _start(fun_and_grad, x0, ops: vector_ops.VectorOps) -> lbfgs_state.LbfgsState:
    """The state at `x0`: one evaluation, an empty history."""
    if x0 is None:
        raise ValueError(
            "Argument `x0` is required unless `initial_state` is given. Received: None"
        )
    x = ops.copy(x0)
    loss, grad = fun_and_grad(x)
    loss = float(loss)
    g = ops.copy(grad)
    grad_norm_sq = ops.dot(g, g)
    if not (math.isfinite(loss) and math.isfinite(grad_norm_sq)):
        raise checks.argument_error(
            "x0",
            "a point where `fun_and_grad` is finite",
            x0,
            described=f"loss {loss!r} and squared gradient norm {grad_norm_sq!r}",
        )
    return lbfgs_state.LbfgsState(
        x=x,
        grad=g,
        s_history=[],
        y_history=[],
        rho_history=[],
        gamma=1.0,
        loss=loss,
        grad_norm=math.sqrt(grad_norm_sq),
        num_iters=0,
        num_evals=1,
        num_skipped_pairs=0,
        loss_history=[loss],
        step_history=[],
    )
