"""A push rule's base class, its settings, and the registry of push rules.

A push rule changes how the ps applies a replica's push (Downpour,
`DownpourConfig`). Each rule is one `PushRule` subclass in one file, holding:

* its `Setting`s: `DownpourConfig` keyword arguments and attributes, and the
  launch flags of the same names (`launch/train.py` defines them from
  `settings()`), with `check` validating them;
* its NumPy reference (the `reference_*` hooks), which `schedule.simulate`
  applies through `reference.ReferenceRules`;
* its TF update on the ps (the other hooks, importing TensorFlow when
  called), which the replica applies through `on_ps.PushRules`.

At a push the rules in effect compose, on each variable, in this order
(`compose`, for the ps, the replays of its log and the NumPy reference):

1. `correct`: each rule's correction of the pushed gradient (`G`), in
   registration order;
2. `scale`: each rule's factor of the step, multiplied;
3. the rule that `replaces_optimizer` applies the scaled push with its
   `update`; without one the ps optimizer applies the scaled step (AdaGrad
   grows its accumulator by the unscaled squares: its step, not its
   accumulator, is scaled).

Before all that, on the replica, a compressing rule may shrink what the push
sends (step 0, `compressing`): a rule that `selects` keeps some entries of
each pushed tensor (top-k), a rule that `codes` sends their values in fewer
bits (a quantiser); at most one of each, composed in that order. What is not
sent stays in the replica's residual and is added to its next push (error
feedback; `reference.compress`, `compression.CompressedPush`); with a rule
that `pushes_deltas` and replaces the ps optimizer (the outer rule) it stays
in the replica's cache instead, and fetches replay the ps's log of applied
pushes (`downpour.stream_fetch`, whose NumPy side is `update_stream`).

Each module of this package but `_NOT_RULES` is a rule file: it names its
rule class `RULE`, and the registry registers them first, in module name
order (`rules()`), so a new rule is one new file. Other rules (a test's)
register with `register` or, for a `with` block, `registered`. Pure: no
TensorFlow at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import pkgutil

import numpy as np

from tf_distbelief import checks
from tf_distbelief.downpour import config_fields

__all__ = [
    "POSITION_BYTES",
    "PushRule",
    "Setting",
    "check_compressible",
    "compose",
    "check_float",
    "check_int",
    "register",
    "registered",
    "resolve",
    "rules",
    "settings",
    "unregister",
]

# Bytes of an int32 position (tensors of up to 2**31 entries), as a sparse
# fetch sends each changed entry's (`downpour.sparse_fetch`); a push's are in
# `position_codes.wire_coding`'s coding.
POSITION_BYTES = 4
# The modules of this package that hold no rule.
_NOT_RULES = frozenset({"rule", "on_ps", "reference", "compression"})
# Registered rules by name, in registration order.
_RULES: dict[str, type[PushRule]] = {}
_loaded = False


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of a push rule: a `DownpourConfig` field and a launch flag.

    Attributes:
      name: the keyword argument, attribute and flag name.
      default: its value when not given.
      kind: the flag's type, `"float"`, `"int"` or `"bool"` (absl parses the
        value; a float flag is refused unless finite).
      help: the flag's help.
      lower_bound: a float or int flag's lowest value, or None.
      upper_bound: a float or int flag's highest value, or None.
    """

    name: str
    default: object
    kind: str
    help: str
    lower_bound: float | None = None
    upper_bound: float | None = None

    def __post_init__(self):
        if self.kind not in ("float", "int", "bool"):
            raise checks.argument_error(
                "kind",
                "one of float, int, bool",
                self.kind,
                fix=f"(setting {self.name!r})",
            )


