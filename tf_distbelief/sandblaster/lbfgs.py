"""L-BFGS written against an abstract vector space, for Sandblaster.

Sandblaster L-BFGS (Dean et al. 2012, section 4.2) runs the L-BFGS loop on a
coordinator that never holds the parameters: it issues a small set of vector
operations (dot product, scaling, axpy, element-wise add and multiply, copy) that
every parameter-server shard performs on its own slice, and it keeps only python
scalars. This module is that coordinator loop with the storage abstracted away:

* `VectorOps` is the vector-space interface. Vectors are opaque handles owned by
  the backend; every operation either returns a python `float` (`dot`) or
  overwrites a vector in place.
* `NumpyVectorOps` is the single-process backend (1-D NumPy arrays).
* `two_loop_recursion` computes `H_k g` from the stored `(s_i, y_i)` pairs
  (Nocedal & Wright, Numerical Optimization, 2nd ed., Algorithm 7.4).
* `wolfe_line_search` finds a step satisfying the strong Wolfe conditions on a
  scalar function (Nocedal & Wright, Algorithms 3.5 and 3.6).
* `minimize` is the driver (Nocedal & Wright, Algorithm 7.5).

Example:

```python
ops = lbfgs.NumpyVectorOps()

def fun_and_grad(x):
  return float(x @ x), 2.0 * x

result = lbfgs.minimize(fun_and_grad, ops.from_numpy(np.ones(3)), ops)
ops.to_numpy(result.x)  # ~[0, 0, 0]
```
"""

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = [
    "LbfgsResult",
    "LineSearchResult",
    "NumpyVectorOps",
    "VectorOps",
    "minimize",
    "two_loop_recursion",
    "wolfe_line_search",
]

Vector = TypeVar("Vector")

# A pair (s, y) enters the history only if s·y > _CURVATURE_EPS * |s| * |y|, i.e.
# the cosine of the angle between s and y exceeds 1e-10. For s·y <= 0 the BFGS
# update would lose positive definiteness; for a tiny positive s·y, rho = 1 / s·y
# blows up and rounding does the same. Under the strong Wolfe conditions
# s·y >= (1 - c2) |s·g| > 0 in exact arithmetic, so the rule only fires on
# rounding or on a line search that fell back to a step short of Wolfe.
_CURVATURE_EPS = 1e-10

# Growth factor of the trial step while bracketing (Nocedal & Wright, Algorithm
# 3.5 only asks for a larger step; doubling is what SciPy's `line_search` uses).
_EXPAND_FACTOR = 2.0

# A cubic-interpolated trial step is clipped to the middle 80% of the bracket, so
# each zoom iteration shrinks the bracket by at least 10% even when the cubic
# minimiser sits at an end. Clipping (rather than bisecting) keeps the trial near
# a minimiser at an end: when the clipped trial overshoots it, 90% of the bracket
# goes at once.
_CUBIC_SAFEGUARD = 0.1


class VectorOps(abc.ABC, Generic[Vector]):
    """Vector-space operations that L-BFGS needs, on vectors the backend owns.

    The algorithm never looks inside a vector. All in-place operations follow the
    BLAS convention: the last vector argument is overwritten, the others are read.
    Only `dot` returns data to the caller, and only a python `float`, so a backend
    that shards vectors over parameter servers moves one scalar per shard and
    operation (Dean et al. 2012, section 4.2).

    `from_numpy` and `to_numpy` move whole vectors and are meant for the initial
    point, results and tests, not for the inner loop.
    """

    @abc.abstractmethod
    def from_numpy(self, array: np.ndarray) -> Vector:
        """Returns a new vector holding the values of the 1-D `array`."""

    @abc.abstractmethod
    def to_numpy(self, x: Vector) -> np.ndarray:
        """Returns the values of `x` as a 1-D NumPy array."""

    @abc.abstractmethod
    def zeros_like(self, x: Vector) -> Vector:
        """Returns a new vector of zeros shaped and placed like `x`."""

    @abc.abstractmethod
    def copy(self, x: Vector) -> Vector:
        """Returns a new vector holding the values of `x`."""

    @abc.abstractmethod
    def assign(self, x: Vector, y: Vector) -> None:
        """Sets `y <- x`."""

    @abc.abstractmethod
    def dot(self, x: Vector, y: Vector) -> float:
        """Returns the inner product `x·y` as a python float."""

    @abc.abstractmethod
    def scale(self, alpha: float, x: Vector) -> None:
        """Sets `x <- alpha * x`."""

    @abc.abstractmethod
    def axpy(self, alpha: float, x: Vector, y: Vector) -> None:
        """Sets `y <- alpha * x + y`."""

    @abc.abstractmethod
    def add(self, x: Vector, y: Vector) -> None:
        """Sets `y <- x + y` element-wise."""

    @abc.abstractmethod
    def multiply(self, x: Vector, y: Vector) -> None:
        """Sets `y <- x * y` element-wise."""


