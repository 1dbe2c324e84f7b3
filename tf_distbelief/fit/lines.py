"""The console lines of a training run, one format for tf_keras and Keras 3.

Both training paths print the same two lines, numbered by the global step
(`fit.progress.Progress` for tf_keras's `Model.fit`, `keras3.fit`'s epochs):

    step 300/500: 1,843 examples/s, elapsed 12s, ETA 8s
    epoch 3/5: steps 300/500 loss=0.1234 accuracy=0.9600 1,843 examples/s,
      elapsed 12s, ETA 8s; goodput 61.2%

(the epoch's, one line).
`RunClock` owns them: the run's elapsed time, its ETA at this run's average
speed, and the fields in order (figures of a training algorithm, such as
Downpour's staleness and bytes, come in its own words before the goodput).
No TensorFlow: plain text from numbers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from tf_distbelief import console


def metrics(logs: Mapping[str, float]) -> str:
    """`loss=0.1234 accuracy=0.9600 nonfinite_skipped=0`: the loss first, then
    the rest by name; ints (counts) as ints, other figures with 4 decimals."""
    ordered = [("loss", logs["loss"])] if logs.get("loss") is not None else []
    ordered += sorted((k, v) for k, v in logs.items() if k != "loss" and v is not None)
    return " ".join(
        f"{k}={v}" if isinstance(v, int) else f"{k}={float(v):.4f}" for k, v in ordered
    )


class RunClock:
    """Elapsed time, ETA and the progress lines of a run, by global step.

    Args:
      start_step: the global step the run started at (a resumed run's).
      total_steps: the step the run ends at, or None (no ETA).
    """

    def __init__(self, start_step: int, total_steps: int | None):
        self.start = time.monotonic()
        self.start_step = start_step
        self.total_steps = total_steps

    def of_total(self, step: int) -> str:
        """`"300/500"`, or `"300"` without a total."""
        return f"{step}/{self.total_steps}" if self.total_steps else f"{step}"

    def interval_line(self, step: int, examples_per_sec: float) -> str:
        """`"step 300/500: 1,843 examples/s, elapsed 12s, ETA 8s"`."""
        return (
            f"step {self.of_total(step)}: {console.count(examples_per_sec)} "
            f"examples/s, {self.timing(step)}"
        )

    def epoch_line(
        self,
        epoch: int,
        epochs: int | None,
        step: int,
        logs: Mapping[str, float],
        examples_per_sec: float,
        algorithm_words: str = "",
        goodput_percent: float | None = None,
    ) -> str:
        """The line at the end of epoch `epoch` (1-based).

        Args:
          epoch: the epoch just ended, counted from 1.
          epochs: the epoch the run ends at, or None.
          step: the global step at the epoch's end.
          logs: the epoch's loss and metrics (`metrics`).
          examples_per_sec: examples finished per second over the epoch.
          algorithm_words: a training algorithm's figures in its own words
            (Downpour's `staleness 0.40, fetched 19.2 kB/step, ...`), or "".
          goodput_percent: the job's goodput so far, or None.

        Returns:
          `epoch 3/5: steps 300/500 loss=0.1234 accuracy=0.9600 1,843
          examples/s, elapsed 12s, ETA 8s[; <algorithm_words>][; goodput
          61.2%]`.
        """
        of = f"{epoch}/{epochs}" if epochs else f"{epoch}"
        shown = metrics(logs)
        line = (
            f"epoch {of}: steps {self.of_total(step)} {shown + ' ' if shown else ''}"
            f"{console.count(examples_per_sec)} examples/s, {self.timing(step)}"
        )
        if algorithm_words:
            line += f"; {algorithm_words}"
        if goodput_percent is not None:
            line += f"; goodput {goodput_percent:.1f}%"
        return line

    def timing(self, step: int) -> str:
        """`"elapsed 12s, ETA 8s"`: the ETA at this run's average speed."""
        elapsed = time.monotonic() - self.start
        text = f"elapsed {console.duration(elapsed)}"
        done = step - self.start_step
        if self.total_steps and done > 0:
            remaining = max(0, self.total_steps - step)
            text += f", ETA {console.duration(remaining * elapsed / done)}"
        return text
