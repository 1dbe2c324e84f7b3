"""Tests for `sandblaster.lbfgs` against independent NumPy/SciPy computations."""

import math

import numpy as np
import pytest
import scipy.optimize

from tests.fixtures.lbfgs import dense_bfgs_inverse_hessian, rosenbrock
from tf_distbelief.sandblaster import (
    lbfgs,
    lbfgs_state,
    line_search,
    two_loop,
    vector_ops,
)


def log_barrier(x):
    """f(lam) = lam - 10 log(lam), +inf (and a nan gradient) for lam <= 0."""
    lam = x[0]
    if lam <= 0.0:
        return math.inf, np.array([math.nan])
    return lam - 10.0 * math.log(lam), np.array([1.0 - 10.0 / lam])


class CountingObjective:
    """Wraps an objective and records every point it is asked about."""

    def __init__(self, fun):
        self.fun = fun
        self.points = []

    def __call__(self, x):
        self.points.append(np.array(x))
        return self.fun(x)


# ------------------------------------------------------------------ vector ops


def test_numpy_vector_ops_match_numpy():
    ops = vector_ops.NumpyVectorOps()
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=7), rng.normal(size=7)
    x, y = ops.from_numpy(a), ops.from_numpy(b)
    assert ops.dot(x, y) == pytest.approx(float(a @ b), rel=1e-15)
    ops.axpy(0.5, x, y)
    np.testing.assert_allclose(ops.to_numpy(y), b + 0.5 * a, rtol=1e-15)
    ops.scale(-3.0, y)
    np.testing.assert_allclose(ops.to_numpy(y), -3.0 * (b + 0.5 * a), rtol=1e-15)
    ops.assign(x, y)
    np.testing.assert_array_equal(ops.to_numpy(y), a)
    ops.add(x, y)
    np.testing.assert_array_equal(ops.to_numpy(y), 2.0 * a)
    ops.multiply(x, y)
    np.testing.assert_array_equal(ops.to_numpy(y), 2.0 * a * a)
    z = ops.copy(x)
    ops.scale(0.0, z)
    np.testing.assert_array_equal(ops.to_numpy(x), a)  # copy is independent
    np.testing.assert_array_equal(ops.to_numpy(ops.zeros_like(x)), np.zeros(7))
    a[0] = 99.0
    assert ops.to_numpy(x)[0] != 99.0  # from_numpy copies


# ----------------------------------------------------------- two-loop recursion


@pytest.mark.parametrize("num_pairs", [0, 1, 3, 6])
def test_two_loop_recursion_matches_dense_bfgs(num_pairs):
    rng = np.random.default_rng(num_pairs)
    n = 8
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    hessian = q @ np.diag(np.linspace(1.0, 4.0, n)) @ q.T  # SPD: s·y > 0
    s_list = [rng.normal(size=n) for _ in range(num_pairs)]
    y_list = [hessian @ s + 0.01 * rng.normal(size=n) for s in s_list]
    gamma = (s_list[-1] @ y_list[-1]) / (y_list[-1] @ y_list[-1]) if s_list else 1.0
    g = rng.normal(size=n)

    ops = vector_ops.NumpyVectorOps()
    out = ops.zeros_like(g)
    two_loop.two_loop_recursion(
        ops,
        ops.from_numpy(g),
        [ops.from_numpy(s) for s in s_list],
        [ops.from_numpy(y) for y in y_list],
        [1.0 / (s @ y) for s, y in zip(s_list, y_list)],
        gamma,
        out,
    )
    expected = dense_bfgs_inverse_hessian(s_list, y_list, gamma) @ g if s_list else g
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


def test_two_loop_recursion_rejects_mismatched_histories():
    ops = vector_ops.NumpyVectorOps()
    g = np.ones(2)
    with pytest.raises(ValueError, match=r"same length. Received lengths: 1, 0, 0"):
        two_loop.two_loop_recursion(ops, g, [g], [], [], 1.0, np.zeros(2))


# ----------------------------------------------------------------- line search

# Moré & Thuente (1994), "Line search algorithms with guaranteed sufficient
# decrease", test functions 1-3, plus slices of Rosenbrock along -grad.


def more_thuente_1(t):
    return -t / (t * t + 2.0), (t * t - 2.0) / (t * t + 2.0) ** 2


def more_thuente_2(t):
    b = t + 0.004
    return b**5 - 2.0 * b**4, 5.0 * b**4 - 8.0 * b**3