class NumpyVectorOps(VectorOps[np.ndarray]):
    """`VectorOps` on 1-D NumPy arrays in one process.

    Args:
      dtype: floating dtype of the vectors. Defaults to float64, the precision
        L-BFGS tests are written for.

    Raises:
      TypeError: if `dtype` is not a floating dtype.
    """

    def __init__(self, dtype: Any = np.float64):
        dtype = np.dtype(dtype)
        if not np.issubdtype(dtype, np.floating):
            raise TypeError(
                f"Argument `dtype` must be a floating dtype. Received: {dtype}"
            )
        self._dtype = dtype

    def from_numpy(self, array: np.ndarray) -> np.ndarray:
        """Returns a copy of the 1-D `array` in this backend's dtype.

        Raises:
          ValueError: if `array` is not 1-D.
        """
        array = np.asarray(array)
        if array.ndim != 1:
            raise ValueError(
                "Argument `array` must be 1-D; flatten parameters into one vector. "
                f"Received shape: {array.shape}"
            )
        return np.array(array, dtype=self._dtype)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def zeros_like(self, x: np.ndarray) -> np.ndarray:
        return np.zeros_like(x)

    def copy(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def assign(self, x: np.ndarray, y: np.ndarray) -> None:
        y[...] = x

    def dot(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.dot(x, y))

    def scale(self, alpha: float, x: np.ndarray) -> None:
        x *= alpha

    def axpy(self, alpha: float, x: np.ndarray, y: np.ndarray) -> None:
        y += alpha * x

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        y += x

    def multiply(self, x: np.ndarray, y: np.ndarray) -> None:
        y *= x


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Argument `{name}` must be an int. Received: {value!r}")
    if value < minimum:
        rule = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"Argument `{name}` must be {rule}. Received: {value!r}")


def _check_nonnegative(name: str, value: Any) -> None:
    if not (isinstance(value, (int, float, np.floating)) and value >= 0):
        raise ValueError(
            f"Argument `{name}` must be a number >= 0. Received: {value!r}"
        )


def _check_wolfe_constants(c1: float, c2: float) -> None:
    if not 0.0 < c1 < c2 < 1.0:
        raise ValueError(
            "Arguments `c1` and `c2` must satisfy 0 < c1 < c2 < 1 (Nocedal & Wright "
            f"use c1=1e-4, c2=0.9). Received: c1={c1!r}, c2={c2!r}"
        )


