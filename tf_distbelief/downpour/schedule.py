"""Downpour SGD without TensorFlow: the cadence rules and a NumPy reference.

Dean et al. 2012, section 4.1. Every model replica keeps a local copy (the
*cache*) of the parameters and counts its own local steps `t = 0, 1, 2, ...`.
At local step `t` a replica does, in this order:

1. **fetch** if `t % n_fetch == 0`, or if its previous push was dropped for
   staleness: `cache <- ps parameters`, `seen <- ps update count`.
2. **gradient** `g = grad loss(cache; batch_t)`, at the *cached* values.
3. **local update** of the cache with `g`: by default an AdaGrad step with
   the replica's own accumulator (`local_optimizer = "adagrad"`:
   `b <- b + g^2`, `cache <- cache - local_learning_rate * g / (sqrt(b) +
   epsilon)`; `b` is never fetched or pushed and survives fetches), or an SGD
   step `cache <- cache - local_learning_rate * g` (`"sgd"`).
4. **accumulate** `acc <- acc + g`, and with AdaGrad on the ps (the default
   `adagrad_accumulator = "squares"`) `sq <- sq + g^2`.
5. **push** if `(t + 1) % n_push == 0`: `staleness = ps update count - seen`
   (updates by *other* replicas since this replica's cache was fetched). If
   `max_staleness` is None or `staleness <= max_staleness`, the ps applies
   its optimizer (AdaGrad, SGD, ...) to `acc` (AdaGrad grows its
   accumulator by the pushed `sq`, see `DownpourConfig.adagrad_accumulator`),
   the ps update count grows by 1 and `seen` by the same (the replica's own
   push is not staleness). Otherwise the push is dropped and the replica
   fetches at its next step. Either way `acc <- 0` and `sq <- 0`.

**Push rules** (`DownpourConfig.rules`, each off by default; one module each
in `push_rules`), at step 5 as `push_rules.reference.ReferenceRules` composes
them: each rule's correction of `acc` (e.g. DC-ASGD's `acc + lambda * acc *
acc * (ps - fetched)`, `fetched` the ps values at the replica's last fetch),
the step's factors (e.g. `1 / max(staleness, 1)`), then the rule replacing
the ps optimizer (e.g. outer Nesterov SGD) or the ps optimizer's scaled step.
With a rule that `pushes_deltas` (the outer optimizer), step 4 sums the local
steps, `acc <- acc + (cache before step 3 - cache after)`, and no squares go
along.

**Compressed pushes** (top-k, the quantiser): an applied push sends
`C(acc + e)` and sets `e <- acc + e - C(acc + e)`, `e` the replica's residual
(`push_rules.reference`); a dropped push leaves `e` as it was.

**Row-sparse variables** (large embedding tables) are not copied whole: a
fetch only marks the replica's cached rows stale, and at step 2 each row the
batch looks up is fetched if it has not been since the last fetch. Steps 3
and 4 touch only the looked-up rows; a push sends the rows touched since the
last push (values and int64 indices). The ps optimizers here (AdaGrad, SGD)
leave a row with no gradient unchanged, so the update equals the dense one.

After `S` local steps a replica has fetched `ceil(S / n_fetch)` times (without
drops) and pushed `floor(S / n_push)` times. With `n_fetch = n_push = 1` and
one replica this is sequential training with the ps optimizer (`sq` is then
`g^2`, and is not sent).

The ps applies pushes shard by shard as they arrive, with no locks; the
reference below applies a whole push atomically (the two agree with one
replica, and with several as long as pushes do not overlap in time).
`DownpourConfig` (`config`) holds the settings; why the local AdaGrad step
and the pushed squares are the defaults: docs/downpour.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tf_distbelief.adagrad import rule as adagrad_rule
from tf_distbelief.downpour.config import (
    DownpourConfig,
)
from tf_distbelief.downpour.push_rules import reference as push_reference
from tf_distbelief.downpour.push_rules import sparse_fetches as sparse_fetches_rule
from tf_distbelief.downpour.push_rules.reference import ReferenceRules

__all__ = [
    # The step order.
    "ReplicaStats",
    "adagrad_ps",
    "is_fetch_step",
    "is_push_step",
    "local_step",
    "num_fetches",
    "num_pushes",
    "sgd_ps",
    "simulate",
    "steps_to_fetch",
    "steps_to_push",
]

# The cadence rules below use only `%`, `-`, `+` and `==`, so they hold for
# Python ints (`simulate`) and for int64 tensors alike: the TF replica
# (`replica.Downpour`) calls them on its step counter.


def is_fetch_step(t, n_fetch):
    """True when local step `t` (from 0) starts with a fetch: `t % n_fetch == 0`.

    Args:
      t: the local step, an int or an integer tensor.
      n_fetch: `DownpourConfig.n_fetch`, an int >= 1.

    Returns:
      A bool, or a bool tensor for a tensor `t`.
    """
    return t % n_fetch == 0


def is_push_step(t, n_push):
    """True when local step `t` (from 0) ends with a push: `(t + 1) % n_push == 0`.

    Args and returns as for `is_fetch_step`, with `n_push`.
    """
    return (t + 1) % n_push == 0


def steps_to_fetch(t, n_fetch):
    """Local steps from step `t` (included) to the next fetch, in `1..n_fetch`.

    The next fetch starts step `t + steps_to_fetch(t, n_fetch)` (without
    dropped pushes). Works on ints and integer tensors, as `is_fetch_step`.
    """
    return n_fetch - t % n_fetch


def steps_to_push(t, n_push):
    """Local steps from step `t` (included) to the next push, in `1..n_push`.

    The next push ends step `t + steps_to_push(t, n_push) - 1`: 1 when `t`
    itself ends with one. Works on ints and integer tensors, as `is_push_step`.
    """
    return n_push - t % n_push


def num_fetches(steps: int, n_fetch: int) -> int:
    """Fetches in the first `steps` local steps (no dropped pushes)."""
    return -(-steps // n_fetch)


def num_pushes(steps: int, n_push: int) -> int:
    """Pushes in the first `steps` local steps."""
    return steps // n_push


# A ps optimizer: `(params, state, grads, steps, squares) -> (params, state)`,
# lists of arrays; `grads` is the sum of `steps` local steps' gradients, and
# `squares` None or the sum of their squares (`DownpourConfig.adagrad_accumulator`).
PsUpdate = Callable[[list, list, list, int, list | None], tuple[list, list]]


def adagrad_ps(
    learning_rate: float, initial_accumulator_value: float = 0.1, epsilon=1e-7
) -> tuple[Callable[[list], list], PsUpdate]:
    """AdaGrad on the ps as `(init_state, update)`, as in `tf_distbelief.adagrad`.

    A push of `G` grows the accumulator `a` by the pushed `squares` when given,
    else by `G^2 / steps`, then subtracts `learning_rate * G / (sqrt(a) +
    epsilon)` (`DownpourConfig.adagrad_accumulator`).
    """

    def init(params):
        return [np.full_like(p, initial_accumulator_value) for p in params]

    def update(params, state, grads, steps, squares=None):
        out = [
            adagrad_rule.adagrad_update(p, a, g, learning_rate, epsilon, steps, sq)
            for p, a, g, sq in zip(params, state, grads, squares or [None] * len(grads))
        ]
        return [w for w, _ in out], [a for _, a in out]

    update.learning_rate = learning_rate  # The local AdaGrad step's default.
    update.takes_squares = True  # Pushes send the squared gradients along.
    return init, update


def sgd_ps(learning_rate: float) -> tuple[Callable[[list], list], PsUpdate]:
    """Plain SGD on the ps as `(init_state, update)`."""

    def update(params, state, grads, steps, squares=None):
        del steps, squares  # A pushed sum already moves as far as its steps.
        return [p - learning_rate * g for p, g in zip(params, grads)], state

    update.learning_rate = learning_rate
    return (lambda params: []), update


@dataclasses.dataclass
class ReplicaStats:
    """Counters of one replica, as kept by the TF implementation.

    Attributes:
      steps: local steps taken.
      fetches: fetches done.
      pushes: pushes applied on the ps.
      dropped_pushes: pushes dropped for exceeding `max_staleness`.
      nonfinite_pushes: pushes dropped for a NaN or inf (`nonfinite="skip"`,
        `tf_distbelief.downpour.push_guard`).
      staleness_sum: sum of the staleness of all pushes (applied or dropped).
      max_staleness_seen: the largest staleness of a push.
      bytes_fetched: parameter bytes fetched (`fetches` times the size of the
        cached variables, plus `row_bytes_fetched`).
      bytes_pushed: gradient bytes pushed, twice the model's per push when the
        squared gradients go along (`DownpourConfig.pushes_squares`); a
        dropped push sends nothing (the staleness check comes first);
        `row_bytes_pushed` included.
      row_bytes_fetched: bytes of the rows of row-sparse variables fetched.
      row_bytes_pushed: bytes of the rows of row-sparse variables pushed (their
        squares too when they go along), an 8-byte int64 row index included
        per row.
    """

    steps: int = 0
    fetches: int = 0
    pushes: int = 0
    dropped_pushes: int = 0
    nonfinite_pushes: int = 0
    staleness_sum: int = 0
    max_staleness_seen: int = 0
    bytes_fetched: int = 0
    bytes_pushed: int = 0
    row_bytes_fetched: int = 0
    row_bytes_pushed: int = 0


def local_step(
    optimizer: str,
    cache: list,
    accumulators: list,
    grads: list,
    learning_rate: float,
    epsilon: float,
) -> tuple[list, list]:
    """One local step of a replica on its parameter cache, in NumPy.

    Args:
      optimizer: `"sgd"` or `"adagrad"` (`DownpourConfig.local_optimizer`).
      cache: the replica's parameters, a list of arrays.
      accumulators: the local AdaGrad accumulators (unused by SGD).
      grads: the gradients, shaped as `cache`.
      learning_rate: the local step size.
      epsilon: AdaGrad's epsilon.

    Returns:
      `(cache, accumulators)` after the step (new arrays).
    """
    if optimizer == "sgd":
        return [c - learning_rate * g for c, g in zip(cache, grads)], accumulators
    stepped = [
        adagrad_rule.adagrad_update(c, b, g, learning_rate, epsilon)
        for c, b, g in zip(cache, accumulators, grads)
    ]
    return [c for c, _ in stepped], [b for _, b in stepped]


def simulate(
    params: Sequence[np.ndarray],
    grad_fn: Callable[[list, object], list],
    batches: Sequence[Iterable],
    config: DownpourConfig,
    ps_optimizer: tuple[Callable[[list], list], PsUpdate],
    order: Sequence[int] | None = None,
    row_sparse: Sequence[int] = (),
    rows_fn: Callable[[object], dict] | None = None,
    local_adagrad: tuple[float, float] = (0.1, 1e-7),
    final_round: bool = False,
) -> tuple[list[np.ndarray], list[ReplicaStats]]:
    """Runs Downpour in NumPy, one whole local step at a time.

    Args:
      params: the initial ps parameters, a list of arrays.
      grad_fn: `(params, batch) -> grads`, lists of arrays of the same shapes.
      batches: one iterable of batches per replica, in that replica's order.
      config: the cadence. Until replica 0 has taken `warmstart_steps` steps, a
        step of another replica reads its batch and changes nothing.
      ps_optimizer: `(init_state, update)`, e.g. `adagrad_ps(0.1)`; its
        learning rate (`update.learning_rate`, if set) is the local step
        size's default (`DownpourConfig.local_learning_rate_for`), and pushes
        send the squared gradients only if `update.takes_squares` is True.
      order: the replica taking each step, e.g. `[0, 1, 0, 1]`; default all of
        replica 0's batches when there is one replica, else round robin until
        the shortest replica's batches run out.
      row_sparse: indices into `params` of the row-sparse variables (see the
        module docstring); their gradients must be 0 outside the rows read.
      rows_fn: `batch -> {index: row ids}`, the rows of each row-sparse
        variable that `grad_fn` reads for `batch` (any shape, repeats allowed).
      local_adagrad: `(initial_accumulator_value, epsilon)` of the local
        AdaGrad step, as the TF replica takes them from the ps AdaGrad.
      final_round: with `config.has_final_round`, after the last step the
        ps moves by the mean of the replicas' unsent progress, `w <- w - u_r
        / W` for `r = 0 .. W-1`, `u_r` the replica's summed steps since its
        last push (and its residual; `downpour.final_round`, as `fit` ends a
        job; compressed outer pushes are `update_stream.simulate`'s).

    Returns:
      `(ps_params, stats)`: the final ps parameters and a `ReplicaStats` per
      replica.

    Raises:
      ValueError: `row_sparse` without `rows_fn`, or no local step size (see
        `DownpourConfig.local_learning_rate_for`).
    """
    init, update = ps_optimizer
    local_lr = config.local_learning_rate_for(getattr(update, "learning_rate", None))
    local_a0, local_epsilon = local_adagrad
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
    squares = [[np.zeros_like(p) for p in ps] for _ in range(n)]
    local_accs = [[np.full_like(p, local_a0) for p in ps] for _ in range(n)]
    seen = [0] * n
    refetch = [False] * n
    stats = [ReplicaStats() for _ in range(n)]
    model_bytes = sum(p.nbytes for i, p in enumerate(ps) if i not in sparse)
    # Sent per push: `G`, and the squares where the ps optimizer takes them.
    takes_squares = config.pushes_squares and getattr(update, "takes_squares", False)
    takes_squares = takes_squares and not config.pushes_deltas
    copies = 2 if takes_squares else 1
    row_bytes = {i: ps[i][0].nbytes for i in sparse}
    if sparse and config.push_rules:
        raise ValueError(
            f"Push rules {', '.join(config.push_rules)} take no row-sparse "
            f"variables. Received: row_sparse={list(row_sparse)}"
        )
    deltas = config.pushes_deltas
    rules = ReferenceRules(config, ps)
    # Compressed pushes: what each replica has not sent yet (error feedback).
    residuals = [[np.zeros_like(p) for p in ps] for _ in range(n)]
    compressed_bytes = push_reference.push_nbytes(config.rules, ps)
    push_bytes = copies * model_bytes
    if compressed_bytes is not None:
        push_bytes = compressed_bytes
    fetched = [None] * n  # Per replica: the ps values at its last fetch.
    # Sparse fetches: per replica, the entries changed since its last fetch,
    # and whether it holds a whole fetch (`push_rules.sparse_fetches`).
    sparse_fetches = any(rule.marks_changes for rule in config.rules)
    changed = [[np.ones(p.shape, bool) for p in ps] for _ in range(n)]
    whole = [False] * n
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
            fetched[r] = [p.copy() for p in ps]
            s.fetches += 1
            if sparse_fetches and whole[r]:
                s.bytes_fetched += sparse_fetches_rule.fetch_nbytes(changed[r], ps)
            else:
                s.bytes_fetched += model_bytes
            whole[r] = True
            changed[r] = [np.zeros(p.shape, bool) for p in ps]
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
        before = caches[r]
        caches[r], local_accs[r] = local_step(
            config.local_optimizer, caches[r], local_accs[r], g, local_lr, local_epsilon
        )
        if deltas:  # The pushed pseudo-gradient: the local steps' sum.
            g_acc = [b - c for b, c in zip(before, caches[r])]
        else:
            g_acc = g
        accs[r] = [a + gi for a, gi in zip(accs[r], g_acc)]
        squares[r] = [q + gi * gi for q, gi in zip(squares[r], g)]
        if is_push_step(t, config.n_push):
            staleness = ps_count - seen[r]
            s.staleness_sum += staleness
            s.max_staleness_seen = max(s.max_staleness_seen, staleness)
            if config.max_staleness is None or staleness <= config.max_staleness:
                mode = config.adagrad_accumulator
                pushed = accs[r]
                if compressed_bytes is not None:
                    unsent = [a + e for a, e in zip(accs[r], residuals[r])]
                    pushed = push_reference.compress(config.rules, unsent)
                    residuals[r] = [u - p for u, p in zip(unsent, pushed)]
                ps, ps_state = rules.apply(
                    update,
                    ps,
                    ps_state,
                    pushed,
                    config.n_push if mode == "mean" else 1,
                    squares[r] if takes_squares else None,
                    staleness,
                    fetched[r],
                )
                if sparse_fetches:  # Every replica's next fetch sends these.
                    for q in range(n):
                        changed[q] = [c | (x != 0) for c, x in zip(changed[q], pushed)]
                ps_count += 1
                seen[r] += 1
                s.pushes += 1
                s.bytes_pushed += push_bytes
                for i in sparse:
                    pushed_bytes = len(touched[r][i]) * (copies * row_bytes[i] + 8)
                    s.row_bytes_pushed += pushed_bytes
                    s.bytes_pushed += pushed_bytes
            else:
                refetch[r] = True
                s.dropped_pushes += 1
            accs[r] = [np.zeros_like(a) for a in accs[r]]
            squares[r] = [np.zeros_like(a) for a in accs[r]]
            touched[r] = {i: set() for i in sparse}
        s.steps += 1
    if final_round and config.has_final_round:
        for r in range(n):
            if caches[r] is None:
                continue
            unsent = [a + e for a, e in zip(accs[r], residuals[r])]
            ps = [p - u / n for p, u in zip(ps, unsent)]
    return ps, stats