def more_thuente_3(t):
    beta, ell = 0.01, 39
    if t <= 1.0 - beta:
        p, dp = 1.0 - t, -1.0
    elif t >= 1.0 + beta:
        p, dp = t - 1.0, 1.0
    else:
        p = (t - 1.0) ** 2 / (2.0 * beta) + beta / 2.0
        dp = (t - 1.0) / beta
    factor = 2.0 * (1.0 - beta) / (ell * math.pi)
    p += factor * math.sin(ell * math.pi * t / 2.0)
    dp += (1.0 - beta) * math.cos(ell * math.pi * t / 2.0)
    return p, dp


def rosenbrock_slice(x):
    x = np.asarray(x, dtype=np.float64)
    _, g = rosenbrock(x)
    d = -g

    def phi(t):
        loss, grad = rosenbrock(x + t * d)
        return loss, float(grad @ d)

    return phi


LINE_SEARCH_CASES = [
    pytest.param(more_thuente_1, id="more_thuente_1"),
    pytest.param(more_thuente_2, id="more_thuente_2"),
    pytest.param(more_thuente_3, id="more_thuente_3"),
    pytest.param(rosenbrock_slice([-1.2, 1.0]), id="rosenbrock_start"),
    pytest.param(rosenbrock_slice([0.5, 0.2]), id="rosenbrock_valley"),
]


@pytest.mark.parametrize("step0", [1e-3, 1e-1, 1.0, 10.0, 1e3])
@pytest.mark.parametrize("phi", LINE_SEARCH_CASES)
def test_line_search_satisfies_strong_wolfe(phi, step0):
    c1, c2 = 1e-4, 0.9
    if phi is more_thuente_3:
        c2 = 0.1  # Moré & Thuente's setting for this oscillating function.
    phi0, dphi0 = phi(0.0)
    assert dphi0 < 0, "every line-search case starts along a descent direction"
    result = line_search.wolfe_line_search(phi, phi0, dphi0, step0, c1=c1, c2=c2)
    assert result.success
    t = result.step
    assert t > 0
    p, dp = phi(t)
    assert (p, dp) == (result.phi, result.dphi)
    assert p <= phi0 + c1 * t * dphi0
    assert abs(dp) <= c2 * abs(dphi0)


def test_line_search_never_accepts_non_finite_trial():
    """phi is finite only on t < 0.3; the first trial t = 1 is outside."""
    trials = []

    def phi(t):
        trials.append(t)
        if t >= 0.3:
            return math.inf, math.nan
        return (t - 0.2) ** 2, 2.0 * (t - 0.2)

    result = line_search.wolfe_line_search(phi, 0.04, -0.4, step0=1.0)
    assert result.success
    assert trials[0] == 1.0
    assert result.step < 0.3
    assert math.isfinite(result.phi) and math.isfinite(result.dphi)
    assert any(t >= 0.3 for t in trials)


def test_line_search_rejects_finite_loss_with_non_finite_gradient():
    def phi(t):
        return -t, (math.nan if t > 0.5 else -1.0 + t)

    result = line_search.wolfe_line_search(phi, 0.0, -1.0, step0=4.0)
    assert result.success
    assert result.step <= 0.5


def test_line_search_reports_failure_when_no_decrease():
    # phi'(0) claims descent but phi only increases: no step has sufficient decrease.
    result = line_search.wolfe_line_search(lambda t: (t, 1.0), 0.0, -1.0, max_evals=5)
    assert not result.success
    assert result.step == 0.0
    assert result.num_evals == 5


# --------------------------------------------------------------------- minimize


def test_rosenbrock_converges_like_scipy():
    ops = vector_ops.NumpyVectorOps()
    x0 = np.array([-1.2, 1.0])
    result = lbfgs.minimize(
        rosenbrock, ops.from_numpy(x0), ops, m=10, max_iters=100, gtol=1e-10, ftol=0
    )
    np.testing.assert_allclose(result.x, [1.0, 1.0], rtol=0, atol=1e-6)
    assert result.converged, result.message
    assert result.num_iters <= 100
    assert len(result.loss_history) == result.num_iters + 1
    assert np.all(np.diff(result.loss_history) < 0)  # sufficient decrease each step
    np.testing.assert_array_equal(x0, [-1.2, 1.0])  # x0 untouched

    reference = scipy.optimize.minimize(
        rosenbrock,
        x0,
        jac=True,
        method="L-BFGS-B",
        options={"maxcor": 10, "gtol": 1e-10, "ftol": 0},
    )
    np.testing.assert_allclose(reference.x, [1.0, 1.0], atol=1e-6)
    assert result.loss <= max(reference.fun, 1e-14)
    # Same method, same memory: iteration counts in the same range.
    assert result.num_iters <= 2 * reference.nit