class PushRule:
    """A rule the ps applies to a replica's push; subclass and `register` it.

    A subclass sets the class attributes and overrides the hooks it needs;
    the base's hooks change nothing. It is constructed by `resolve` from a
    valid `DownpourConfig` in which it is on, and reads its settings there.

    Class attributes:
      name: the rule's name in `DownpourConfig.push_rules` and in errors: the
        setting whose value turns it on (`is_on`).
      title: the rule in words, for errors (e.g. "the outer optimizer").
      settings: its `Setting`s.
      pushes_deltas: a push sends the replica's local steps summed (its cache's
        decrease since the last push) in place of its gradients, and no
        squared gradients.
      needs_staleness: the push's staleness is read before it is applied.
      needs_fetched: the ps keeps a copy of the values each replica last
        fetched (`fetched` of `correct`); ps memory: `num_workers` copies of
        the model, not checkpointed.
      replaces_optimizer: `update` applies the push in place of the ps
        optimizer (at most one rule in effect may).
      state_name: the attribute of `on_ps.PushRules` that holds the rule's
        `ps_state` (e.g. `"momentums"`), or `""` for none.
      selects: the replica sends only some entries of each pushed tensor
        (`reference_select`, `select`, `sent_count`); the rest stays in its
        residual. At most one rule in effect may.
      codes: the replica sends the pushed values coded in fewer bits
        (`reference_code`, `encode`, `decode`, `coded_nbytes`); the coding
        error stays in its residual. At most one rule in effect may.
      reads_state: the `name` of another rule whose ps state the correction
        reads (its `state` argument: that rule's state before the push, e.g.
        the outer momentum), or `""`; that rule must be on (`resolve`).
      marks_changes: the ps flags, per replica, the entries each applied push
        changed, and a fetch sends only the flagged ones (`sparse_fetches`;
        `downpour.sparse_fetch`).

    Args:
      config: the `DownpourConfig`.
    """

    name: str = ""
    title: str = ""
    settings: tuple[Setting, ...] = ()
    pushes_deltas: bool = False
    needs_staleness: bool = False
    needs_fetched: bool = False
    replaces_optimizer: bool = False
    state_name: str = ""
    selects: bool = False
    codes: bool = False
    reads_state: str = ""
    marks_changes: bool = False

    def __init__(self, config):
        del config  # A rule with settings reads them here.

    @classmethod
    def is_on(cls, config) -> bool:
        """True when the rule is in effect: its setting `name` is set (truthy)."""
        return bool(getattr(config, cls.name))

    @classmethod
    def check(cls, config) -> None:
        """Raises unless the rule's settings in `config` are valid.

        Each setting is checked whether the rule is on or not; what the rule
        needs of `config`'s other fields, when it is on.

        Raises:
          TypeError, ValueError: naming the argument and the value received.
        """

    @classmethod
    def check_combination(cls, config, others: tuple[type[PushRule], ...]) -> None:
        """Raises if the rule, on in `config`, cannot work with `others` on.

        Raises:
          ValueError: naming both rules.
        """

    @property
    def compresses(self) -> bool:
        """True when the rule shrinks what a push sends (`selects` or `codes`)."""
        return self.selects or self.codes

    # --- Compression on the replica (step 0), pure ----------------------------

    def sent_count(self, size: int) -> int:
        """Entries of a tensor of `size` entries a push sends (`selects`)."""
        raise NotImplementedError(f"Push rule {self.name} selects no entries.")

    def coded_nbytes(self, count: int, itemsize: int) -> int:
        """Bytes of `count` values of `itemsize` bytes once coded (`codes`)."""
        raise NotImplementedError(f"Push rule {self.name} codes no values.")

    def reference_select(self, flat) -> object:
        """The positions of `flat` (a 1-D array) sent, in sending order, as an
        int array of `sent_count(flat.size)` (`selects`)."""
        raise NotImplementedError(f"Push rule {self.name} selects no entries.")

    def reference_code(self, values) -> object:
        """`values` (a 1-D array) as the ps decodes them (`codes`)."""
        raise NotImplementedError(f"Push rule {self.name} codes no values.")

    # --- The NumPy reference (`schedule.simulate`), pure ----------------------

    def reference_state(self, params: list) -> object:
        """The rule's ps state at the start (e.g. momentums), or None."""
        return None

    def reference_correct(self, grads, params, fetched, staleness) -> list:
        """The pushed `grads` corrected (step 1).

        Args:
          grads: the pushed gradients (parameter deltas with `pushes_deltas`),
            one array per parameter.
          params: the ps parameters before the push.
          fetched: the ps parameters at the pushing replica's last fetch.
          staleness: the push's staleness, an int >= 0.

        A rule with `reads_state` also gets `state=`, that rule's NumPy state
        (one array per parameter).
        """
        return grads

    def reference_scale(self, staleness: int) -> float | None:
        """The factor of the push's step (step 2), or None for none."""
        return None

    def reference_update(self, params, state, grads) -> tuple[list, object]:
        """`(params, state)` after the push of `grads`, with `replaces_optimizer`."""
        raise NotImplementedError(f"Push rule {self.name} replaces no optimizer.")

    # --- TensorFlow on the ps (`on_ps.PushRules`) -----------------------------

    def ps_state(self, optimizer, variables: list, strategy) -> list:
        """The rule's ps state per variable (e.g. optimizer slots), or [].

        Called once under the strategy's scope, after the optimizer is built.

        Args:
          optimizer: the compiled tf_keras optimizer.
          variables: the dense ps variables (shards).
          strategy: the `DistBeliefStrategy`.
        """
        return []

    def correct(self, grad, variable, fetched, staleness):
        """`grad` of `variable` corrected, on its ps task (step 1).

        Args:
          grad: the pushed gradient, a tensor on the variable's ps task.
          variable: the ps variable (shard).
          fetched: the value the pushing replica last fetched (`needs_fetched`),
            or None.
          staleness: the push's staleness, an int64 scalar (`needs_staleness`),
            or None.

        A rule with `reads_state` also gets `state=`, that rule's `ps_state`
        entry of the variable (e.g. its momentum slot).
        """
        return grad

    def scale(self, staleness, dtype):
        """The factor of the push's step, a `dtype` tensor (step 2), or None."""
        return None

    def update(self, variable, state, grad):
        """The op applying `grad` to `variable`, with `replaces_optimizer`.

        Args:
          variable: the ps variable (shard).
          state: the rule's `ps_state` entry of the variable.
          grad: the pushed gradient, corrected and scaled.
        """
        raise NotImplementedError(f"Push rule {self.name} replaces no optimizer.")

    # --- TensorFlow on the replica, then on the ps (`compression`) ------------

    def select(self, flat):
        """The int32 positions of `flat` (a 1-D tensor) sent (`selects`)."""
        raise NotImplementedError(f"Push rule {self.name} selects no entries.")

    def encode(self, values) -> tuple:
        """`values` (a 1-D tensor) coded: a tuple of tensors (`codes`)."""
        raise NotImplementedError(f"Push rule {self.name} codes no values.")

    def decode(self, coded: tuple, count: int, dtype):
        """The `count` values of `dtype` that `encode` coded (`codes`)."""
        raise NotImplementedError(f"Push rule {self.name} codes no values.")


