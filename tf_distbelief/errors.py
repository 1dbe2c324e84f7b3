"""`DistBeliefError`, the base of every tf_distbelief error, and `ConfigError`.

No TensorFlow. Every exception the package defines subclasses
`DistBeliefError` and also the built-in exception it always was
(`ValueError`, `TimeoutError`, `FloatingPointError`, ...), so that
`except DistBeliefError` catches any of ours and code that catches the
built-in one still does. All are exported at the top level (`tf_distbelief`).

`ConfigError`: a job setting refused before anything runs.

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