def test_rosenbrock_with_reused_gradient_buffer_and_small_memory():
    """The callback may return the same gradient array every time."""
    buffer = np.zeros(2)

    def fun_and_grad(x):
        loss, grad = rosenbrock(x)
        buffer[...] = grad
        return loss, buffer

    ops = vector_ops.NumpyVectorOps()
    result = lbfgs.minimize(
        fun_and_grad, np.array([-1.2, 1.0]), ops, m=2, max_iters=200, gtol=1e-9, ftol=0
    )
    np.testing.assert_allclose(result.x, [1.0, 1.0], atol=1e-6)


@pytest.mark.parametrize("start", [1.6, 100.0])
def test_log_barrier_never_accepts_non_finite_iterate(start):
    objective = CountingObjective(log_barrier)
    ops = vector_ops.NumpyVectorOps()
    result = lbfgs.minimize(
        objective,
        np.array([start]),
        ops,
        max_iters=100,
        gtol=1e-10,
        ftol=0,
        record_iterates=True,
    )
    assert abs(result.x[0] - 10.0) < 1e-5
    assert all(x[0] > 0 for x in result.iterate_history)
    assert all(math.isfinite(f) for f in result.loss_history)
    if start == 100.0:
        # Bracketing doubles the step from 100 toward 0 and overshoots into lam <= 0.
        assert any(p[0] <= 0 for p in objective.points)


def test_history_eviction_keeps_last_m_pairs():
    """On a quadratic, compare with a dense BFGS on the same last m pairs."""
    rng = np.random.default_rng(1)
    n, m = 6, 2
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    a = q @ np.diag(np.geomspace(1.0, 50.0, n)) @ q.T

    def quadratic(x):
        return 0.5 * float(x @ a @ x), a @ x

    ops = vector_ops.NumpyVectorOps()
    runs = [
        lbfgs.minimize(
            quadratic,
            np.ones(n),
            ops,
            m=m,
            max_iters=k,
            gtol=0,
            ftol=0,
            record_iterates=True,
        )
        for k in (5, 6)
    ]
    xs = runs[1].iterate_history
    s_list = [xs[i + 1] - xs[i] for i in range(3, 5)]  # pairs k = 3, 4 of 0..4
    y_list = [a @ s for s in s_list]
    gamma = (s_list[-1] @ y_list[-1]) / (y_list[-1] @ y_list[-1])
    h = dense_bfgs_inverse_hessian(s_list, y_list, gamma)
    direction = -h @ (a @ xs[5])
    step = runs[1].step_history[5]
    np.testing.assert_allclose(xs[6], xs[5] + step * direction, rtol=1e-10)
    np.testing.assert_array_equal(runs[0].iterate_history, xs[:6])


def test_already_optimal_start_takes_no_step():
    ops = vector_ops.NumpyVectorOps()
    result = lbfgs.minimize(rosenbrock, np.array([1.0, 1.0]), ops)
    assert result.converged and result.num_iters == 0 and result.num_evals == 1


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"m": 0}, ValueError, r"Argument `m` must be positive. Received: 0"),
        ({"m": 2.5}, TypeError, r"Argument `m` must be an int. Received: 2.5"),
        ({"m": True}, TypeError, r"Argument `m` must be an int. Received: True"),
        ({"max_iters": -1}, ValueError, r"`max_iters` must be >= 0. Received: -1"),
        ({"gtol": -1e-3}, ValueError, r"`gtol` must be a number >= 0. Received"),
        ({"ftol": math.nan}, ValueError, r"`ftol` must be a number >= 0. Received"),
        (
            {"c1": 0.9, "c2": 0.1},
            ValueError,
            r"0 < c1 < c2 < 1 .* Received: c1=0.9, c2=0.1",
        ),
        (
            {"max_line_search_evals": 0},
            ValueError,
            r"`max_line_search_evals` must be positive. Received: 0",
        ),
    ],
)
def test_minimize_rejects_bad_arguments(kwargs, error, match):
    ops = vector_ops.NumpyVectorOps()
    with pytest.raises(error, match=match):
        lbfgs.minimize(rosenbrock, np.zeros(2), ops, **kwargs)