def compose(rules, grad, correct, scale, state_of):
    """Steps 1 and 2 of a push (module docstring), in any framework: `grad`
    corrected by each rule in order, and the product of the rules' factors.

    `on_ps.corrected` (TensorFlow) and `reference.corrected` (NumPy) call it
    with their hooks, so that the order of composition has one owner.

    Args:
      rules: the `PushRule`s in effect, in order.
      grad: the pushed gradient (a tensor, or a list of arrays).
      correct: `(rule, grad, **state) -> grad`, a rule's correction hook;
        `state=` is passed for a rule with `reads_state`.
      scale: `rule -> factor or None`, a rule's factor hook.
      state_of: `name -> ` the named rule's state (for `reads_state`).

    Returns:
      `(grad, factor)`: the corrected gradient, and the factor or None when
      no rule scales the step.
    """
    for r in rules:
        state = {"state": state_of(r.reads_state)} if r.reads_state else {}
        grad = correct(r, grad, **state)
    factor = None
    for r in rules:
        f = scale(r)
        if f is not None:
            factor = f if factor is None else factor * f
    return grad, factor


def check_float(name: str, value, or_what: str = "", rule: str = "") -> None:
    """Raises unless `value` is a real number, finite and, by `rule`, in range.

    Args:
      name: the argument's name, for the error.
      value: its value.
      or_what: what else it may be (e.g. "None (off)"), for the error.
      rule: `">= 0"`, `"> 0"` or `""` (any finite value).

    Raises:
      TypeError: not a number (a bool is not one).
      ValueError: not finite or out of range.
    """
    alternative = f" or {or_what}" if or_what else ""
    if isinstance(value, bool) or not isinstance(
        value, (int, float, np.floating, np.integer)
    ):
        raise checks.argument_error(name, f"a float{alternative}", value)
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
        raise checks.argument_error(name, f"finite{rule}{alternative}", value)


