"""Downpour SGD without TensorFlow: the config, the cadence, a NumPy reference.

Dean et al. 2012, section 4.1. Every model replica keeps a local copy (the
*cache*) of the parameters and counts its own local steps `t = 0, 1, 2, ...`.
At local step `t` a replica does, in this order:

1. **fetch** if `t % n_fetch == 0`, or if its previous push was dropped for
   staleness: `cache <- ps parameters`, `seen <- ps update count`.
2. **gradient** `g = grad loss(cache; batch_t)`, at the *cached* values.
3. **local update** `cache <- cache - local_learning_rate * g`.
4. **accumulate** `acc <- acc + g`.
5. **push** if `(t + 1) % n_push == 0`: `staleness = ps update count - seen`
   (updates by *other* replicas since this replica's cache was fetched). If
   `max_staleness` is None or `staleness <= max_staleness`, the ps applies
   its optimizer (AdaGrad, SGD, ...) to `acc` (AdaGrad counts it as
   `n_push` updates: `DownpourConfig.adagrad_per_step`), the ps update count grows by 1
   and `seen` by the same (the replica's own push is not staleness). Otherwise
   the push is dropped and the replica fetches at its next step. Either way
   `acc <- 0`.

**Row-sparse variables** (large embedding tables) are not copied whole: a
fetch only marks the replica's cached rows stale, and at step 2 each row the
batch looks up is fetched if it has not been since the last fetch (so a row
holds the ps value of the step that first reads it after a fetch). Steps 3 and
4 touch only the looked-up rows; a push sends the rows touched since the last
push (values and int64 indices) and the ps applies its optimizer to those rows.
For the ps optimizers here (AdaGrad, SGD) a row with no gradient is left
unchanged, so the update equals the dense one.

After `S` local steps a replica has fetched `ceil(S / n_fetch)` times (without
drops) and pushed `floor(S / n_push)` times: `n_fetch` and `n_push` are
independent. With `n_fetch = n_push = 1` and one replica this is plain
sequential training with the ps optimizer.

The ps applies pushes shard by shard as they arrive, with no locks; the
reference below applies a whole push atomically (the two agree with one
replica, and with several replicas as long as pushes do not overlap in time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

# The default SGD step of a replica on its cache (`DownpourConfig`).
LOCAL_LEARNING_RATE = 0.5

__all__ = [
    "LOCAL_LEARNING_RATE",
    "DownpourConfig",
    "ReplicaStats",
    "adagrad_ps",
    "is_fetch_step",
    "is_push_step",
    "num_fetches",
    "num_pushes",
    "sgd_ps",
    "simulate",
]


def _check_int(name: str, value, lower: int, rule: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"Argument `{name}` must be an integer. Received: {value!r}")
    if value < lower:
        raise ValueError(f"Argument `{name}` must be {rule}. Received: {value!r}")


@dataclasses.dataclass(frozen=True)
class DownpourConfig:
    """The Downpour cadence and local update (Dean et al. 2012, section 4.1).

    Attributes:
      n_fetch: local steps between fetches of the parameters, >= 1. The paper's
        runs used 1.
      n_push: local steps between pushes of the accumulated gradient, >= 1;
        independent of `n_fetch`. The paper's runs used 1.
      local_learning_rate: step size of the replica's SGD on its own cache, >= 0
        (default `LOCAL_LEARNING_RATE`, 0.5, as in the launch script). 0 keeps
        the cache at the fetched values between fetches. With
        `adagrad_per_step` and a large `n_push`, a small value makes a push
        apply `n_push` AdaGrad steps along gradients taken near one point: in
        `benchmarks/downpour_bench.py` digits at n=16 reached 0.75 test
        accuracy at 0.05 and 0.98 at 0.5, and the launch script's digits job
        at n=16 stayed at chance (0.096) at 0.
      warmstart_steps: the paper's warm start: until replica 0 has taken this
        many local steps, the other replicas' steps change nothing; 0 for none.
      max_staleness: the most ps updates by other replicas that may land
        between a replica's fetch and its push for the push to be applied; a
        staler push is dropped and the replica refetches. None (default)
        applies every push, as the paper does.
      adagrad_per_step: with AdaGrad on the ps (`tf_distbelief.adagrad`), a
        push of the gradients of `n_push` steps summed, `G`, counts as
        `n_push` AdaGrad updates with the mean gradient: the accumulator grows
        by `G^2 / n_push` and the parameters move by `gamma * G / (sqrt(a) +
        epsilon)`, so a push moves them about as far as `n_push` stock steps
        would (as a pushed sum does with SGD). False (the literal reading)
        applies `G` as one update: about `gamma` per push whatever `n_push`
        is, so `n_push` times fewer ps steps per example. The two agree at
        `n_push = 1`; other ps optimizers ignore it.
    """

    n_fetch: int = 1
    n_push: int = 1
    local_learning_rate: float = LOCAL_LEARNING_RATE
    warmstart_steps: int = 0
    max_staleness: int | None = None
    adagrad_per_step: bool = True

    def __post_init__(self):
        _check_int("n_fetch", self.n_fetch, 1, ">= 1 (fetch every n_fetch steps)")
        _check_int("n_push", self.n_push, 1, ">= 1 (push every n_push steps)")
        _check_int("warmstart_steps", self.warmstart_steps, 0, ">= 0")
        if self.max_staleness is not None:
            _check_int(
                "max_staleness",
                self.max_staleness,
                0,
                ">= 0, or None to apply every push",
            )
        if not isinstance(self.adagrad_per_step, bool):
            raise TypeError(
                "Argument `adagrad_per_step` must be True or False. Received: "
                f"{self.adagrad_per_step!r}"
            )
        lr = self.local_learning_rate
        if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating)):
            raise TypeError(
                f"Argument `local_learning_rate` must be a float. Received: {lr!r}"
            )
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(
                "Argument `local_learning_rate` must be finite and >= 0 (0 "
                f"disables the local update). Received: {lr!r}"
            )


def is_fetch_step(t: int, n_fetch: int) -> bool:
    """True when local step `t` (from 0) starts with a fetch."""
    return t % n_fetch == 0


def is_push_step(t: int, n_push: int) -> bool:
    """True when local step `t` (from 0) ends with a push."""
    return (t + 1) % n_push == 0


def num_fetches(steps: int, n_fetch: int) -> int:
    """Fetches in the first `steps` local steps (no dropped pushes)."""
    return -(-steps // n_fetch)


def num_pushes(steps: int, n_push: int) -> int:
    """Pushes in the first `steps` local steps."""
    return steps // n_push


# A ps optimizer: `(params, state, grads, steps) -> (params, state)`, lists of
# arrays; `grads` is the sum of `steps` local steps' gradients.
PsUpdate = Callable[[list, list, list, int], tuple[list, list]]


def adagrad_ps(
    learning_rate: float, initial_accumulator_value: float = 0.1, epsilon=1e-7
) -> tuple[Callable[[list], list], PsUpdate]:
    """AdaGrad on the ps as `(init_state, update)`, as in `tf_distbelief.adagrad`.

    A push of `G`, the sum of `steps` gradients, adds `G^2 / steps` to the
    accumulator `a` and subtracts `learning_rate * G / (sqrt(a) + epsilon)`
    (`DownpourConfig.adagrad_per_step`; `simulate` passes `steps = 1` when it
    is False).
    """

    from tf_distbelief import adagrad

    def init(params):
        return [np.full_like(p, initial_accumulator_value) for p in params]

    def update(params, state, grads, steps):
        out = [
            adagrad.adagrad_update(p, a, g, learning_rate, epsilon, steps)
            for p, a, g in zip(params, state, grads)
        ]
        return [w for w, _ in out], [a for _, a in out]

    return init, update


def sgd_ps(learning_rate: float) -> tuple[Callable[[list], list], PsUpdate]:
    """Plain SGD on the ps as `(init_state, update)`."""

    def update(params, state, grads, steps):
        del steps  # A pushed sum already moves as far as its steps.
        return [p - learning_rate * g for p, g in zip(params, grads)], state

    return (lambda params: []), update


@dataclasses.dataclass
class ReplicaStats:
    """Counters of one replica, as kept by the TF implementation.

    Attributes:
      steps: local steps taken.
      fetches: fetches done.
      pushes: pushes applied on the ps.
      dropped_pushes: pushes dropped for exceeding `max_staleness`.
      staleness_sum: sum of the staleness of all pushes (applied or dropped).
      max_staleness_seen: the largest staleness of a push.
      bytes_fetched: parameter bytes fetched (`fetches` times the size of the
        cached variables, plus `row_bytes_fetched`).
      bytes_pushed: gradient bytes pushed (a dropped push sends nothing: the
        staleness check comes first), `row_bytes_pushed` included.
      row_bytes_fetched: bytes of the rows of row-sparse variables fetched.
      row_bytes_pushed: bytes of the rows of row-sparse variables pushed, an
        8-byte int64 row index included per row.
    """

    steps: int = 0
    fetches: int = 0
    pushes: int = 0
    dropped_pushes: int = 0
    staleness_sum: int = 0
    max_staleness_seen: int = 0
    bytes_fetched: int = 0
    bytes_pushed: int = 0
    row_bytes_fetched: int = 0
    row_bytes_pushed: int = 0


def simulate(
    params: Sequence[np.ndarray],
    grad_fn: Callable[[list, object], list],
    batches: Sequence[Iterable],
    config: DownpourConfig,
    ps_optimizer: tuple[Callable[[list], list], PsUpdate],
    order: Sequence[int] | None = None,
    row_sparse: Sequence[int] = (),
    rows_fn: Callable[[object], dict] | None = None,
) -> tuple[list[np.ndarray], list[ReplicaStats]]:
    """Runs Downpour in NumPy, one whole local step at a time.

    Args:
      params: the initial ps parameters, a list of arrays.
      grad_fn: `(params, batch) -> grads`, lists of arrays of the same shapes.
      batches: one iterable of batches per replica, in that replica's order.
      config: the cadence. Until replica 0 has taken `warmstart_steps` steps, a
        step of another replica reads its batch and changes nothing.
      ps_optimizer: `(init_state, update)`, e.g. `adagrad_ps(0.1)`.
      order: the replica taking each step, e.g. `[0, 1, 0, 1]`; default all of
        replica 0's batches when there is one replica, else round robin until
        the shortest replica's batches run out.
      row_sparse: indices into `params` of the row-sparse variables (see the
        module docstring); their gradients must be 0 outside the rows read.
      rows_fn: `batch -> {index: row ids}`, the rows of each row-sparse
        variable that `grad_fn` reads for `batch` (any shape, repeats allowed).

    Returns:
      `(ps_params, stats)`: the final ps parameters and a `ReplicaStats` per
      replica.
    """
    init, update = ps_optimizer
    ps = [np.array(p, copy=True) for p in params]
    ps_state = init(ps)
    ps_count = 0
    iters = [iter(b) for b in batches]
    n = len(iters)
    if order is None:
        lengths = [len(b) for b in batches]
        order = [r for _ in range(min(lengths)) for r in range(n)]
    if row_sparse and rows_fn is None:
        raise ValueError("Argument `rows_fn` is needed with `row_sparse`.")
    sparse = set(row_sparse)
    caches: list[list | None] = [None] * n
    accs = [[np.zeros_like(p) for p in ps] for _ in range(n)]
    seen = [0] * n
    refetch = [False] * n
    stats = [ReplicaStats() for _ in range(n)]
    model_bytes = sum(p.nbytes for i, p in enumerate(ps) if i not in sparse)
    row_bytes = {i: ps[i][0].nbytes for i in sparse}
    valid = [{i: set() for i in sparse} for _ in range(n)]  # Rows since a fetch.
    touched = [{i: set() for i in sparse} for _ in range(n)]  # Since a push.
    for r in order:
        if r != 0 and stats[0].steps < config.warmstart_steps:
            next(iters[r])  # The TF replica reads its batch, then does nothing.
            continue
        s = stats[r]
        t = s.steps
        if is_fetch_step(t, config.n_fetch) or refetch[r]:
            old = caches[r]
            caches[r] = [
                old[i] if i in sparse and old is not None else p.copy()
                for i, p in enumerate(ps)
            ]
            valid[r] = {i: set() for i in sparse}
            seen[r] = ps_count
            refetch[r] = False
            s.fetches += 1
            s.bytes_fetched += model_bytes
        batch = next(iters[r])
        for i, ids in (rows_fn(batch) if sparse else {}).items():
            ids = set(np.asarray(ids).reshape(-1).tolist())
            for row in ids - valid[r][i]:
                caches[r][i][row] = ps[i][row]
            s.row_bytes_fetched += len(ids - valid[r][i]) * row_bytes[i]
            s.bytes_fetched += len(ids - valid[r][i]) * row_bytes[i]
            valid[r][i] |= ids
            touched[r][i] |= ids
        g = grad_fn(caches[r], batch)
        caches[r] = [c - config.local_learning_rate * gi for c, gi in zip(caches[r], g)]
        accs[r] = [a + gi for a, gi in zip(accs[r], g)]
        if is_push_step(t, config.n_push):
            staleness = ps_count - seen[r]
            s.staleness_sum += staleness
            s.max_staleness_seen = max(s.max_staleness_seen, staleness)
            if config.max_staleness is None or staleness <= config.max_staleness:
                steps = config.n_push if config.adagrad_per_step else 1
                ps, ps_state = update(ps, ps_state, accs[r], steps)
                ps_count += 1
                seen[r] += 1
                s.pushes += 1
                s.bytes_pushed += model_bytes
                for i in sparse:
                    pushed_bytes = len(touched[r][i]) * (row_bytes[i] + 8)
                    s.row_bytes_pushed += pushed_bytes
                    s.bytes_pushed += pushed_bytes
            else:
                refetch[r] = True
                s.dropped_pushes += 1
            accs[r] = [np.zeros_like(a) for a in accs[r]]
            touched[r] = {i: set() for i in sparse}
        s.steps += 1
    return ps, stats
