"""Downpour's configuration: the cadence, the local update and the push rules.

Dean et al. 2012, section 4.1; the push rules (`DownpourConfig`'s
`outer_learning_rate`, `delay_compensation`, `staleness_scaled`) follow later
papers, cited there. Pure Python and NumPy (no TensorFlow): the NumPy
reference (`schedule.simulate`), the launch flags and the TF replica
(`replica.Downpour`) all take a `DownpourConfig`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = [
    "ADAGRAD_ACCUMULATORS",
    "OUTER_MOMENTUM",
    "LOCAL_LEARNING_RATE",
    "LOCAL_OPTIMIZERS",
    "DownpourConfig",
]

# The default SGD step of a replica on its cache (`DownpourConfig` with
# `local_optimizer="sgd"`): at 0.05 digits at n=16 reached 0.75 test accuracy
# in `benchmarks/downpour_bench.py`, at 0.5 0.98.
LOCAL_LEARNING_RATE = 0.5
# The values `DownpourConfig.local_optimizer` and `.adagrad_accumulator` take.
LOCAL_OPTIMIZERS = ("adagrad", "sgd")
ADAGRAD_ACCUMULATORS = ("squares", "mean", "sum")
# The outer Nesterov momentum's default: DiLoCo's (Douillard et al. 2023,
# section 3) and Async Local-SGD's (Liu et al. 2024) 0.9.
OUTER_MOMENTUM = 0.9


def _check_int(name: str, value, lower: int, rule: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"Argument `{name}` must be an integer. Received: {value!r}")
    if value < lower:
        raise ValueError(f"Argument `{name}` must be {rule}. Received: {value!r}")


def _check_float(name: str, value, or_what: str = "", rule: str = "") -> None:
    """Raises unless `value` is a real number, finite and, by `rule`, in range.

    `rule` is `">= 0"`, `"> 0"` or `""` (any finite value).
    """
    alternative = f" or {or_what}" if or_what else ""
    if isinstance(value, bool) or not isinstance(
        value, (int, float, np.floating, np.integer)
    ):
        raise TypeError(
            f"Argument `{name}` must be a float{alternative}. Received: {value!r}"
        )
    try:
        finite = math.isfinite(float(value))
    except OverflowError:  # An int beyond float range.
        finite = False
    if finite and rule == ">= 0":
        finite = value >= 0
    elif finite and rule == "> 0":
        finite = value > 0
    if not finite:
        rule = f" and {rule}" if rule else ""
        raise ValueError(
            f"Argument `{name}` must be finite{rule}{alternative}. Received: {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class DownpourConfig:
    """The Downpour cadence and local update (Dean et al. 2012, section 4.1).

    Attributes:
      n_fetch: local steps between fetches of the parameters, >= 1. The paper's
        runs used 1.
      n_push: local steps between pushes of the accumulated gradient, >= 1;
        independent of `n_fetch`. The paper's runs used 1.
      local_learning_rate: step size of the replica's update of its own cache
        (`local_optimizer`), a float >= 0, or None (default): the ps
        optimizer's learning rate (AdaGrad's `gamma`) for `"adagrad"`
        (`local_learning_rate_for`), and
        `LOCAL_LEARNING_RATE` (0.5, tuned for digits) for `"sgd"`. 0 keeps the
        cache at the fetched values between fetches: a push then applies
        `n_push` steps along gradients taken near one point (the launch
        script's digits job at n=16 stayed at chance, 0.096, with SGD at 0).
      warmstart_steps: the paper's warm start: until replica 0 has taken this
        many local steps, the other replicas' steps change nothing; 0 for none.
      max_staleness: the most ps updates by other replicas that may land
        between a replica's fetch and its push for the push to be applied; a
        staler push is dropped and the replica refetches. None (default)
        applies every push, as the paper does.
      local_optimizer: the update of the cache at each local step: `"adagrad"`
        (default) with an accumulator of the replica's own, started at the ps
        AdaGrad's `initial_accumulator_value` (0.1 otherwise) and kept across
        fetches, so that the replica's path between pushes takes AdaGrad's
        per-parameter steps, as the ps does (about: a replica's accumulator
        sees only its own gradients, about `1/N` of the ps one with `N`
        replicas, so its steps are up to `sqrt(N)` times larger); or `"sgd"`.
        No bytes on the network; worker memory: one more copy of the model,
        and one more with `"squares"` pushes (the accumulator's value at the
        last push, whose growth since is the pushed squares).
      adagrad_accumulator: with AdaGrad on the ps (`tf_distbelief.adagrad`),
        how a push of `G`, the gradients of `n_push` steps summed, grows the
        accumulator `a` before the parameters move by `gamma * G / (sqrt(a) +
        epsilon)`: `"squares"` (default) by the pushed sum of the steps'
        squared gradients, the paper's `sum_j g_j^2` exactly (the push sends
        it along: twice the bytes of a push when `n_push > 1`); `"mean"` by
        `G^2 / n_push`, as `n_push` steps of the mean gradient
        (`Adagrad.apply_summed_gradient`); `"sum"` by `G^2`, `G` as one
        update (about `gamma` per push whatever `n_push` is, so `n_push`
        times fewer ps steps per example). All three agree at `n_push = 1`;
        other ps optimizers ignore it.
      outer_learning_rate: None (default): off. A float > 0: the outer
        optimizer on pushes (DiLoCo, Douillard et al. 2023, "DiLoCo:
        Distributed Low-Communication Training of Language Models", algorithm
        1; Async Local-SGD, Liu et al. 2024, "Asynchronous Local-SGD Training
        for Language Modeling", section 3). A push then sends the replica's
        *pseudo-gradient*: the sum of its local steps since its last push
        (the cache's decrease), which with `n_fetch == n_push` and no dropped
        push is the parameter delta since the last fetch, `w_fetched -
        cache`; the ps applies SGD with Nesterov momentum to it in place of
        the compiled optimizer: `m <- mu * m - eta * D`, `w <- w + mu * m -
        eta * D` (tf_keras `SGD(nesterov=True)`; `eta` this rate, `mu`
        `outer_momentum`). `m` is a slot of the compiled optimizer, on the
        variable's ps shard, saved in checkpoints with the other slots. Needs
        `n_fetch, n_push >= 2` and a local step (`local_learning_rate` not
        0): otherwise the cache never moves and every push is 0. DiLoCo
        used 0.7 with 0.9 momentum.
      outer_momentum: `mu` of the outer optimizer, in `[0, 1)`; default 0.9
        (`OUTER_MOMENTUM`); read only with `outer_learning_rate`.
      delay_compensation: `lambda` of delay compensation on the ps (DC-ASGD,
        Zheng et al. ICML 2017, "Asynchronous Stochastic Gradient Descent with
        Delay Compensation", equation 10): a push of `G` is applied as `G +
        lambda * G * G * (w_now - w_fetched)`, with `w_now` the ps value and
        `w_fetched` the value this replica last fetched (AdaGrad's pushed
        squares, if sent, are not changed). 0.0 (default): off.
        The ps knows `w_fetched` without a second model on the network: at
        each fetch it writes the values it sends into a ps-side copy per
        replica (`[num_workers, ...]` per variable shard, on its ps task).
        Bytes on the network: none more; ps memory: `num_workers` more
        copies of the model (not checkpointed: a resumed replica fetches
        first). Not with `outer_learning_rate` (the push is then no
        gradient).
      staleness_scaled: False (default): off. True: the staleness-aware step
        (Zhang et al. IJCAI 2016, "Staleness-aware Async-SGD for Distributed
        Deep Learning", section 3): each push's step is divided by its
        staleness `s` (pushes by other replicas since this replica's fetch,
        as counted for `max_staleness`), by `max(s, 1)`. The push's gradient
        is divided by it; AdaGrad on the ps grows its accumulator by the
        unscaled squares, so its step is the unscaled step over `max(s, 1)`.
        The staleness is then read from the ps before the push is applied,
        as with `max_staleness`. A push with staleness 0 or 1 is unchanged:
        with 2 replicas and `n_fetch == n_push` it changes nothing.

    Row-sparse variables (embedding tables) take none of the push rules:
    `replica.Downpour` raises naming the table.
    """

    n_fetch: int = 1
    n_push: int = 1
    local_learning_rate: float | None = None
    warmstart_steps: int = 0
    max_staleness: int | None = None
    local_optimizer: str = "adagrad"
    adagrad_accumulator: str = "squares"
    outer_learning_rate: float | None = None
    outer_momentum: float = OUTER_MOMENTUM
    delay_compensation: float = 0.0
    staleness_scaled: bool = False

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
        for name, allowed in (
            ("local_optimizer", LOCAL_OPTIMIZERS),
            ("adagrad_accumulator", ADAGRAD_ACCUMULATORS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"Argument `{name}` must be one of {', '.join(allowed)}. "
                    f"Received: {getattr(self, name)!r}"
                )
        lr = self.local_learning_rate
        if lr is not None:
            _check_float(
                "local_learning_rate", lr, "None (0 disables the local update)", ">= 0"
            )
        self._check_push_rules()

    def _check_push_rules(self) -> None:
        outer = self.outer_learning_rate
        if outer is not None:
            _check_float(
                "outer_learning_rate", outer, "None (no outer optimizer)", "> 0"
            )
        _check_float("outer_momentum", self.outer_momentum)
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(
                "Argument `outer_momentum` must be in [0, 1). Received: "
                f"{self.outer_momentum!r}"
            )
        _check_float("delay_compensation", self.delay_compensation, "", ">= 0")
        if not isinstance(self.staleness_scaled, (bool, np.bool_)):
            raise TypeError(
                "Argument `staleness_scaled` must be a bool. Received: "
                f"{self.staleness_scaled!r}"
            )
        if outer is None:
            return
        if self.n_fetch < 2 or self.n_push < 2:
            raise ValueError(
                "Argument `outer_learning_rate` needs `n_fetch` and `n_push` >= 2 "
                "(local rounds): with 1 the cache is replaced or pushed before a "
                "local step moves it, and the pushed delta is 0. Received: "
                f"n_fetch={self.n_fetch}, n_push={self.n_push}"
            )
        if self.local_learning_rate == 0:
            raise ValueError(
                "Argument `outer_learning_rate` needs a local step: "
                "`local_learning_rate` 0 keeps the cache still and every "
                "pushed delta 0. Received: local_learning_rate=0"
            )
        if self.delay_compensation:
            raise ValueError(
                "Arguments `outer_learning_rate` and `delay_compensation` cannot "
                "be combined: delay compensation corrects a gradient, and with "
                "the outer optimizer a push is a parameter delta. Received: "
                f"delay_compensation={self.delay_compensation!r}; set it to 0."
            )

    @property
    def push_rules(self) -> tuple[str, ...]:
        """The names of the push rules in effect, e.g. `("staleness_scaled",)`."""
        rules = []
        if self.outer_learning_rate is not None:
            rules.append("outer_learning_rate")
        if self.delay_compensation:
            rules.append("delay_compensation")
        if self.staleness_scaled:
            rules.append("staleness_scaled")
        return tuple(rules)

    @property
    def pushes_squares(self) -> bool:
        """True when a push to AdaGrad sends the steps' squared gradients too."""
        return self.adagrad_accumulator == "squares" and self.n_push > 1

    def local_learning_rate_for(self, ps_learning_rate: float | None) -> float:
        """The local step size: `local_learning_rate`, or its default.

        Args:
          ps_learning_rate: the ps optimizer's learning rate (AdaGrad's
            `gamma`), a float, or None when it is not a number (a schedule).

        Returns:
          A float >= 0.

        Raises:
          ValueError: `local_learning_rate` is None, `local_optimizer` is
            `"adagrad"` and `ps_learning_rate` is None.
        """
        if self.local_learning_rate is not None:
            return float(self.local_learning_rate)
        if self.local_optimizer == "sgd":
            return LOCAL_LEARNING_RATE
        if ps_learning_rate is None:
            raise ValueError(
                "Argument `local_learning_rate` must be set (a float >= 0) when "
                "`local_optimizer` is 'adagrad' and the ps optimizer's learning "
                "rate is not a number (a schedule). Received: None"
            )
        return float(ps_learning_rate)
