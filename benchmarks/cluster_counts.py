"""The `--num_workers` and `--num_ps` list flags of the cluster benchmarks.

`downpour_bench.py` and `sandblaster_bench.py` run each configuration on a
cluster of every listed worker and ps count: both read and check the lists
here.
"""

from __future__ import annotations

from absl import flags


def counts(values: list[str]) -> list[int]:
    """`--num_workers` or `--num_ps` as ints, in the order given."""
    return [int(v) for v in values]


def check_counts(flag: str):
    """An absl validator of the list flag `flag`: integers >= 1, none twice."""

    def check(values: list[str]) -> bool:
        try:
            found = counts(values)
        except ValueError:
            found = [0]
        if not found or min(found) < 1 or len(set(found)) < len(found):
            raise flags.ValidationError(
                f"--{flag} must list integers >= 1, each once. Received: "
                f"{','.join(values)}"
            )
        return True

    return check
