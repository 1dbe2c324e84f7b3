"""What a Downpour replica keeps and does per variable, fixed at construction.

Dean et al. 2012, section 4.1: `Plan` says, from a `DownpourConfig` and the ps
optimizer, which local step a replica takes on its cache and what its pushes
send (`PushedSquares`). `base.VariableKind` keeps the per-worker state it asks
for.
"""

from __future__ import annotations

import dataclasses
import enum

import tf_keras

from tf_distbelief.adagrad import optimizer as adagrad
from tf_distbelief.downpour.config import DownpourConfig

__all__ = ["Plan", "PushedSquares"]


class PushedSquares(enum.Enum):
    """What a push sends as its steps' squared gradients, if anything."""

    NONE = "none"  # Nothing: the ps optimizer does not take them.
    # A per-worker sum of each step's `g^2` since the last push (local SGD).
    SUMMED = "summed"
    # The growth of the local AdaGrad accumulator since the last push; a
    # per-worker copy of that accumulator at the last push is the base.
    LOCAL = "local"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a replica keeps and does per variable, fixed at construction.

    Attributes:
      local_optimizer: the local step on the cache, `"adagrad"` or `"sgd"`
        (`DownpourConfig.local_optimizer`).
      learning_rate: its step size, a float >= 0; 0 skips the step.
      initial_accumulator: the local AdaGrad accumulator's start, as the ps
        AdaGrad's `initial_accumulator_value` (0.1 for another optimizer).
      epsilon: the local AdaGrad's `epsilon`, as the ps AdaGrad's (1e-7).
      squares: what a push sends as squared gradients.
      pushes_deltas: pushes send the local steps summed, not the gradients
        (`DownpourConfig.pushes_deltas`: the outer optimizer's push rule).
    """

    local_optimizer: str
    learning_rate: float
    initial_accumulator: float
    epsilon: float
    squares: PushedSquares
    pushes_deltas: bool = False

    @classmethod
    def create(cls, config: DownpourConfig, optimizer) -> Plan:
        """The plan of `config` with `optimizer` applying pushes on the ps.

        Raises:
          ValueError: no local step size (`config.local_learning_rate_for`).
        """
        squares = PushedSquares.NONE
        deltas = config.pushes_deltas
        # Squares go along only where AdaGrad on the ps can use them.
        ps_adagrad = isinstance(optimizer, adagrad.Adagrad) and not deltas
        if config.pushes_squares and ps_adagrad:
            local_adagrad = config.local_optimizer == "adagrad"
            squares = PushedSquares.LOCAL if local_adagrad else PushedSquares.SUMMED
        return cls(
            local_optimizer=config.local_optimizer,
            learning_rate=config.local_learning_rate_for(
                _numeric_learning_rate(optimizer)
            ),
            initial_accumulator=float(
                getattr(optimizer, "initial_accumulator_value", 0.1)
            ),
            epsilon=float(getattr(optimizer, "epsilon", 1e-7)),
            squares=squares,
            pushes_deltas=deltas,
        )

    @property
    def push_copies(self) -> int:
        """Copies of the model a push sends: 2 with the squares, else 1."""
        return 1 if self.squares is PushedSquares.NONE else 2


def _numeric_learning_rate(optimizer) -> float | None:
    """The optimizer's learning rate as a float; None for a schedule."""
    lr = getattr(optimizer, "_learning_rate", None)
    if lr is None or isinstance(lr, tf_keras.optimizers.schedules.LearningRateSchedule):
        return None
    return float(tf_keras.backend.get_value(lr))