def two_loop_recursion(
    ops: VectorOps[Vector],
    grad: Vector,
    s_history: Sequence[Vector],
    y_history: Sequence[Vector],
    rho_history: Sequence[float],
    gamma: float,
    out: Vector,
) -> None:
    """Sets `out <- H_k grad` by the L-BFGS two-loop recursion.

    Nocedal & Wright, Algorithm 7.4. With pairs `(s_i, y_i)`, `rho_i = 1 / s_i·y_i`
    for `i = k-m .. k-1` (oldest first) and `H_k^0 = gamma I`, `H_k` is the BFGS
    inverse-Hessian approximation

        H_{i+1} = (I - rho_i s_i y_i^T) H_i (I - rho_i y_i s_i^T) + rho_i s_i s_i^T,

    applied to `grad` without forming any matrix:

        q = grad
        for i = k-1 .. k-m:  a_i = rho_i s_i·q;  q = q - a_i y_i
        r = gamma q
        for i = k-m .. k-1:  b = rho_i y_i·r;    r = r + (a_i - b) s_i

    It costs `4 m` vector operations, `2 m` of them dot products (one scalar per
    shard each in Sandblaster, Dean et al. 2012, section 4.2).

    Args:
      ops: the vector backend.
      grad: the vector `g` to multiply; not modified.
      s_history: parameter differences `s_i = x_{i+1} - x_i`, oldest first.
      y_history: gradient differences `y_i = g_{i+1} - g_i`, oldest first.
      rho_history: `1 / s_i·y_i`, oldest first.
      gamma: scale of the initial inverse Hessian `H_k^0 = gamma I`; L-BFGS uses
        `s_{k-1}·y_{k-1} / y_{k-1}·y_{k-1}` (Nocedal & Wright, eq. 7.20).
      out: vector overwritten with `H_k grad`; must not alias `grad`.

    Raises:
      ValueError: if the three histories differ in length.
    """
    if not len(s_history) == len(y_history) == len(rho_history):
        raise ValueError(
            "Arguments `s_history`, `y_history` and `rho_history` must have the same "
            f"length. Received lengths: {len(s_history)}, {len(y_history)}, "
            f"{len(rho_history)}"
        )
    ops.assign(grad, out)
    alphas = [0.0] * len(s_history)
    for i in reversed(range(len(s_history))):
        alphas[i] = rho_history[i] * ops.dot(s_history[i], out)
        ops.axpy(-alphas[i], y_history[i], out)
    ops.scale(gamma, out)
    for i in range(len(s_history)):
        beta = rho_history[i] * ops.dot(y_history[i], out)
        ops.axpy(alphas[i] - beta, s_history[i], out)


@dataclasses.dataclass(frozen=True)
class LineSearchResult:
    """Outcome of `wolfe_line_search`.

    Attributes:
      step: the step `t` returned; `0.0` if no point with sufficient decrease was
        found.
      phi: `phi(step)`.
      dphi: `phi'(step)`.
      num_evals: number of calls to `phi`, non-finite trials included.
      success: True if `step` satisfies both strong Wolfe conditions. If False and
        `step > 0`, `step` satisfies the sufficient-decrease condition only.
    """

    step: float
    phi: float
    dphi: float
    num_evals: int
    success: bool


def _interpolate(lo: tuple, hi: tuple) -> float:
    """Safeguarded cubic minimiser on the bracket (Nocedal & Wright, eq. 3.59)."""
    (t_lo, p_lo, dp_lo), (t_hi, p_hi, dp_hi) = lo, hi
    midpoint = 0.5 * (t_lo + t_hi)
    if not (math.isfinite(p_hi) and math.isfinite(dp_hi)):
        return midpoint
    with np.errstate(all="ignore"):
        d1 = dp_lo + dp_hi - 3.0 * (p_lo - p_hi) / (t_lo - t_hi)
        radicand = d1 * d1 - dp_lo * dp_hi
        if radicand < 0.0:
            return midpoint
        d2 = math.copysign(math.sqrt(radicand), t_hi - t_lo)
        denominator = dp_hi - dp_lo + 2.0 * d2
        if denominator == 0.0:
            return midpoint
        t = t_hi - (t_hi - t_lo) * (dp_hi + d2 - d1) / denominator
    if not math.isfinite(t):
        return midpoint
    margin = _CUBIC_SAFEGUARD * abs(t_hi - t_lo)
    return min(max(t, min(t_lo, t_hi) + margin), max(t_lo, t_hi) - margin)


