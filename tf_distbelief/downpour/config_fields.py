"""The names of `DownpourConfig`'s own fields: the cadence and the local update.

A `DownpourConfig` takes these as keyword arguments, and each registered push
rule's settings besides (`push_rules.rule.settings`); the registry
(`push_rules.rule.register`) refuses a setting that takes one of these names,
and `config.DownpourConfig` declares exactly these fields, in this order.
Pure Python.
"""

__all__ = ["FIELDS"]

FIELDS = (
    "n_fetch",
    "n_push",
    "local_learning_rate",
    "warmstart_steps",
    "max_staleness",
    "local_optimizer",
    "adagrad_accumulator",
)