def check_int(name: str, value, lowest: int, meaning: str = "") -> None:
    """Raises unless `value` is an integer >= `lowest`.

    Args:
      name: the argument's name, for the error.
      value: its value.
      lowest: the lowest value allowed.
      meaning: what a value means (e.g. "0: the whole tensor"), for the error.

    Raises:
      TypeError: not an integer (a bool is not one).
      ValueError: below `lowest`.
    """
    meaning = f" ({meaning})" if meaning else ""
    checks.check_int(
        name, value, lowest, f">= {lowest}{meaning}", f"an integer{meaning}"
    )


def check_compressible(config, name: str) -> None:
    """Raises if a compressing rule, `name` on, meets what it cannot run with.

    With AdaGrad's `adagrad_accumulator="squares"` and `n_push > 1` a push
    sends the steps' squared gradients whole along with the gradient: as many
    bytes as the uncompressed gradient, and no residual can carry what a
    compressed square leaves out. Pushes of parameter deltas send no squares.

    With the outer optimizer (and no `sparse_fetches`) fetches replay the
    ps's log of compressed pushes (`downpour.stream_fetch`), one fetch per
    push round: `n_fetch` must equal `n_push` (as the NumPy reference,
    `downpour.update_stream`, runs it). A replica replays each logged push
    through the rules that correct or scale it on the ps (with the push's
    staleness, which the log keeps, and its mirror of the outer momentum):
    a rule that reads what the pushing replica last fetched
    (`needs_fetched`) or another rule's ps state than the outer optimizer's
    cannot be replayed, and is refused.

    Raises:
      ValueError: naming `name` and the settings it meets.
    """
    on = [r for r in rules() if r.is_on(config)]
    deltas = any(r.pushes_deltas for r in on)
    if config.pushes_squares and not deltas:
        raise ValueError(
            f"Argument `{name}` needs `adagrad_accumulator` 'mean' or 'sum' "
            "when `n_push` > 1: with 'squares' each push also sends the "
            "steps' squared gradients, uncompressed. Received: "
            f"adagrad_accumulator={config.adagrad_accumulator!r}, "
            f"n_push={config.n_push}"
        )
    outer = next((r for r in on if r.replaces_optimizer and r.pushes_deltas), None)
    if outer is None or any(r.marks_changes for r in on):
        return
    if config.n_fetch != config.n_push:
        raise ValueError(
            f"Argument `{name}` with `{outer.name}` (update-stream fetches) "
            "needs `n_fetch` equal to `n_push`: each fetch replays one round "
            f"of pushes. Received: n_fetch={config.n_fetch}, "
            f"n_push={config.n_push}"
        )
    others = [
        r.name
        for r in on
        if not (r.selects or r.codes or r is outer)
        and (r.needs_fetched or r.reads_state not in ("", outer.name))
    ]
    if others:
        raise ValueError(
            f"Argument `{name}` with `{outer.name}` (update-stream fetches: "
            "each replica replays the ps's pushes) cannot be combined with "
            "push rules that read what a replica fetched or another rule's ps "
            "state. Received: " + ", ".join(f"`{n}`" for n in others)
        )