def wolfe_line_search(
    phi: Callable[[float], tuple[float, float]],
    phi0: float,
    dphi0: float,
    step0: float = 1.0,
    c1: float = 1e-4,
    c2: float = 0.9,
    max_evals: int = 25,
) -> LineSearchResult:
    """Finds a step `t > 0` satisfying the strong Wolfe conditions.

    Nocedal & Wright, Algorithm 3.5 (bracketing) and 3.6 (zoom). With
    `phi(t) = f(x + t d)` and a descent direction (`phi'(0) < 0`) the returned step
    satisfies

        phi(t) <= phi(0) + c1 t phi'(0)       (sufficient decrease)
        |phi'(t)| <= c2 |phi'(0)|              (curvature)

    Bracketing tries `step0, 2 step0, 4 step0, ...` until a trial fails sufficient
    decrease, does not decrease `phi`, or has `phi'(t) >= 0`; zoom then shrinks the
    bracket by the minimiser of the cubic interpolating `phi` and `phi'` at both
    ends, clipped to the middle 80% of the bracket; it bisects instead when the
    cubic has no minimiser or the far end is non-finite.

    A trial whose `phi` or `phi'` is not finite (a loss of inf or nan, or a
    gradient with an inf or nan entry) is never accepted: it is treated as "step too
    long", so the step is halved toward the last finite trial with sufficient
    decrease and tried again.

    Args:
      phi: maps a step `t` to `(phi(t), phi'(t))` as floats.
      phi0: `phi(0)`, finite.
      dphi0: `phi'(0)`, finite and negative.
      step0: first trial step, positive. Quasi-Newton methods use 1.
      c1: sufficient-decrease constant; Nocedal & Wright recommend 1e-4.
      c2: curvature constant, `c1 < c2 < 1`; 0.9 for quasi-Newton methods.
      max_evals: most calls to `phi`.

    Returns:
      A `LineSearchResult`. If no Wolfe step is found within `max_evals`, the
      finite trial with sufficient decrease and the lowest `phi` (`0.0` if there
      is none), with `success=False`.

    Raises:
      ValueError: on a non-finite `phi0`, a `dphi0` that is not negative, a
        `step0` that is not positive, or constants outside `0 < c1 < c2 < 1`.
      TypeError: if `max_evals` is not an int.
    """
    if not math.isfinite(phi0):
        raise ValueError(f"Argument `phi0` must be finite. Received: {phi0!r}")
    if not (math.isfinite(dphi0) and dphi0 < 0.0):
        raise ValueError(
            "Argument `dphi0` must be finite and negative (a descent direction). "
            f"Received: {dphi0!r}"
        )
    if not (math.isfinite(step0) and step0 > 0.0):
        raise ValueError(
            f"Argument `step0` must be finite and positive. Received: {step0!r}"
        )
    _check_wolfe_constants(c1, c2)
    _check_int("max_evals", max_evals, 1)

    num_evals = 0

    def evaluate(t: float) -> tuple[float, float, bool]:
        nonlocal num_evals
        num_evals += 1
        p, dp = phi(t)
        p, dp = float(p), float(dp)
        return p, dp, math.isfinite(p) and math.isfinite(dp)

    def too_long(t: float, p: float, finite: bool, p_ref: float) -> bool:
        return not finite or p > phi0 + c1 * t * dphi0 or p >= p_ref

    def result(point: tuple, success: bool) -> LineSearchResult:
        return LineSearchResult(point[0], point[1], point[2], num_evals, success)

    def zoom(lo: tuple, hi: tuple) -> LineSearchResult:
        # Invariants (Nocedal & Wright, section 3.5): `lo` is finite, has sufficient
        # decrease and the lowest phi so far; phi'(lo) (hi - lo) < 0.
        while num_evals < max_evals:
            t = _interpolate(lo, hi)
            if not min(lo[0], hi[0]) < t < max(lo[0], hi[0]):
                break  # The bracket has shrunk below rounding.
            p, dp, finite = evaluate(t)
            if too_long(t, p, finite, lo[1]):
                hi = (t, p, dp)
                continue
            if abs(dp) <= -c2 * dphi0:
                return result((t, p, dp), True)
            if dp * (hi[0] - lo[0]) >= 0.0:
                hi = lo
            lo = (t, p, dp)
        return result(lo, False)

    prev = (0.0, phi0, dphi0)
    t = step0
    while num_evals < max_evals:
        p, dp, finite = evaluate(t)
        p_ref = prev[1] if num_evals > 1 else math.inf
        if too_long(t, p, finite, p_ref):
            return zoom(prev, (t, p, dp))
        if abs(dp) <= -c2 * dphi0:
            return result((t, p, dp), True)
        if dp >= 0.0:
            return zoom((t, p, dp), prev)
        prev = (t, p, dp)
        t *= _EXPAND_FACTOR
    return result(prev, False)


