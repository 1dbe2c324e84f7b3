"""Downpour's configuration: the cadence, the local update and the push rules.

Dean et al. 2012, section 4.1; the push rules' settings (e.g.
`outer_learning_rate`, `delay_compensation`, `staleness_scaled`) come from
the registered push rules (`push_rules.rule`), each with its paper in its
module. Pure Python and NumPy (no TensorFlow): the NumPy reference
(`schedule.simulate`), the launch flags and the TF replica
(`replica.Downpour`) all take a `DownpourConfig`.
"""

from __future__ import annotations

import dataclasses

from tf_distbelief import checks
from tf_distbelief.downpour import config_fields
from tf_distbelief.downpour.push_rules import rule as push_rule

__all__ = [
    "ADAGRAD_ACCUMULATORS",
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


@dataclasses.dataclass(frozen=True, init=False, repr=False)
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
      **settings: the push rules' settings, keyword only: each registered
        rule's (`push_rules.rule.settings()`), each an attribute too, at its
        default when not given. This package's rules: `outer_learning_rate`
        and `outer_momentum` (`push_rules.outer_nesterov`: DiLoCo's outer
        Nesterov on the pushed parameter delta), `delay_compensation`
        (`push_rules.delay_compensation`: DC-ASGD), `staleness_scaled`
        (`push_rules.staleness_scaled`: the step over the staleness),
        `top_k_fraction` and `top_k_chunk` (`push_rules.top_k`), and
        `quantize_bits` and `quantize_chunk` (`push_rules.quantize`): pushes
        compressed with error feedback (with the outer rule, the cache keeps
        what was not sent and fetches replay the ps's log of pushes:
        `downpour.stream_fetch`); all off by default.

    Attributes:
      rule_settings: `(name, value)` of every push rule setting, in
        registration order (compared and hashed with the fields).
      rules: the `push_rules.rule.PushRule`s in effect, in registration order.

    Raises:
      TypeError: a value of the wrong type, or an unknown keyword argument.
      ValueError: a value out of range, or settings that cannot be combined;
        each naming the argument and the value received.

    Row-sparse variables (embedding tables) take none of the push rules:
    `replica.Downpour` raises naming the table.
    """

    n_fetch: int
    n_push: int
    local_learning_rate: float | None
    warmstart_steps: int
    max_staleness: int | None
    local_optimizer: str
    adagrad_accumulator: str
    rule_settings: tuple[tuple[str, object], ...]

    def __init__(
        self,
        n_fetch: int = 1,
        n_push: int = 1,
        local_learning_rate: float | None = None,
        warmstart_steps: int = 0,
        max_staleness: int | None = None,
        local_optimizer: str = "adagrad",
        adagrad_accumulator: str = "squares",
        **settings,
    ):
        values = (
            n_fetch,
            n_push,
            local_learning_rate,
            warmstart_steps,
            max_staleness,
            local_optimizer,
            adagrad_accumulator,
        )
        for name, value in zip(config_fields.FIELDS, values):
            object.__setattr__(self, name, value)
        defaults = {s.name: s.default for s in push_rule.settings()}
        unknown = sorted(set(settings) - set(defaults))
        if unknown:
            raise TypeError(
                f"DownpourConfig got unexpected keyword arguments: "
                f"{', '.join(unknown)} (neither a field nor a registered push "
                f"rule's setting: {', '.join(defaults)})"
            )
        object.__setattr__(
            self,
            "rule_settings",
            tuple((name, settings.get(name, d)) for name, d in defaults.items()),
        )
        self._check()
        object.__setattr__(self, "rules", push_rule.resolve(self))

    def __getattr__(self, name: str):
        # Only for names not found otherwise: a push rule's setting.
        if not name.startswith("__"):
            for key, value in vars(self).get("rule_settings", ()):
                if key == name:
                    return value
        raise AttributeError(f"'DownpourConfig' object has no attribute {name!r}")

    def __repr__(self) -> str:
        pairs = [(name, getattr(self, name)) for name in config_fields.FIELDS]
        pairs += list(self.rule_settings)
        inner = ", ".join(f"{name}={value!r}" for name, value in pairs)
        return f"DownpourConfig({inner})"

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """Every keyword argument: the fields, then the push rules' settings."""
        return config_fields.FIELDS + tuple(s.name for s in push_rule.settings())

    def _check(self) -> None:
        checks.check_int(
            "n_fetch", self.n_fetch, 1, ">= 1 (fetch every n_fetch steps)", "an integer"
        )
        checks.check_int(
            "n_push", self.n_push, 1, ">= 1 (push every n_push steps)", "an integer"
        )
        checks.check_int(
            "warmstart_steps", self.warmstart_steps, 0, ">= 0", "an integer"
        )
        if self.max_staleness is not None:
            checks.check_int(
                "max_staleness",
                self.max_staleness,
                0,
                ">= 0, or None to apply every push",
                "an integer",
            )
        for name, allowed in (
            ("local_optimizer", LOCAL_OPTIMIZERS),
            ("adagrad_accumulator", ADAGRAD_ACCUMULATORS),
        ):
            checks.check_one_of(name, getattr(self, name), allowed)
        lr = self.local_learning_rate
        if lr is not None:
            push_rule.check_float(
                "local_learning_rate", lr, "None (0 disables the local update)", ">= 0"
            )

    @property
    def push_rules(self) -> tuple[str, ...]:
        """The names of the push rules in effect, e.g. `("staleness_scaled",)`."""
        return tuple(r.name for r in self.rules)

    @property
    def pushes_deltas(self) -> bool:
        """True when pushes send the local steps summed (a rule's
        `pushes_deltas`, e.g. the outer optimizer's), not the gradients."""
        return any(r.pushes_deltas for r in self.rules)

    @property
    def has_final_round(self) -> bool:
        """True when the end of training averages the replicas' unsent
        progress into the ps (`downpour.final_round`): a rule that pushes
        parameter deltas and replaces the ps optimizer (the outer rule),
        without sparse fetches."""
        outer = any(r.replaces_optimizer and r.pushes_deltas for r in self.rules)
        return outer and not any(r.marks_changes for r in self.rules)

    @property
    def runs_segments(self) -> bool:
        """True when a scheduled function can run its steps in segments
        between fetches and pushes (`Downpour.run_steps`): `n_fetch` and
        `n_push` > 1 and no warm start."""
        return self.n_fetch > 1 and self.n_push > 1 and not self.warmstart_steps

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
            raise checks.argument_error(
                "local_learning_rate",
                "set (a float >= 0) when `local_optimizer` is 'adagrad' and the "
                "ps optimizer's learning rate is not a number (a schedule)",
                None,
            )
        return float(ps_learning_rate)