def register(rule: type[PushRule]) -> type[PushRule]:
    """Registers a push rule class; returns it (usable as a decorator).

    Its settings become `DownpourConfig` keyword arguments for configs
    created from now on.

    Raises:
      TypeError: `rule` is not a `PushRule` subclass.
      ValueError: its `name` is not one of its settings, or its name or a
        setting's is taken (by a registered rule or a `DownpourConfig` field).
    """
    _load_builtins()
    if not (isinstance(rule, type) and issubclass(rule, PushRule)):
        raise checks.argument_error("rule", "a PushRule subclass", rule)
    names = [s.name for s in rule.settings]
    if rule.name not in names:
        raise checks.argument_error(
            "name",
            f"one of its settings ({', '.join(names) or 'none'})",
            rule.name,
            fix=f"(the `name` of push rule {rule.__name__})",
        )
    taken = {s.name for other in _RULES.values() for s in other.settings}
    taken |= set(_RULES) | set(config_fields.FIELDS)
    clash = sorted(taken.intersection(names))
    if clash or len(set(names)) != len(names):
        raise ValueError(
            f"Push rule {rule.__name__}'s settings must have new, distinct names. "
            f"Received: {', '.join(names)} (taken: {', '.join(clash) or 'none'})"
        )
    _RULES[rule.name] = rule
    return rule


def unregister(rule: type[PushRule]) -> None:
    """Removes a registered push rule class.

    Raises:
      ValueError: `rule` is not registered.
    """
    if _RULES.get(getattr(rule, "name", None)) is not rule:
        raise ValueError(f"Push rule {rule!r} is not registered.")
    del _RULES[rule.name]


@contextlib.contextmanager
def registered(rule: type[PushRule]):
    """Registers `rule` for the `with` block, and unregisters it after.

    Raises:
      As `register`.
    """
    register(rule)
    try:
        yield rule
    finally:
        unregister(rule)


def _load_builtins() -> None:
    """Registers the `RULE` of each rule module of this package, once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    package = importlib.import_module(__package__)
    for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
        if module not in _NOT_RULES:
            register(importlib.import_module(f"{__package__}.{module}").RULE)


def rules() -> tuple[type[PushRule], ...]:
    """The registered push rule classes, in registration order."""
    _load_builtins()
    return tuple(_RULES.values())


def settings() -> tuple[Setting, ...]:
    """The settings of every registered push rule, in registration order."""
    return tuple(s for rule in rules() for s in rule.settings)


def resolve(config) -> tuple[PushRule, ...]:
    """Checks `config`'s push rule settings; returns the rules in effect.

    Args:
      config: a `DownpourConfig`, its fields set.

    Returns:
      One `PushRule` per rule on, in registration order.

    Raises:
      TypeError, ValueError: a rule's `check` or `check_combination`, a rule
        on whose `reads_state` rule is off, or two rules on that both replace
        the ps optimizer, both select or both code.
    """
    known = rules()
    for rule in known:
        rule.check(config)
    on = tuple(rule for rule in known if rule.is_on(config))
    for rule in on:
        rule.check_combination(config, tuple(o for o in on if o is not rule))
        if rule.reads_state and rule.reads_state not in {o.name for o in on}:
            raise ValueError(
                f"Argument `{rule.name}` needs `{rule.reads_state}` set: "
                f"{rule.title} reads its ps state. Received: "
                f"{rule.name}={getattr(config, rule.name)!r}, "
                f"{rule.reads_state}={getattr(config, rule.reads_state, None)!r}"
            )
    for attribute, what in (
        ("replaces_optimizer", "applies the push in place of the ps optimizer"),
        ("selects", "selects the entries a push sends"),
        ("codes", "codes the values a push sends"),
    ):
        both = [rule.name for rule in on if getattr(rule, attribute)]
        if len(both) > 1:
            raise ValueError(
                f"Push rules {' and '.join(both)} cannot be combined: each "
                f"{what}. Received both on."
            )
    return tuple(rule(config) for rule in on)
