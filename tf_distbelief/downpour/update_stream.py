"""Compressed outer pushes with update-stream fetches, in NumPy.

Downpour with the outer rule (`push_rules.outer_nesterov`: the ps applies
Nesterov SGD, `eta` and `mu`, to each pushed pseudo-gradient) and
`n_fetch == n_push == n`, as `schedule.simulate` runs it, with the ways of
compressing the exchange compared before any is built on the cluster
(`benchmarks/compression_sim.py`). `Exchange` holds them; with its defaults
(`Exchange()`) this is `schedule.simulate` with the outer rule. A replica's
step `t`:

1. **fetch** at `t % n == 0`. `fetch="whole"`: the mirror `w'` becomes the ps
   values. `fetch="stream"`: the ps keeps the ordered log of the pushes it
   applied (the last `window`); the replica *replays* those since its last
   fetch through the same Nesterov update on its mirror `w'` and momentum
   mirror `m'`, which then equal the ps's `w` and `m` exactly. A replica's
   first fetch, or one further behind than the log reaches, is whole.
   Then the cache: `residual="reset"`: `cache <- w'` (today's rule);
   `residual="parameter"`: `cache <- cache + (w' - w'_before)`, so that the
   cache keeps its own unsent progress (CocktailSGD's local/global pair).
2. **local step** on the cache (SGD or the replica's AdaGrad, as
   `schedule.simulate`), summing `acc <- acc + (before - after)`.
3. **push** at `(t + 1) % n == 0` of `D = C(u)`, `C` top-k then the quantiser
   (`push_rules.top_k`, `push_rules.quantize`), where:
   * `residual="reset"`: `u = acc + e`, then `e <- u - D` (error feedback);
   * `residual="parameter"`: `u = w' - cache`, then `cache <- cache + D`
     (the sent part comes back through the ps); every `error_reset`-th push
     also sets `cache <- w'`, dropping what was not sent (bounds the drift);
   * `dgc_momentum = rho > 0` (DGC's momentum correction, with "reset"):
     `vel <- rho * vel + acc`, `v <- v + vel`, `u = v`, `v <- v - D`, and
     `vel` is 0 at the positions sent.
   The ps applies Nesterov to `D` and appends it to the log. Push rules
   that correct or scale a push on the ps from its staleness and the outer
   momentum (`stale_damping`, `staleness_scaled`) apply before Nesterov, on
   the ps and in each replay alike (the log keeps each push's staleness). With
   `warmup_pushes = W` a replica's `j`-th push (from 0) keeps the fraction
   `f ** (min(j + 1, W) / W)` (DGC's density warm-up, dense towards `f`).

Bytes (`ExchangeStats`): a push sends its values (coded or not) and, with
top-k, its positions in `positions` (`position_codes`; `"wire"`: as the
cluster sends them), in `position_codes.wire_order`. A whole fetch sends
the model (with `fetch="stream"` and `mu > 0` the momentum too, to replay
from, once the ps has applied a push); a stream fetch sends each logged push
since the replica's last fetch (`STREAM_ID_BYTES` for its own, which it
already holds; the others' bytes plus that). The ps applies a push
atomically; there is no staleness limit (`max_staleness`) or warm start.
Pure: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tf_distbelief import checks
from tf_distbelief.downpour import position_codes, schedule
from tf_distbelief.downpour.push_rules import outer_nesterov, quantize, reference, top_k

__all__ = [
    "Exchange",
    "ExchangeStats",
    "STREAM_ID_BYTES",
    "STREAM_WINDOW",
    "compress",
    "simulate",
    "stream_window",
]

# A logged update's sequence number in a stream fetch (an int64).
STREAM_ID_BYTES = 8
# The least of the cluster's `window` (`stream_window`).
STREAM_WINDOW = 64
# Rounds of pushes a replica may be behind and still replay them.
_WINDOW_ROUNDS = 4
_RESIDUALS = ("reset", "parameter")
_FETCHES = ("whole", "stream")


def stream_window(num_workers: int) -> int:
    """The cluster's `window` (`stream_fetch`): pushes a replica may be
    behind a ps task's log and still replay them; further behind, its fetch
    is whole.

    With `n_fetch == n_push` a replica is about one push per replica behind
    at each fetch, `k` per replica when it runs `k` times slower than the
    others: the window covers 4 rounds of every replica's pushes, and at
    least `STREAM_WINDOW` pushes.

    Args:
      num_workers: the model replicas, an integer >= 1.

    Returns:
      `max(STREAM_WINDOW, 4 * num_workers)`.
    """
    checks.check_int("num_workers", num_workers, 1, ">= 1 (model replicas)")
    return max(STREAM_WINDOW, _WINDOW_ROUNDS * int(num_workers))


@dataclasses.dataclass(frozen=True)
class Exchange:
    """How pushes are compressed and fetches made (module docstring).

    Attributes:
      fraction: top-k's fraction of each tensor's entries, in `(0, 1]`, or
        None for dense pushes.
      chunk: top-k's chunk length (`top_k_chunk`; 0: the whole tensor).
      bits: the quantiser's bits, 0 (off), 2 or 8 (`quantize_bits`).
      quantize_chunk: values per scale (`quantize_chunk`).
      residual: `"reset"` (the cache becomes the mirror at each fetch, the
        unsent part waits in `e`) or `"parameter"` (the cache keeps it).
      fetch: `"whole"` or `"stream"` (replay of the ps's update log).
      window: the log's length in updates; None: unbounded.
      error_reset: with `"parameter"`, drop the unsent progress at every
        this many pushes of a replica; 0: never.
      warmup_pushes: pushes over which the density falls to `fraction`; 0:
        none.
      dgc_momentum: DGC's momentum correction `rho`, in `[0, 1)`; 0: off.
      positions: the positions' coding, one of `position_codes.CODINGS`.
    """

    fraction: float | None = None
    chunk: int = 0
    bits: int = 0
    quantize_chunk: int = quantize.QUANTIZE_CHUNK
    residual: str = "reset"
    fetch: str = "whole"
    window: int | None = None
    error_reset: int = 0
    warmup_pushes: int = 0
    dgc_momentum: float = 0.0
    positions: str = "int32"

    def __post_init__(self):
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise checks.argument_error(
                "fraction", "in (0, 1] or None (dense)", self.fraction
            )
        checks.check_int("chunk", self.chunk, 0, "0: the whole tensor")
        if self.bits not in quantize.BITS:
            raise checks.argument_error("bits", f"one of {quantize.BITS}", self.bits)
        checks.check_int("quantize_chunk", self.quantize_chunk, 1, "values per scale")
        checks.check_one_of("residual", self.residual, _RESIDUALS)
        checks.check_one_of("fetch", self.fetch, _FETCHES)
        if self.window is not None:
            checks.check_int("window", self.window, 1, "updates, or None")
        checks.check_int("error_reset", self.error_reset, 0, "pushes (0: never)")
        checks.check_int("warmup_pushes", self.warmup_pushes, 0, "pushes (0: none)")
        checks.check_one_of("positions", self.positions, position_codes.CODINGS)
        if not 0 <= self.dgc_momentum < 1:
            raise checks.argument_error("dgc_momentum", "in [0, 1)", self.dgc_momentum)
        if self.error_reset and self.residual != "parameter":
            raise checks.argument_error(
                "error_reset",
                "0 unless `residual` is 'parameter' (only a kept residual drifts)",
                self.error_reset,
            )
        if self.warmup_pushes and self.fraction is None:
            raise checks.argument_error(
                "warmup_pushes", "0 without a top-k `fraction`", self.warmup_pushes
            )
        if self.dgc_momentum and self.residual != "reset":
            raise checks.argument_error(
                "dgc_momentum",
                "0 unless `residual` is 'reset' (its buffer is the residual)",
                self.dgc_momentum,
            )

    def fraction_at(self, push: int) -> float | None:
        """The top-k fraction of a replica's push number `push` (from 0)."""
        if self.fraction is None or not self.warmup_pushes:
            return self.fraction
        return self.fraction ** (min(push + 1, self.warmup_pushes) / self.warmup_pushes)


@dataclasses.dataclass
class ExchangeStats:
    """Counters of one replica.

    Attributes:
      steps: local steps taken.
      fetches: fetches done; `whole_fetches` of them whole.
      whole_fetches: fetches that sent the whole model.
      pushes: pushes applied.
      updates_replayed: logged updates replayed into the mirror.
      bytes_pushed: push bytes (module docstring).
      bytes_fetched: fetch bytes (module docstring).
    """

    steps: int = 0
    fetches: int = 0
    whole_fetches: int = 0
    pushes: int = 0
    updates_replayed: int = 0
    bytes_pushed: int = 0
    bytes_fetched: int = 0


def _top_k_positions(flat: np.ndarray, chunk: int, fraction: float) -> np.ndarray:
    """`top_k.TopK.reference_select`'s positions, by partial sort: each
    chunk's kept entries by decreasing magnitude, ties the lower first."""
    kept, start = [], 0
    for m, k in top_k.chunk_counts(flat.size, chunk, fraction):
        magnitudes = np.abs(flat[start : start + m])
        least = np.partition(magnitudes, m - k)[m - k]  # The k-th largest.
        above = np.flatnonzero(magnitudes > least)
        ties = np.flatnonzero(magnitudes == least)[: k - above.size]
        best = np.concatenate([above, ties])
        kept.append(best[np.lexsort((best, -magnitudes[best]))] + start)
        start += m
    return np.concatenate(kept)


def compress(values: list, exchange: Exchange, fraction: float | None) -> tuple:
    """What the ps receives of a push of `values`, and the positions sent.

    Args:
      values: the arrays to push.
      exchange: the `Exchange` (its chunk and quantiser).
      fraction: the top-k fraction of this push, or None.

    Returns:
      `(sent, positions)`: per value, the decoded array (0 where nothing was
      sent) and the flat positions sent (None without top-k).
    """
    coder = None
    if exchange.bits:
        settings = types.SimpleNamespace(
            quantize_bits=exchange.bits, quantize_chunk=exchange.quantize_chunk
        )
        coder = quantize.Quantize(settings)
    sent, positions = [], []
    for v in values:
        flat = v.reshape(-1)
        where = None
        kept = flat
        if fraction is not None:
            where = position_codes.wire_order(
                _top_k_positions(flat, exchange.chunk, fraction), flat.size
            )
            kept = flat[where]
        if coder is not None:
            kept = coder.reference_code(kept)
        out = np.zeros_like(flat)
        out[slice(None) if where is None else where] = kept
        sent.append(out.reshape(v.shape))
        positions.append(where)
    return sent, positions


def _push_nbytes(exchange: Exchange, sent: list, positions: list) -> int:
    """Bytes of a push: values, coded or not, and positions (module docstring)."""
    total = 0
    for s, where in zip(sent, positions):
        count = s.size if where is None else where.size
        if exchange.bits:
            total += -(-count // 4) if exchange.bits == 2 else count
            total += -(-count // exchange.quantize_chunk) * s.itemsize
        else:
            total += count * s.itemsize
        if where is not None:
            total += position_codes.position_nbytes(where, s.size, exchange.positions)
    return total


def _check_config(config) -> None:
    """Raises unless `config` is the outer rule, with only push rules a
    replay can apply (`push_rules.rule.check_compressible`; compression is
    `Exchange`'s), and `n_fetch == n_push`.

    Raises:
      ArgumentError: naming the field of `config` refused.
    """
    others = [
        r.name
        for r in config.rules
        if r.name != "outer_learning_rate"
        and (r.compresses or r.needs_fetched or r.marks_changes)
    ]
    if config.outer_learning_rate is None:
        raise checks.argument_error(
            "config",
            "set (the outer rule)",
            None,
            field="outer_learning_rate",
        )
    if others:
        raise checks.argument_error(
            "config",
            "the outer rule, and no rule that compresses (compression is "
            "`exchange`'s) or reads what a replica fetched",
            others,
            field="rules",
        )
    if config.n_fetch != config.n_push:
        raise checks.argument_error(
            "config",
            f"`n_push` ({config.n_push}): a fetch starts each round",
            config.n_fetch,
            field="n_fetch",
        )
    if config.max_staleness is not None:
        raise checks.argument_error(
            "config", "None", config.max_staleness, field="max_staleness"
        )
    if config.warmstart_steps:
        raise checks.argument_error(
            "config", "0", config.warmstart_steps, field="warmstart_steps"
        )


def _apply(rules, params, momentum, sent, staleness, eta, mu) -> tuple:
    """One push of `sent` applied as the ps does: the rules' corrections and
    factor (`push_rules.reference.corrected`, the outer momentum `momentum`
    their state), then Nesterov. Returns `(params, momentum)`."""
    grads, scale = reference.corrected(
        rules, sent, params, None, staleness, lambda name: momentum
    )
    if scale is not None:
        grads = [g * scale for g in grads]
    return outer_nesterov.nesterov(params, momentum, grads, eta, mu)


def simulate(
    params: Sequence[np.ndarray],
    grad_fn: Callable[[list, object], list],
    batches: Sequence[Iterable],
    config,
    exchange: Exchange,
    ps_learning_rate: float | None = None,
    order: Sequence[int] | None = None,
    local_adagrad: tuple[float, float] = (0.1, 1e-7),
    after_step: Callable[[int, list, list], None] | None = None,
    final_round: bool = False,
) -> tuple[list[np.ndarray], list[ExchangeStats]]:
    """Runs Downpour with the outer rule and `exchange`, one local step at a time.

    Args:
      params: the initial ps parameters, a list of arrays.
      grad_fn: `(params, batch) -> grads`, lists of arrays of the same shapes.
      batches: one iterable of batches per replica, in that replica's order.
      config: a `DownpourConfig` with `outer_learning_rate`, `n_fetch ==
        n_push`, no other push rule but those applied from a push's
        staleness and the outer momentum, no `max_staleness`, no warm start.
      exchange: the `Exchange`.
      ps_learning_rate: the local step size's default, as `schedule.simulate`
        takes it from the ps optimizer (`local_learning_rate_for`).
      order: the replica taking each step; default round robin until the
        shortest replica's batches run out (one replica: all of them).
      local_adagrad: `(initial_accumulator_value, epsilon)` of the local
        AdaGrad step.
      after_step: called as `after_step(steps_done, ps_params, stats)` after
        every local step of any replica (e.g. to evaluate at given steps).
      final_round: after the last step, the ps moves by the mean of the
        replicas' unsent progress, `w <- w - u_r / W` for `r = 0 .. W-1`,
        `u_r` the mirror less the cache with `residual="parameter"`, else the
        summed steps since its last push plus its residual
        (`downpour.final_round`, as `fit` ends a job).

    Returns:
      `(ps_params, stats)`: the final ps parameters and an `ExchangeStats`
      per replica.

    Raises:
      ArgumentError: `config` is not as above.
    """
    _check_config(config)
    eta, mu = float(config.outer_learning_rate), float(config.outer_momentum)
    n = config.n_push
    local_lr = config.local_learning_rate_for(ps_learning_rate)
    local_a0, local_epsilon = local_adagrad
    ps = [np.array(p, copy=True) for p in params]
    momentum = [np.zeros_like(p) for p in ps]
    iters = [iter(b) for b in batches]
    replicas = len(iters)
    if order is None:
        order = [
            r for _ in range(min(len(b) for b in batches)) for r in range(replicas)
        ]
    zeros = [np.zeros_like(p) for p in ps]
    model_bytes = sum(p.nbytes for p in ps)
    caches: list = [None] * replicas
    mirrors: list = [None] * replicas
    mirror_momentum: list = [None] * replicas
    accs = [list(zeros) for _ in range(replicas)]
    residuals = [list(zeros) for _ in range(replicas)]
    velocities = [list(zeros) for _ in range(replicas)]
    local_accs = [[np.full_like(p, local_a0) for p in ps] for _ in range(replicas)]
    seq = [0] * replicas  # Per replica: the log's length at its last fetch.
    # `(replica, sent, nbytes)` per applied push not yet replayed by every
    # replica, in order; the ps keeps the last `window` (`behind` below).
    log: list = []
    log_start = 0  # The sequence number of `log[0]`.
    stats = [ExchangeStats() for _ in range(replicas)]
    done = 0
    for r in order:
        s = stats[r]
        t = s.steps
        if t % n == 0:
            old = mirrors[r]
            total = log_start + len(log)
            behind = exchange.window is not None and total - seq[r] > exchange.window
            if exchange.fetch == "whole" or old is None or behind:
                mirrors[r] = [p.copy() for p in ps]
                mirror_momentum[r] = [m.copy() for m in momentum]
                s.whole_fetches += 1
                s.bytes_fetched += model_bytes
                if exchange.fetch == "stream" and mu and total:
                    s.bytes_fetched += model_bytes  # The momentum, to replay from.
            else:
                w, m = mirrors[r], mirror_momentum[r]
                for who, sent, nbytes, stale in log[seq[r] - log_start :]:
                    w, m = _apply(config.rules, w, m, sent, stale, eta, mu)
                    s.bytes_fetched += STREAM_ID_BYTES + (nbytes if who != r else 0)
                    s.updates_replayed += 1
                mirrors[r], mirror_momentum[r] = w, m
            seq[r] = total
            s.fetches += 1
            # What every replica holding a mirror has replayed is not needed.
            needed = min(seq[q] for q in range(replicas) if mirrors[q] is not None)
            if needed > log_start:
                del log[: needed - log_start]
                log_start = needed
            if exchange.residual == "parameter" and old is not None:
                caches[r] = [c + (a - b) for c, a, b in zip(caches[r], mirrors[r], old)]
            else:
                caches[r] = [w.copy() for w in mirrors[r]]
        g = grad_fn(caches[r], next(iters[r]))
        before = caches[r]
        caches[r], local_accs[r] = schedule.local_step(
            config.local_optimizer, caches[r], local_accs[r], g, local_lr, local_epsilon
        )
        accs[r] = [a + (b - c) for a, b, c in zip(accs[r], before, caches[r])]
        if (t + 1) % n == 0:
            fraction = exchange.fraction_at(s.pushes)
            if exchange.residual == "parameter":
                unsent = [w - c for w, c in zip(mirrors[r], caches[r])]
            elif exchange.dgc_momentum:
                rho = exchange.dgc_momentum
                velocities[r] = [rho * u + a for u, a in zip(velocities[r], accs[r])]
                unsent = [v + u for v, u in zip(residuals[r], velocities[r])]
            else:
                unsent = [a + e for a, e in zip(accs[r], residuals[r])]
            sent, positions = compress(unsent, exchange, fraction)
            if exchange.residual == "parameter":
                caches[r] = [c + d for c, d in zip(caches[r], sent)]
                if exchange.error_reset and (s.pushes + 1) % exchange.error_reset == 0:
                    caches[r] = [w.copy() for w in mirrors[r]]
            else:
                residuals[r] = [u - d for u, d in zip(unsent, sent)]
            if exchange.dgc_momentum:
                for u, where in zip(velocities[r], positions):
                    u.reshape(-1)[slice(None) if where is None else where] = 0
            stale = log_start + len(log) - seq[r]  # Pushes since its fetch.
            ps, momentum = _apply(config.rules, ps, momentum, sent, stale, eta, mu)
            nbytes = _push_nbytes(exchange, sent, positions)
            if exchange.fetch == "stream":
                log.append((r, sent, nbytes, stale))
            else:
                log_start += 1
            s.pushes += 1
            s.bytes_pushed += nbytes
            accs[r] = list(zeros)
        s.steps += 1
        done += 1
        if after_step is not None:
            after_step(done, ps, stats)
    if final_round:
        for r in range(replicas):
            if caches[r] is None:
                continue
            if exchange.residual == "parameter":
                unsent = [w - c for w, c in zip(mirrors[r], caches[r])]
            else:
                unsent = [a + e for a, e in zip(accs[r], residuals[r])]
            ps = [p - u / replicas for p, u in zip(ps, unsent)]
    return ps, stats
