"""A line search for the strong Wolfe conditions, on a scalar function (pure).

Nocedal & Wright, Numerical Optimization, 2nd ed., Algorithms 3.5 (bracketing)
and 3.6 (zoom). `sandblaster.lbfgs.minimize` calls `wolfe_line_search` on
`phi(t) = f(x + t d)`; it sees only python floats, so in Sandblaster (Dean et al.
2012, section 4.2) it runs on the coordinator unchanged.

Example:

```python
def phi(t):  # f(x) = (x - 3)^2 from x = 0 along d = 1
  return (t - 3.0) ** 2, 2.0 * (t - 3.0)

line_search.wolfe_line_search(phi, phi0=9.0, dphi0=-6.0).step  # 1.0
```
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from tf_distbelief import checks

__all__ = ["LineSearchResult", "wolfe_line_search"]

# Growth factor of the trial step while bracketing (Nocedal & Wright, Algorithm
# 3.5 only asks for a larger step; doubling is what SciPy's `line_search` uses).
_EXPAND_FACTOR = 2.0

# A cubic-interpolated trial step is clipped to the middle 80% of the bracket, so
# each zoom iteration shrinks the bracket by at least 10% even when the cubic
# minimiser sits at an end. Clipping (rather than bisecting) keeps the trial near
# a minimiser at an end: when the clipped trial overshoots it, 90% of the bracket
# goes at once.
_CUBIC_SAFEGUARD = 0.1


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


def check_wolfe_constants(c1: float, c2: float) -> None:
    """Raises `ValueError` unless `0 < c1 < c2 < 1` (strong Wolfe conditions)."""
    if not 0.0 < c1 < c2 < 1.0:
        raise ValueError(
            "Arguments `c1` and `c2` must satisfy 0 < c1 < c2 < 1 (Nocedal & Wright "
            f"use c1=1e-4, c2=0.9). Received: c1={c1!r}, c2={c2!r}"
        )


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
        raise checks.argument_error("phi0", "finite", phi0)
    if not (math.isfinite(dphi0) and dphi0 < 0.0):
        raise checks.argument_error(
            "dphi0", "finite and negative (a descent direction)", dphi0
        )
    if not (math.isfinite(step0) and step0 > 0.0):
        raise checks.argument_error("step0", "finite and positive", step0)
    check_wolfe_constants(c1, c2)
    checks.check_int("max_evals", max_evals, 1)

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
