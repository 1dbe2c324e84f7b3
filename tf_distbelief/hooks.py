"""`FitHooks`: what a training algorithm gives the fit layer, attached by its `install`.

The fit layer (`fit.training.fit`, `fit.progress`) trains any compiled
tf_keras model; an algorithm that replaces how a step's update reaches the ps
(Downpour SGD, section 4.1) also replaces three of the loop's services:

* the non-finite guard: its updates bypass the optimizer's apply, where the
  stock guard sits (`faults.nonfinite`), so it brings its own;
* state to checkpoint beside the model: state that lives on the workers
  (Downpour's replica caches and counters), saved and restored exactly;
* figures for progress lines and TensorBoard (staleness, bytes moved), and
  their words on the console.

The algorithm's `install(model, ...)` calls `attach(model, FitHooks(...))`;
the fit layer asks `of(model)`. Keras 3 training (`keras3.fit`) takes
Downpour's as a `FitHooks` too (`keras3.downpour.fit_hooks`), for its guard
and its state in checkpoints (`faults.checkpoint_contents`). No attribute
is set on the user's model and the fit layer imports no algorithm: this
module sits under both.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from tf_distbelief import checks

__all__ = ["FitHooks", "attach", "detach", "of"]


@dataclasses.dataclass(frozen=True)
class FitHooks:
    """An algorithm's services to `fit.training.fit`.

    Attributes:
      name: the algorithm's name, e.g. `"downpour"`; also the key under which
        `checkpoint_state`'s object is saved in the job's checkpoints.
      install_guard: `(model, mode) -> guard`, the non-finite guard of the
        algorithm's updates for `mode` (`raise` or `skip`); the guard has
        `skipped_steps() -> int`.
      checkpoint_state: `() -> state`, or None: state checkpointed beside the
        model under `name`; it has `restoring(keys)`, `write_back(restored)`
        and `capture()` (see `downpour.replica_state.ReplicaState`).
      read_counters: `() -> counters`, or None: a reading of the algorithm's
        counters; may raise `tf.errors.OpError` while a task is replaced.
      interval_figures: `(now, last) -> {name: float}`, the figures between
        two readings of `read_counters` (`last` None: since the start).
      figure_words: `(logs) -> (words, rest)`, or None: the algorithm's
        figures among an epoch's logs in a few words for the epoch's console
        line (Downpour's `staleness 0.40, fetched 19.2 kB/step, ...`), and
        the other logs (the model's loss and metrics); the figures stay in
        the logs for TensorBoard and the history.
      state: the algorithm's own object, or None: what its `install`
        returned (Downpour's `Downpour`), for the job's reports
        (`downpour.DownpourMetrics`).
      finish: `() -> lines`, or None: the algorithm's end of training, run
        once after the job's last step (no step in flight) and before the
        checkpoint of that step (Downpour's outer rule: the replicas' unsent
        progress averaged into the ps, `downpour.final_round`); the lines
        are printed.
    """

    name: str
    install_guard: Callable[[Any, str], Any]
    checkpoint_state: Callable[[], Any] | None = None
    read_counters: Callable[[], Any] | None = None
    interval_figures: Callable[[Any, Any], dict[str, float]] | None = None
    figure_words: Callable[[Mapping[str, float]], tuple[str, dict]] | None = None
    state: Any = None
    finish: Callable[[], list[str]] | None = None

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise checks.argument_error("name", "a non-empty str", self.name)
        if (self.read_counters is None) != (self.interval_figures is None):
            raise ValueError(
                "Arguments `read_counters` and `interval_figures` go together "
                f"(both or neither). Received: read_counters={self.read_counters!r}"
                f", interval_figures={self.interval_figures!r}"
            )


# Models are keys by identity; a model that is gone takes its hooks with it.
_attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(model, hooks: FitHooks) -> None:
    """Makes `hooks` the services `fit` uses for `model` (replacing any before).

    Raises:
      TypeError: `hooks` is not a `FitHooks`.
    """
    if not isinstance(hooks, FitHooks):
        raise checks.argument_error("hooks", "a FitHooks", hooks)
    _attached[model] = hooks


def detach(model) -> None:
    """Forgets `model`'s hooks: `fit` trains it with the stock services again."""
    _attached.pop(model, None)


def of(model) -> FitHooks | None:
    """The hooks attached to `model`, or None (stock training)."""
    return _attached.get(model)