def test_minimize_rejects_bad_ops_callback_and_start():
    ops = vector_ops.NumpyVectorOps()
    with pytest.raises(TypeError, match=r"`ops` must be a `VectorOps`. Received: str"):
        lbfgs.minimize(rosenbrock, np.zeros(2), "numpy")
    with pytest.raises(TypeError, match=r"`fun_and_grad` must be callable"):
        lbfgs.minimize(None, np.zeros(2), ops)
    with pytest.raises(ValueError, match=r"`x0` must be a point where .* finite"):
        lbfgs.minimize(log_barrier, np.array([-1.0]), ops)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"phi0": math.inf}, r"`phi0` must be finite. Received: inf"),
        ({"dphi0": 0.0}, r"`dphi0` must be finite and negative .* Received: 0.0"),
        ({"step0": 0.0}, r"`step0` must be finite and positive. Received: 0.0"),
        ({"c2": 1.0}, r"0 < c1 < c2 < 1 .* Received: c1=0.0001, c2=1.0"),
    ],
)
def test_line_search_rejects_bad_arguments(kwargs, match):
    args = {"phi": more_thuente_1, "phi0": 0.0, "dphi0": -1.0} | kwargs
    with pytest.raises(ValueError, match=match):
        line_search.wolfe_line_search(**args)


def test_numpy_vector_ops_rejects_bad_input():
    with pytest.raises(TypeError, match=r"`dtype` must be a floating dtype. Received"):
        vector_ops.NumpyVectorOps(np.int32)
    with pytest.raises(ValueError, match=r"`array` must be 1-D.* Received shape"):
        vector_ops.NumpyVectorOps().from_numpy(np.zeros((2, 3)))


# ---------------------------------------------------------------------- resume


def _run_with_snapshots(fun, x0, max_iters, **kwargs):
    """An uninterrupted run, and a deep copy of its state after every iteration."""
    ops = vector_ops.NumpyVectorOps()
    snapshots = {}

    def keep(state):
        snapshots[state.num_iters] = state.copy(ops)

    result = lbfgs.minimize(
        fun, x0, ops, max_iters=max_iters, record_iterates=True, callback=keep, **kwargs
    )
    return result, snapshots


@pytest.mark.parametrize("stop_at", [1, 2, 3, 7, 20])
def test_resumed_run_equals_uninterrupted(stop_at):
    """Resumed from the state after iteration k, a run repeats the rest exactly.

    m=3 on Rosenbrock: the history is full and evicting from iteration 3 on.
    """
    args = {"m": 3, "gtol": 0.0, "ftol": 0.0}
    full, snapshots = _run_with_snapshots(rosenbrock, np.array([-1.2, 1.0]), 25, **args)
    assert sorted(snapshots) == list(range(1, 26)) and full.num_iters == 25
    start = snapshots[stop_at]
    evals_before, pairs_before = start.num_evals, start.num_pairs
    objective = CountingObjective(rosenbrock)
    resumed = lbfgs.minimize(
        objective,
        None,
        vector_ops.NumpyVectorOps(),
        max_iters=25,
        record_iterates=True,
        initial_state=start,  # Taken over: `start` is the run's state now.
        **args,
    )
    # NumPy is deterministic: the same operations give the same bits.
    np.testing.assert_array_equal(
        resumed.iterate_history, full.iterate_history[stop_at:]
    )
    np.testing.assert_array_equal(resumed.x, full.x)
    assert resumed.loss_history == full.loss_history
    assert resumed.step_history == full.step_history
    assert (resumed.num_iters, resumed.num_evals) == (25, full.num_evals)
    assert resumed.message == full.message == "reached `max_iters`=25"
    # No evaluation at the restored iterate: the state carries loss and gradient.
    assert len(objective.points) == full.num_evals - evals_before
    assert pairs_before == min(stop_at, 3)
    assert resumed.state is start


