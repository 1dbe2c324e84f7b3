"""The L-BFGS two-loop recursion, on vectors or vector-free (pure).

`lbfgs.minimize` needs, each iteration, the direction `d = -H_k g_k`
(Nocedal & Wright, Numerical Optimization, 2nd ed., Algorithm 7.4), the slope
`g·d` at each line-search trial, and the dot products of the new `(s, y)`
pair. This module does that vector work in one of two ways (`TWO_LOOPS`):

* `"vectors"`: `two_loop_recursion` on the vectors themselves, `4 m` vector
  operations, each a round trip to the ps in Sandblaster (Dean et al. 2012,
  section 4.2); about `4 m + 12` round trips per iteration plus 4 per
  line-search evaluation.
* `"vector_free"` (Chen, Wang and Zhou, "Large-scale L-BFGS using MapReduce",
  NIPS 2014): `d` is a linear combination of the `2 m + 1` basis vectors
  `b = [s_0 .. s_{p-1}, y_0 .. y_{p-1}, g]`. The coordinator keeps their
  `(2p+1) x (2p+1)` dot-product matrix `B_ij = b_i·b_j` (`LbfgsState.gram`),
  runs the recursion on it in float64 NumPy (`two_loop_coefficients`), and
  the backend forms `d` from the `2p+1` coefficients in one call
  (`VectorOps.combine`). Each step adds only the `3 (2p + 3)` dot products of
  the new `s`, `y` and `g` (`VectorOps.gram`, one call that also forms `s` and
  `y`; `O(m)` of them, never the whole matrix again). So an iteration costs
  2 round trips plus 2 per line-search evaluation (form the trial point;
  copy its gradient and read `g·d`).

Both give the same iterates up to rounding: the recursion is the same
arithmetic on the same numbers, only summed in another order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tf_distbelief import checks
from tf_distbelief.sandblaster import lbfgs_state, vector_ops

__all__ = [
    "TWO_LOOPS",
    "VectorFreeTwoLoop",
    "VectorTwoLoop",
    "extend_gram",
    "make",
    "two_loop_coefficients",
    "two_loop_recursion",
]


# The ways to run the recursion; `SandblasterConfig.two_loop`, `--lbfgs_two_loop`.
TWO_LOOPS = ("vector_free", "vectors")


def two_loop_recursion(
    ops: vector_ops.VectorOps[vector_ops.Vector],
    grad: vector_ops.Vector,
    s_history: Sequence[vector_ops.Vector],
    y_history: Sequence[vector_ops.Vector],
    rho_history: Sequence[float],
    gamma: float,
    out: vector_ops.Vector,
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


def two_loop_coefficients(
    gram: np.ndarray, rho_history: Sequence[float], gamma: float
) -> np.ndarray:
    """Coefficients `c` with `H_k g = sum_j c_j b_j`: the vector-free recursion.

    Chen, Wang and Zhou (NIPS 2014), Algorithm 3: `two_loop_recursion` run on
    coefficient vectors over the basis `b = [s_0 .. s_{p-1}, y_0 .. y_{p-1}, g]`,
    where every dot product `u·v` of two combinations is `u^T B v`:

        c = e_g
        for i = p-1 .. 0:  a_i = rho_i B[s_i]·c;  c[y_i] -= a_i
        c = gamma c
        for i = 0 .. p-1:  b = rho_i B[y_i]·c;    c[s_i] += a_i - b

    Args:
      gram: `[2p+1, 2p+1]` float64, `gram[i, j] = b_i·b_j`.
      rho_history: `p` floats, `1 / s_i·y_i`, oldest first.
      gamma: scale of `H_k^0 = gamma I`.

    Returns:
      `[2p+1]` float64 coefficients.

    Raises:
      ValueError: `gram` is not `[2p+1, 2p+1]` for `p = len(rho_history)`.
    """
    p = len(rho_history)
    gram = np.asarray(gram, np.float64)
    if gram.shape != (2 * p + 1, 2 * p + 1):
        raise checks.argument_error(
            "gram",
            f"[2p+1, 2p+1] = [{2 * p + 1}, {2 * p + 1}] for p={p} pairs",
            gram.shape,
            what="shape",
        )
    c = np.zeros(2 * p + 1)
    c[2 * p] = 1.0
    alphas = np.zeros(p)
    for i in reversed(range(p)):
        alphas[i] = rho_history[i] * float(gram[i] @ c)
        c[p + i] -= alphas[i]
    c *= gamma
    for i in range(p):
        beta = rho_history[i] * float(gram[p + i] @ c)
        c[i] += alphas[i] - beta
    return c


def extend_gram(
    gram: np.ndarray, new_rows: np.ndarray, keep_pair: bool, evict: bool
) -> np.ndarray:
    """The dot-product matrix of the basis after a step, from the new dot products.

    Args:
      gram: `[2p+1, 2p+1]`, the matrix of `[s_0 .. s_{p-1}, y_0 .. y_{p-1}, g]`.
      new_rows: `[3, 2p+3]`, the dot products of the new `s`, `y` and `g` (rows)
        with `[s_0 .. s_{p-1}, y_0 .. y_{p-1}, s, y, g]` (columns).
      keep_pair: the new pair enters the history.
      evict: the oldest pair leaves it (with `keep_pair`, at memory `m`).

    Returns:
      The matrix of the new basis: `[2q+1, 2q+1]` float64, symmetric, with `q`
      pairs after the step (the 3x3 block of the new vectors taken from its
      upper triangle).
    """
    p = (gram.shape[0] - 1) // 2
    n = 2 * p + 3
    ext = np.empty((n, n))
    ext[: 2 * p, : 2 * p] = gram[: 2 * p, : 2 * p]
    ext[2 * p :, :] = new_rows
    ext[:, 2 * p :] = new_rows.T
    block = new_rows[:, 2 * p :]
    ext[2 * p :, 2 * p :] = np.triu(block) + np.triu(block, 1).T
    old_s, old_y = list(range(p)), list(range(p, 2 * p))
    if not keep_pair:
        keep = old_s + old_y + [n - 1]
    else:
        first = 1 if evict else 0
        keep = old_s[first:] + [2 * p] + old_y[first:] + [2 * p + 1, n - 1]
    return ext[np.ix_(keep, keep)]


def basis(state: lbfgs_state.LbfgsState) -> list:
    """`[s_0 .. s_{p-1}, y_0 .. y_{p-1}, g]`, the vectors `state.gram` is of."""
    return [*state.s_history, *state.y_history, state.grad]


def _reset(state: lbfgs_state.LbfgsState) -> None:
    state.s_history.clear()
    state.y_history.clear()
    state.rho_history.clear()


class VectorTwoLoop:
    """The vector work of an L-BFGS iteration as operations on whole vectors.

    `two_loop_recursion` for the direction; 4 calls per line-search trial;
    the new pair's dot products one call each. What `lbfgs.minimize` did
    before vector-free L-BFGS, kept for comparison (`two_loop="vectors"`).

    Args:
      ops: the run's backend.
      state: the run's state; its `gram` is dropped (this mode keeps none).
    """

    def __init__(self, ops: vector_ops.VectorOps, state: lbfgs_state.LbfgsState):
        self.ops = ops
        state.gram = None

    def direction(self, state: lbfgs_state.LbfgsState, d: vector_ops.Vector) -> float:
        """Sets `d <- -H_k g`, or `-g` (history cleared) if that is no descent
        direction; returns `g·d`."""
        ops, dphi0 = self.ops, math.nan
        if state.s_history:
            two_loop_recursion(
                ops,
                state.grad,
                state.s_history,
                state.y_history,
                state.rho_history,
                state.gamma,
                d,
            )
            ops.scale(-1.0, d)
            dphi0 = ops.dot(state.grad, d)
        if not dphi0 < 0.0:
            _reset(state)
            ops.assign(state.grad, d)
            ops.scale(-1.0, d)
            dphi0 = -state.grad_norm * state.grad_norm
        return dphi0

    def trial_point(
        self, state, step: float, d: vector_ops.Vector, out: vector_ops.Vector
    ) -> None:
        """Sets `out <- x + step d`."""
        self.ops.assign(state.x, out)
        self.ops.axpy(step, d, out)

    def slope(
        self, grad: vector_ops.Vector, g_trial: vector_ops.Vector, d: vector_ops.Vector
    ) -> float:
        """Sets `g_trial <- grad` (the objective may reuse `grad`); returns `g·d`."""
        self.ops.assign(grad, g_trial)
        return self.ops.dot(g_trial, d)

    def new_pair(self, state, x_trial, g_trial, s_new, y_new):
        """Sets `s_new <- x_trial - x`, `y_new <- g_trial - g`; returns
        `(s·y, y·y, s·s)`."""
        ops = self.ops
        ops.assign(x_trial, s_new)
        ops.axpy(-1.0, state.x, s_new)
        ops.assign(g_trial, y_new)
        ops.axpy(-1.0, state.grad, y_new)
        return ops.dot(s_new, y_new), ops.dot(y_new, y_new), ops.dot(s_new, s_new)

    def storage(self, state) -> vector_ops.Vector:
        """A new vector for a new pair (`zeros_like`)."""
        return self.ops.zeros_like(state.x)

    def stepped(self, state, keep_pair: bool, evict: bool) -> float:
        """After `state` took the step: returns `|g|^2` at the new iterate."""
        return self.ops.dot(state.grad, state.grad)


class VectorFreeTwoLoop:
    """The vector work of an L-BFGS iteration, vector-free (Chen et al. 2014).

    Keeps `state.gram`, the dot products of `basis(state)`; builds it with one
    `gram` call if the state has none (a fresh run, or a state written by the
    `"vectors"` mode). Round trips per iteration: one `combine` (direction),
    per line-search evaluation one `combine` (trial point) and one `gram`
    (gradient copy and slope), and one `gram` (new pair and its dot products).

    Every call but the first `gram` names the same vectors in the same
    pattern whatever the number of pairs `p`, so a backend that compiles per
    signature (`tf.function` in `ps_vectors`, which also keys on which
    arguments are the same variable) traces each operation once, not once per
    `p` while the history fills. To that end it holds the storage of the
    `2 (m - p)` pairs not made yet (`storage` hands it out; a reset history
    gives it back) and pads every call with it: the direction's `2p+1`
    vectors to `2m+1` with zero coefficients (adding `0 * v` changes no bit
    of a finite sum), the new pair's `2p+3` columns to `2m+3` (the extra dot
    products are dropped).

    Args:
      ops: the run's backend.
      state: the run's state.
      m: the run's memory.
    """

    def __init__(
        self, ops: vector_ops.VectorOps, state: lbfgs_state.LbfgsState, m: int
    ):
        self.ops = ops
        self.m = m
        self._spares = [
            ops.zeros_like(state.x) for _ in range(2 * (m - state.num_pairs))
        ]
        if state.gram is None:
            vectors = basis(state)
            full = ops.gram(vectors, vectors)
            state.gram = np.triu(full) + np.triu(full, 1).T
        self._new_rows = None

    def direction(self, state: lbfgs_state.LbfgsState, d: vector_ops.Vector) -> float:
        """Sets `d <- -H_k g`, or `-g` (history cleared) if that is no descent
        direction; returns `g·d`. One `combine` call."""
        dphi0 = math.nan
        if state.s_history:
            coefficients = two_loop_coefficients(
                state.gram, state.rho_history, state.gamma
            )
            dphi0 = -float(state.gram[-1] @ coefficients)
        if not dphi0 < 0.0:
            self._spares += [*state.s_history, *state.y_history]
            _reset(state)
            state.gram = state.gram[-1:, -1:]
            coefficients = np.ones(1)
            dphi0 = -state.grad_norm * state.grad_norm
        self.ops.combine(
            (-coefficients).tolist() + [0.0] * len(self._spares),
            basis(state) + self._spares,
            d,
        )
        return dphi0

    def trial_point(
        self, state, step: float, d: vector_ops.Vector, out: vector_ops.Vector
    ) -> None:
        """Sets `out <- x + step d`; one `combine` call."""
        self.ops.combine([1.0, step], [state.x, d], out)

    def slope(
        self, grad: vector_ops.Vector, g_trial: vector_ops.Vector, d: vector_ops.Vector
    ) -> float:
        """Sets `g_trial <- grad`, returns `g·d`; one `gram` call."""
        return float(self.ops.gram([g_trial], [d], [([1.0], [grad], g_trial)])[0, 0])

    def new_pair(self, state, x_trial, g_trial, s_new, y_new):
        """Sets `s_new <- x_trial - x`, `y_new <- g_trial - g`; returns
        `(s·y, y·y, s·s)`. One `gram` call, which also reads every new dot
        product of the next basis."""
        rows, p, m = [s_new, y_new, g_trial], state.num_pairs, self.m
        self._new_rows = self.ops.gram(
            rows,
            [*state.s_history, *state.y_history, *self._spares, *rows],
            [
                ([1.0, -1.0], [x_trial, state.x], s_new),
                ([1.0, -1.0], [g_trial, state.grad], y_new),
            ],
        )[:, [*range(2 * p), 2 * m, 2 * m + 1, 2 * m + 2]]
        rows = self._new_rows  # Rows s, y, g; columns ..., s (2p), y (2p+1), g.
        return (
            float(rows[0, 2 * p + 1]),
            float(rows[1, 2 * p + 1]),
            float(rows[0, 2 * p]),
        )

    def storage(self, state) -> vector_ops.Vector:
        """A vector for a new pair: one of the spares (no call)."""
        return self._spares.pop()

    def stepped(self, state, keep_pair: bool, evict: bool) -> float:
        """After `state` took the step: updates `state.gram`, returns `|g|^2`."""
        state.gram = extend_gram(state.gram, self._new_rows, keep_pair, evict)
        return float(state.gram[-1, -1])


def make(
    two_loop: str, ops: vector_ops.VectorOps, state: lbfgs_state.LbfgsState, m: int
):
    """The `VectorTwoLoop` or `VectorFreeTwoLoop` that `two_loop` names.

    Args:
      two_loop: one of `TWO_LOOPS`.
      ops: the run's backend.
      state: the run's state.
      m: the run's memory.

    Raises:
      ValueError: `two_loop` is not in `TWO_LOOPS`.
    """
    if two_loop == "vectors":
        return VectorTwoLoop(ops, state)
    if two_loop == "vector_free":
        return VectorFreeTwoLoop(ops, state, m)
    raise checks.argument_error("two_loop", f"one of {TWO_LOOPS}", two_loop)
