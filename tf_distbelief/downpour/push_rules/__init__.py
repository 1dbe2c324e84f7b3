"""Downpour's push rules: how the ps applies a replica's push, one file each.

* `rule`: `PushRule`, the base class; `Setting`; the registry (`register`,
  `unregister`, `registered`, `rules`, `settings`). Pure.
* One module per rule (`RULE` in each): `outer_nesterov` (outer Nesterov on
  the pushed parameter delta, DiLoCo), `delay_compensation` (DC-ASGD),
  `staleness_scaled` (the step over the staleness), `stale_damping` (a
  stale pseudo-gradient damped against the outer momentum), and the compressed
  pushes with error feedback, `top_k` and `quantize`. Pure at import.
* `reference`: the rules at a push in NumPy (`schedule.simulate`). Pure.
* `on_ps`: the rules at a push on the ps, in TensorFlow (`replica.Downpour`).
* `compression`: compressed pushes in TensorFlow: encoded on the replica,
  decoded on the ps, and the replica's residuals.
"""
