"""The faults layer: what keeps a job's state exact through failures.

Under the algorithms: `exactly_once` (a rerun step is never applied twice),
`nonfinite` (no non-finite value reaches a ps variable or a checkpoint),
`resume` (a checkpoint restored exactly, into any number of ps tasks),
`recovery` (the chief restores after a lost ps task), `preemption` (a
checkpoint of the step reached at SIGTERM, within a grace period),
`step_watch` (a
bounded wait for scheduled steps) and `goodput` (where a job's wall time
went: training, checkpoints, recovery, start-up, steps redone).
`errors.DistBeliefError` is the base of their exceptions.
"""
