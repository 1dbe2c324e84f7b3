"""The bytes of a compressed Downpour push, and of the fetches that follow it.

A planner `Setting` may compress its pushes as `DownpourConfig` does
(`top_k_fraction`, `quantize_bits`). The bytes of one push come from the
push rules themselves (`push_rules.reference.push_nbytes`: the selecting
rule's count of kept entries, the coding rule's coded bytes, their
positions), so a compressed setting is predicted as what it sends, and a
change to a rule's coding changes the prediction with it.

What a replica fetches depends on the outer rule:

* **With the outer rule** (`outer`): update-stream fetches
  (`tf_distbelief.downpour.stream_fetch`). A fetch replays the pushes the ps
  logged since the replica's last fetch, every replica's, its own included,
  each as coded as it was pushed: `W` replicas at equal speed log
  `W * n_fetch / n_push` pushes of `P` bytes between two fetches of one
  replica, so a step fetches `W * P / n_push`; with one replica only the
  index of its own push comes back (nothing). A compressed push with the
  outer rule has `n_fetch == n_push` (`push_rules.rule.check_compressible`),
  so replicas at equal speed are `W` pushes behind at each fetch, within
  the log's window (`update_stream.stream_window(W)`: 4 rounds); a replica
  further behind (a straggler) would fetch whole, which is not modelled.
  The ps sends each push it receives to every replica, so what a shard
  sends grows with the square of the replica count: past `W = M / P`
  replicas (`M` the model's bytes) the stream costs a replica more than the
  uncompressed outer rule's fetch, past `2 * M / P` more than a whole fetch
  of values and momentum.
* **Without it**: error feedback, and the fetch is the whole model every
  `n_fetch` steps, as uncompressed Downpour's.

Not modelled: the first, whole fetch of each replica (once per job), and
sparse fetches (`push_rules.sparse_fetches`), whose bytes depend on the
data. Pure: no TensorFlow.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief.downpour.push_rules import reference, rule

__all__ = ["push_bytes", "stream_fetch_bytes"]


def push_bytes(setting, num_params: int) -> int:
    """Bytes of one compressed push of a model of `num_params` float32 values.

    The model is taken as one tensor (a real model's tensors each round
    their kept count up: a few bytes more).

    Args:
      setting: a `records.Setting` that compresses (`Setting.compressed`).
      num_params: trainable parameters.

    Returns:
      The bytes the push rules' `push_nbytes` gives.
    """
    flat = np.broadcast_to(np.float32(0), (num_params,))  # Sizes only.
    return reference.push_nbytes(rule.resolve(setting.downpour_config()), [flat])


def stream_fetch_bytes(setting, push_nbytes: int, num_workers: int) -> float:
    """Bytes a replica's update-stream fetches move per step, on average.

    Args:
      setting: a `records.Setting` that compresses, with the outer rule.
      push_nbytes: the bytes of one of its pushes (`push_bytes`).
      num_workers: model replicas.

    Returns:
      `num_workers * push_nbytes / n_push` (module docstring); 0 with one
      replica.
    """
    if num_workers == 1:
        return 0.0
    return num_workers * push_nbytes / setting.n_push
