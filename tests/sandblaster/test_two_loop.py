"""Vector-free L-BFGS (`sandblaster.two_loop`) against NumPy, with no cluster.

The vector-free recursion (Chen, Wang and Zhou, NIPS 2014) must give the
iterates of the two-loop recursion on vectors (Nocedal & Wright, Algorithm
7.4) up to rounding, in a fixed, small number of backend calls per iteration.
"""

import collections
import math

import numpy as np
import pytest
import sklearn.datasets

from tests.fixtures.lbfgs import dense_bfgs_inverse_hessian, rosenbrock
from tf_distbelief.sandblaster import lbfgs, lbfgs_state, two_loop, vector_ops


def _spd_pairs(num_pairs, n=8, seed=0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    hessian = q @ np.diag(np.linspace(1.0, 4.0, n)) @ q.T  # SPD: s·y > 0
    s_list = [rng.normal(size=n) for _ in range(num_pairs)]
    y_list = [hessian @ s + 0.01 * rng.normal(size=n) for s in s_list]
    return s_list, y_list, rng.normal(size=n)


@pytest.mark.parametrize("num_pairs", [0, 1, 3, 6])
def test_coefficients_match_dense_bfgs_and_two_loop_on_vectors(num_pairs):
    s_list, y_list, g = _spd_pairs(num_pairs, seed=num_pairs)
    rho = [1.0 / (s @ y) for s, y in zip(s_list, y_list)]
    gamma = (s_list[-1] @ y_list[-1]) / (y_list[-1] @ y_list[-1]) if s_list else 1.0
    basis = np.array([*s_list, *y_list, g])  # `[2p+1, n]`
    coefficients = two_loop.two_loop_coefficients(basis @ basis.T, rho, gamma)
    assert coefficients.shape == (2 * num_pairs + 1,)

    dense = (
        dense_bfgs_inverse_hessian(s_list, y_list, gamma) if s_list else np.eye(g.size)
    )
    np.testing.assert_allclose(coefficients @ basis, dense @ g, rtol=0, atol=1e-12)
    ops = vector_ops.NumpyVectorOps()
    on_vectors = np.zeros_like(g)
    two_loop.two_loop_recursion(ops, g, s_list, y_list, rho, gamma, on_vectors)
    np.testing.assert_allclose(coefficients @ basis, on_vectors, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "num_pairs, keep_pair, evict",
    [(0, True, False), (3, True, False), (3, True, True), (3, False, False)],
)
def test_extend_gram_equals_the_recomputed_matrix(num_pairs, keep_pair, evict):
    rng = np.random.default_rng(7)
    s_old, y_old = list(rng.normal(size=(2, num_pairs, 5)))
    g_old, s, y, g = rng.normal(size=(4, 5))
    old = np.array([*s_old, *y_old, g_old])
    columns = np.array([*s_old, *y_old, s, y, g])
    new_rows = np.array([s, y, g]) @ columns.T
    got = two_loop.extend_gram(old @ old.T, new_rows, keep_pair, evict)

    if keep_pair:
        first = 1 if evict else 0
        s_old, y_old = [*s_old[first:], s], [*y_old[first:], y]
    new = np.array([*s_old, *y_old, g])
    np.testing.assert_allclose(got, new @ new.T, rtol=1e-14)
    np.testing.assert_array_equal(got, got.T)


def test_default_combine_and_gram_match_numpy_backend():
    """`VectorOps`'s defaults (from the primitives) against NumPy's overrides."""

    class Primitives(vector_ops.NumpyVectorOps):
        combine = vector_ops.VectorOps.combine
        gram = vector_ops.VectorOps.gram

    rng = np.random.default_rng(3)
    a, b, c = rng.normal(size=(3, 6))
    for ops in (vector_ops.NumpyVectorOps(), Primitives()):
        out = np.zeros(6)
        ops.combine([2.0, -0.5, 3.0], [a, b, c], out)
        np.testing.assert_allclose(out, 2.0 * a - 0.5 * b + 3.0 * c, rtol=1e-15)
        target = np.zeros(6)
        matrix = ops.gram([target, a], [a, b, c], [([1.0, -1.0], [b, c], target)])
        np.testing.assert_array_equal(target, b - c)
        expected = np.array([b - c, a]) @ np.array([a, b, c]).T
        np.testing.assert_allclose(matrix, expected, rtol=1e-14)
        with pytest.raises(ValueError, match=r"same length. Received lengths: 2, 1"):
            ops.combine([1.0, 2.0], [a], out)


# --------------------------------------------------- iterates and round trips


def _digits_logistic(num_examples=300, l2=1e-2):
    """Multinomial logistic regression on digits, `[65 * 10]` float64 params."""
    data = sklearn.datasets.load_digits()
    features = np.hstack([data.data[:num_examples] / 16.0, np.ones((num_examples, 1))])
    labels = np.eye(10)[data.target[:num_examples]]

    def fun_and_grad(x):
        w = x.reshape(65, 10)
        logits = features @ w
        logits -= logits.max(axis=1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        loss = -np.mean(np.sum(labels * log_p, axis=1)) + 0.5 * l2 * np.sum(w * w)
        grad = features.T @ (np.exp(log_p) - labels) / num_examples + l2 * w
        return float(loss), grad.ravel()

    return fun_and_grad, np.zeros(650)


def _rosenbrock():
    return rosenbrock, np.array([-1.2, 1.0])


def _relative_errors(result, reference):
    return [
        np.linalg.norm(a - b) / max(np.linalg.norm(b), 1.0)
        for a, b in zip(result.iterate_history, reference.iterate_history)
    ]


_ITERATE_ARGS = {"max_iters": 60, "gtol": 1e-9, "ftol": 0, "record_iterates": True}


@pytest.mark.parametrize("problem", [_digits_logistic, _rosenbrock])
@pytest.mark.parametrize("m", [3, 10])
def test_vector_free_iterates_equal_two_loop_on_vectors(problem, m):
    fun, x0 = problem()
    ops = vector_ops.NumpyVectorOps()
    free = lbfgs.minimize(fun, x0, ops, m=m, two_loop="vector_free", **_ITERATE_ARGS)
    on_vectors = lbfgs.minimize(fun, x0, ops, m=m, two_loop="vectors", **_ITERATE_ARGS)
    assert (free.num_iters, free.num_evals) == (
        on_vectors.num_iters,
        on_vectors.num_evals,
    )
    assert free.num_iters >= 30
    # A loss near the optimum is a small difference of large terms: compared
    # on the scale of the starting loss.
    np.testing.assert_allclose(
        free.loss_history,
        on_vectors.loss_history,
        rtol=1e-9,
        atol=1e-9 * abs(on_vectors.loss_history[0]),
    )
    assert max(_relative_errors(free, on_vectors)) <= 1e-9
    assert free.state.gram.shape == (2 * free.state.num_pairs + 1,) * 2
    assert on_vectors.state.gram is None


@pytest.mark.parametrize("problem", [_digits_logistic, _rosenbrock])
def test_vector_free_with_memory_1_differs_as_rounding_does(problem):
    """With `m = 1` L-BFGS amplifies rounding to 1e-9 to 1e-6 in 60 steps: the
    two-loop on vectors moves that far when its gradients are perturbed by
    1e-16 (relative), and on Rosenbrock a perturbation alone changes the
    line searches' evaluations (116, 121 or 122 over 8 draws, NumPy 2.4 on
    AVX-512). The vector-free run takes a path rounding takes, and stays
    within 10x of rounding's median distance."""
    fun, x0 = problem()
    ops = vector_ops.NumpyVectorOps()

    def perturbed(seed):
        rng = np.random.default_rng(seed)

        def f(x):
            loss, grad = fun(x)
            return loss, grad * (1.0 + 1e-16 * rng.standard_normal(grad.shape))

        return f

    def run(f, name):
        return lbfgs.minimize(f, x0, ops, m=1, two_loop=name, **_ITERATE_ARGS)

    reference, free = run(fun, "vectors"), run(fun, "vector_free")
    rounded = [run(perturbed(seed), "vectors") for seed in range(8)]
    paths = {(r.num_iters, r.num_evals) for r in [reference, *rounded]}
    assert (free.num_iters, free.num_evals) in paths
    rounding_errors = [max(_relative_errors(r, reference)) for r in rounded]
    free_error = max(_relative_errors(free, reference))
    assert 1e-10 < min(rounding_errors)
    assert free_error <= 10 * np.median(rounding_errors)


class CountingOps(vector_ops.NumpyVectorOps):
    """Counts the backend calls `minimize` makes (a call's own calls excluded)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()
        self._depth = 0

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        if name.startswith("_") or not callable(attribute) or name == "calls":
            return attribute

        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls[name] += 1
            self._depth += 1
            try:
                return attribute(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def per_iteration_calls(two_loop_name, m=3, max_iters=12):
    """`[(calls, evaluations, pairs at the start)]` of each iteration."""
    fun, x0 = _digits_logistic()
    ops = CountingOps()
    rows, last = [], {"calls": collections.Counter(), "evals": 1, "pairs": 0}

    def callback(state):
        calls = ops.calls - last["calls"]
        rows.append((calls, state.num_evals - last["evals"], last["pairs"]))
        last.update(calls=collections.Counter(ops.calls), evals=state.num_evals)
        last["pairs"] = state.num_pairs

    start = lbfgs.minimize(fun, x0, ops, m=m, max_iters=0, two_loop=two_loop_name)
    last["calls"] = collections.Counter(ops.calls)
    result = lbfgs.minimize(
        fun,
        None,
        ops,
        m=m,
        max_iters=max_iters,
        gtol=0,
        ftol=0,
        initial_state=start.state,
        callback=callback,
        two_loop=two_loop_name,
    )
    assert result.num_iters == max_iters
    return rows


def test_vector_free_makes_two_calls_per_iteration_plus_two_per_evaluation():
    """One `combine` (direction) and one `gram` (new pair and every new dot
    product) per iteration; per line-search evaluation one `combine` (trial
    point) and one `gram` (gradient copy and slope). `zeros_like` only at the
    start: the 2m vectors of the history and `minimize`'s 5 work vectors."""
    rows = per_iteration_calls("vector_free")
    assert any(evals > 1 for _, evals, _ in rows)  # Some searches take 2+ trials.
    for k, (calls, evals, pairs) in enumerate(rows):
        expected = {"combine": 1 + evals, "gram": 1 + evals}
        if k == 0:
            expected["zeros_like"] = 2 * 3 + 5
        assert calls == expected, (k, calls, evals, pairs)


def test_two_loop_on_vectors_makes_4m_plus_12_calls_per_iteration():
    """What vector-free L-BFGS saves: `4 p + 12 + 4 e` calls with `p` pairs,
    `e` evaluations (`2 + 8 + 4 e` with no pair yet: `d = -g`)."""
    rows = per_iteration_calls("vectors")
    for k, (calls, evals, pairs) in enumerate(rows):
        allocations = calls.pop("zeros_like", 0)
        assert allocations == (7 if k == 0 else 2 if k < 3 else 0), k
        expected = 4 * pairs + 12 + 4 * evals if pairs else 10 + 4 * evals
        assert sum(calls.values()) == expected, (k, calls, evals, pairs)
    assert max(pairs for _, _, pairs in rows) == 3


# ---------------------------------------------------------------------- resume


@pytest.mark.parametrize("two_loop_name", two_loop.TWO_LOOPS)
@pytest.mark.parametrize("stop_at", [2, 7])
def test_resumed_run_equals_uninterrupted_bit_for_bit(two_loop_name, stop_at):
    """A copy of the state (`gram` included) resumes to the very same bits."""
    fun, x0 = _digits_logistic()
    args = {
        "m": 3,
        "gtol": 0.0,
        "ftol": 0.0,
        "record_iterates": True,
        "two_loop": two_loop_name,
    }
    ops = vector_ops.NumpyVectorOps()
    snapshots = {}
    full = lbfgs.minimize(
        fun,
        x0,
        ops,
        max_iters=12,
        callback=lambda s: snapshots.setdefault(s.num_iters, s.copy(ops)),
        **args,
    )
    resumed = lbfgs.minimize(
        fun, None, ops, max_iters=12, initial_state=snapshots[stop_at], **args
    )
    np.testing.assert_array_equal(
        resumed.iterate_history, full.iterate_history[stop_at:]
    )
    assert resumed.loss_history == full.loss_history
    if two_loop_name == "vector_free":
        np.testing.assert_array_equal(resumed.state.gram, full.state.gram)


def test_vector_free_resumes_a_state_without_gram():
    """A state from the `"vectors"` mode (no `gram`): the matrix is rebuilt
    from the vectors with one `gram` call, and the run goes on as one that
    never stopped (NumPy's `dot` is symmetric to the bit, so here exactly)."""
    fun, x0 = _digits_logistic()
    args = {"m": 3, "gtol": 0.0, "ftol": 0.0, "record_iterates": True}
    ops = CountingOps()
    full = lbfgs.minimize(fun, x0, ops, max_iters=12, **args)
    half = lbfgs.minimize(fun, x0, ops, max_iters=6, two_loop="vectors", **args)
    assert half.state.gram is None
    ops.calls.clear()
    resumed = lbfgs.minimize(
        fun, None, ops, max_iters=12, initial_state=half.state, **args
    )
    assert resumed.num_iters == 12
    assert ops.calls["gram"] == 1 + 6 + (resumed.num_evals - half.num_evals)
    for a, b in zip(resumed.iterate_history, full.iterate_history[6:]):
        assert np.linalg.norm(a - b) <= 1e-12 * np.linalg.norm(b)


def test_bad_two_loop_and_bad_gram_are_errors_naming_them():
    ops = vector_ops.NumpyVectorOps()
    with pytest.raises(
        ValueError,
        match=r"`two_loop` must be one of \('vector_free', 'vectors'\). "
        r"Received: 'dense'",
    ):
        lbfgs.minimize(rosenbrock, np.zeros(2), ops, two_loop="dense")
    state = lbfgs.minimize(
        rosenbrock, np.array([-1.2, 1.0]), ops, m=3, max_iters=4
    ).state
    assert state.num_pairs == 3
    bad = state.copy(ops)
    bad.gram = bad.gram[:-1, :-1]
    with pytest.raises(
        ValueError,
        match=r"`gram` .* \[7, 7\] for its 3 pairs. Received shape: \(6, 6\)",
    ):
        lbfgs_state.check_state(bad, 3)
    bad = state.copy(ops)
    bad.gram[0, 0] = math.nan
    with pytest.raises(
        ValueError, match=r"Field `gram` of `initial_state` must be finite"
    ):
        lbfgs.minimize(rosenbrock, None, ops, m=3, initial_state=bad)
    with pytest.raises(ValueError, match=r"`gram` must be \[2p\+1, 2p\+1\] = \[3, 3\]"):
        two_loop.two_loop_coefficients(np.eye(2), [1.0], 1.0)
