"""`DistBeliefError`, the base of every tf_distbelief error, and `ConfigError`.

No TensorFlow. Every exception the package defines subclasses
`DistBeliefError` and also the built-in exception it always was
(`ValueError`, `TimeoutError`, `FloatingPointError`, ...), so that
`except DistBeliefError` catches any of ours and code that catches the
built-in one still does. All are exported at the top level (`tf_distbelief`).

`ConfigError`: a job setting refused before anything runs. `NonFiniteError`: a
NaN or inf kept from the ps variables or a checkpoint, on every training path.

The launch script prints such an error as one line, without a traceback: its
message names the setting, the value received and the fix, and a traceback
would bury that. Any other exception is a bug and keeps its traceback, so
only validation code raises `ConfigError`.
"""


class DistBeliefError(Exception):
    """The base of every error tf_distbelief raises on purpose.

    Each subclass also derives from the built-in exception that fits it, and
    keeps its own name and message; catch `DistBeliefError` to handle any of
    them, or the subclass for one.
    """


class ConfigError(DistBeliefError, ValueError):
    """A setting (a flag, a `JobConfig` field, `TF_CONFIG`, a model spec) is refused.

    A `ValueError`, so that code that catches `ValueError` still catches it.
    The message names the setting, states the rule, echoes the value received
    and says what to do instead.
    """


class NonFiniteError(DistBeliefError, FloatingPointError):
    """A NaN or inf was kept from the ps variables or from a checkpoint.

    Raised by every training path (tf_keras `fit`, Downpour's pushes, Keras 3,
    Sandblaster) where a non-finite value would have reached a ps variable or
    a checkpoint (`faults.nonfinite`), so it lives here, under them all.

    Attributes:
      step: the step (ps update number, 1-based) whose gradients were not
        finite, or the step of the refused checkpoint; None if unknown.
      variables: names of the variables concerned.
    """

    def __init__(self, message: str, step: int | None, variables: list[str]):
        super().__init__(message)
        self.step = step
        self.variables = variables