@dataclasses.dataclass
class LbfgsResult(Generic[Vector]):
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
        called with `record_iterates=True`, else empty.
    """

    x: Vector
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


def minimize(
    fun_and_grad: Callable[[Vector], tuple[float, Vector]],
    x0: Vector,
    ops: VectorOps[Vector],
    m: int = 10,
    max_iters: int = 100,
    gtol: float = 1e-5,
    ftol: float = 2.220446049250313e-09,
    c1: float = 1e-4,
    c2: float = 0.9,
    max_line_search_evals: int = 25,
    record_iterates: bool = False,
) -> LbfgsResult[Vector]:
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
    search finds no step with sufficient decrease.

    The backend holds `2 m + 7` vectors; the algorithm itself holds only floats.

    Args:
      fun_and_grad: maps a vector `x` (read-only) to `(loss, grad)`: the loss as a
        float and the gradient as a backend vector. `minimize` copies `grad` before
        the next call, so the callback may reuse one gradient buffer. A non-finite
        loss or gradient marks `x` as outside the domain.
      x0: starting point; not modified.
      ops: the vector backend that owns `x0` and the gradients.
      m: number of `(s, y)` pairs kept. Nocedal & Wright suggest 3 to 20.
      max_iters: most accepted steps.
      gtol: stop when the Euclidean gradient norm is at most this.
      ftol: stop when the relative loss decrease of a step is at most this.
      c1: sufficient-decrease constant of the line search.
      c2: curvature constant of the line search.
      max_line_search_evals: most loss evaluations per line search.
      record_iterates: if True, keep every iterate as a NumPy array in
        `iterate_history` (moves whole vectors; for tests).

    Returns:
      An `LbfgsResult`.

    Raises:
      TypeError: if `ops` is not a `VectorOps`, `fun_and_grad` is not callable, or
        an integer argument is not an int.
      ValueError: on an argument out of range, or a non-finite loss or gradient at
        `x0`.
    """
    if not isinstance(ops, VectorOps):
        raise TypeError(
            f"Argument `ops` must be a `VectorOps`. Received: {type(ops).__name__}"
        )
    if not callable(fun_and_grad):
        raise TypeError(
            f"Argument `fun_and_grad` must be callable. Received: {fun_and_grad!r}"
        )
    _check_int("m", m, 1)
    _check_int("max_iters", max_iters, 0)
    _check_int("max_line_search_evals", max_line_search_evals, 1)
    _check_nonnegative("gtol", gtol)
    _check_nonnegative("ftol", ftol)
    _check_wolfe_constants(c1, c2)

    x = ops.copy(x0)
    loss, grad = fun_and_grad(x)
    loss = float(loss)
    g = ops.copy(grad)
    grad_norm_sq = ops.dot(g, g)
    if not (math.isfinite(loss) and math.isfinite(grad_norm_sq)):
        raise ValueError(
            "Argument `x0` must be a point where `fun_and_grad` is finite. Received "
            f"loss {loss!r} and squared gradient norm {grad_norm_sq!r}"
        )
    grad_norm = math.sqrt(grad_norm_sq)
    num_evals = 1

    d, x_trial, g_trial = ops.zeros_like(x), ops.zeros_like(x), ops.zeros_like(x)
    s_new, y_new = ops.zeros_like(x), ops.zeros_like(x)
    s_history: list = []
    y_history: list = []
    rho_history: list[float] = []
    gamma = 1.0
    num_skipped_pairs = 0
    loss_history, step_history = [loss], []
    iterate_history = [ops.to_numpy(x)] if record_iterates else []
    last_trial_step = math.nan

    def phi(t: float) -> tuple[float, float]:
        nonlocal last_trial_step
        last_trial_step = t
        ops.assign(x, x_trial)
        ops.axpy(t, d, x_trial)
        trial_loss, trial_grad = fun_and_grad(x_trial)
        ops.assign(trial_grad, g_trial)
        return float(trial_loss), ops.dot(g_trial, d)

    num_iters = 0
    converged, message = False, f"reached `max_iters`={max_iters}"
    while True:
        if grad_norm <= gtol:
            converged, message = True, f"gradient norm {grad_norm:.3g} <= `gtol`"
            break
        if num_iters >= max_iters:
            break
        dphi0 = math.nan
        if s_history:
            two_loop_recursion(ops, g, s_history, y_history, rho_history, gamma, d)
            ops.scale(-1.0, d)
            dphi0 = ops.dot(g, d)
        if not dphi0 < 0.0:
            # No history yet, or rounding made -H g fail to be a descent direction:
            # restart from steepest descent with an empty history.
            s_history.clear()
            y_history.clear()
            rho_history.clear()
            ops.assign(g, d)
            ops.scale(-1.0, d)
            dphi0 = -grad_norm * grad_norm
        step0 = 1.0 if s_history else min(1.0, 1.0 / grad_norm)

        search = wolfe_line_search(
            phi, loss, dphi0, step0, c1, c2, max_line_search_evals
        )
        num_evals += search.num_evals
        if search.step <= 0.0:
            message = "line search found no step with sufficient decrease"
            break
        if search.step != last_trial_step:
            # The search fell back to an earlier trial: recompute its point and
            # gradient.
            phi(search.step)
            num_evals += 1

        ops.assign(x_trial, s_new)
        ops.axpy(-1.0, x, s_new)
        ops.assign(g_trial, y_new)
        ops.axpy(-1.0, g, y_new)
        sy, yy, ss = ops.dot(s_new, y_new), ops.dot(y_new, y_new), ops.dot(s_new, s_new)
        if sy > _CURVATURE_EPS * math.sqrt(ss * yy):
            if len(s_history) == m:
                s_new_next, y_new_next = s_history.pop(0), y_history.pop(0)
                rho_history.pop(0)
            else:
                s_new_next, y_new_next = ops.zeros_like(x), ops.zeros_like(x)
            s_history.append(s_new)
            y_history.append(y_new)
            rho_history.append(1.0 / sy)
            s_new, y_new = s_new_next, y_new_next
            gamma = sy / yy
        else:
            num_skipped_pairs += 1

        previous_loss, loss = loss, search.phi
        x, x_trial = x_trial, x
        g, g_trial = g_trial, g
        grad_norm = math.sqrt(ops.dot(g, g))
        num_iters += 1
        loss_history.append(loss)
        step_history.append(search.step)
        if record_iterates:
            iterate_history.append(ops.to_numpy(x))
        if (previous_loss - loss) <= ftol * max(abs(previous_loss), abs(loss), 1.0):
            converged, message = True, "relative loss decrease <= `ftol`"
            break

    return LbfgsResult(
        x=x,
        loss=loss,
        grad_norm=grad_norm,
        num_iters=num_iters,
        num_evals=num_evals,
        num_skipped_pairs=num_skipped_pairs,
        converged=converged,
        message=message,
        loss_history=loss_history,
        step_history=step_history,
        iterate_history=iterate_history,
    )