def test_resume_counts_max_iters_over_both_runs():
    """`result.state` goes on: 10 + 15 iterations are those of one 25-iteration run."""
    ops = vector_ops.NumpyVectorOps()
    args = {"m": 4, "gtol": 0.0, "ftol": 0.0, "record_iterates": True}
    full = lbfgs.minimize(rosenbrock, np.array([-1.2, 1.0]), ops, max_iters=25, **args)
    first = lbfgs.minimize(rosenbrock, np.array([-1.2, 1.0]), ops, max_iters=10, **args)
    second = lbfgs.minimize(
        rosenbrock, None, ops, max_iters=25, initial_state=first.state, **args
    )
    np.testing.assert_array_equal(
        first.iterate_history + second.iterate_history[1:], full.iterate_history
    )
    assert second.num_iters == 25
    # A rerun asking for no more iterations than done evaluates nothing.
    objective = CountingObjective(rosenbrock)
    again = lbfgs.minimize(
        objective, None, ops, max_iters=25, initial_state=second.state, **args
    )
    assert again.num_iters == 25 and objective.points == []


def test_resume_of_a_converged_run_stops_at_once():
    """The `ftol` rule reads the state's last two losses, so it holds after a resume."""
    ops = vector_ops.NumpyVectorOps()
    done = lbfgs.minimize(rosenbrock, np.array([-1.2, 1.0]), ops, m=5)
    assert done.converged and "ftol" in done.message
    objective = CountingObjective(rosenbrock)
    again = lbfgs.minimize(objective, None, ops, m=5, initial_state=done.state)
    assert (again.converged, again.message) == (True, done.message)
    assert (again.num_iters, again.num_evals) == (done.num_iters, done.num_evals)
    assert objective.points == []


def test_state_round_trips_through_numbers():
    """What a checkpoint holds (vectors as arrays, `scalars()`) rebuilds the state."""
    full, snapshots = _run_with_snapshots(rosenbrock, np.array([-1.2, 1.0]), 12, m=3)
    state = snapshots[6]
    rebuilt = lbfgs_state.LbfgsState(
        x=np.array(state.x),
        grad=np.array(state.grad),
        s_history=[np.array(v) for v in state.s_history],
        y_history=[np.array(v) for v in state.y_history],
        **state.scalars(),
    )
    resumed = lbfgs.minimize(
        rosenbrock,
        None,
        vector_ops.NumpyVectorOps(),
        m=3,
        max_iters=12,
        record_iterates=True,
        initial_state=rebuilt,
    )
    np.testing.assert_array_equal(resumed.iterate_history, full.iterate_history[6:])
    assert set(state.scalars()) == {
        "rho_history",
        "gamma",
        "loss",
        "grad_norm",
        "num_iters",
        "num_evals",
        "num_skipped_pairs",
        "loss_history",
        "step_history",
    }


def test_bad_initial_state_is_an_error_naming_the_field():
    ops = vector_ops.NumpyVectorOps()
    _, snapshots = _run_with_snapshots(rosenbrock, np.array([-1.2, 1.0]), 5, m=4)
    state = snapshots[5]
    assert state.num_pairs == 4
    with pytest.raises(
        ValueError, match=r"`rho_history` .* 4 pairs, more than .*`m`=3"
    ):
        lbfgs.minimize(rosenbrock, None, ops, m=3, initial_state=state.copy(ops))
    bad = state.copy(ops)
    bad.loss = math.nan
    with pytest.raises(
        ValueError, match=r"Field `loss` of `initial_state` must be finite"
    ):
        lbfgs.minimize(rosenbrock, None, ops, m=4, initial_state=bad)
    bad = state.copy(ops)
    bad.loss_history.pop()
    with pytest.raises(
        ValueError, match=r"`loss_history` .* `num_iters` \+ 1 .* 5 for"
    ):
        lbfgs.minimize(rosenbrock, None, ops, m=4, initial_state=bad)
    bad = state.copy(ops)
    bad.y_history.pop()
    with pytest.raises(ValueError, match=r"same length. Received lengths: \(4, 3, 4\)"):
        lbfgs.minimize(rosenbrock, None, ops, m=4, initial_state=bad)
    with pytest.raises(TypeError, match=r"`initial_state` must be an `LbfgsState`"):
        lbfgs.minimize(rosenbrock, None, ops, initial_state={"x": 1})
    with pytest.raises(ValueError, match=r"`x0` is required unless `initial_state`"):
        lbfgs.minimize(rosenbrock, None, ops)
    with pytest.raises(TypeError, match=r"`callback` must be callable or None"):
        lbfgs.minimize(rosenbrock, np.zeros(2), ops, callback="save")
