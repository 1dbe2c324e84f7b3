"""`ConfigError`: a job setting refused before anything runs (no TensorFlow).

The launch script prints such an error as one line, without a traceback: its
message names the setting, the value received and the fix, and a traceback
would bury that. Any other exception is a bug and keeps its traceback, so
only validation code raises `ConfigError`.
"""


class ConfigError(ValueError):
    """A setting (a flag, a `JobConfig` field, `TF_CONFIG`, a model spec) is refused.

    A `ValueError`, so that code that catches `ValueError` still catches it.
    The message names the setting, states the rule, echoes the value received
    and says what to do instead.
    """
