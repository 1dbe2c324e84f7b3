"""The planner: predicted throughput of parameter-server training and Downpour.

* `cost_model`: bytes per step, NIC rates, ps count, compute and the chief's
  scheduling as bounds on examples/s; the fewest ps tasks and the smallest
  `n_push` that keep the workers busy (pure Python, no TensorFlow).
* `records`: what a prediction is of, `Cluster`, `Setting` and a step's
  `Traffic`, which `cost_model` and `queueing` both read.
* `queueing`: the wait of a worker's transfers behind the others' at the ps
  NICs, with the coordinator's joins and the workers' step-time variation.
* `host`: the workers' compute where they share one host's cores (a local
  emulation), each slowing the others' steps.
* `push_bytes`: a compressed setting's bytes, from the push rules, and its
  update-stream fetches.
* `python -m tf_distbelief.planner --params=42M --workers=200 --ps=8
  --nic=10gbit --step_ms=100` prints its table (docs/planning.md).
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "Cluster": "records",
        "Prediction": "cost_model",
        "Setting": "records",
        "Traffic": "records",
        "chief_steps_per_execution": "cost_model",
        "compute_only_rate": "cost_model",
        "parse_count": "cost_model",
        "plan": "cost_model",
        "predict": "cost_model",
        "smallest_n": "cost_model",
        "smallest_ps": "cost_model",
        "standard_settings": "cost_model",
        "step_traffic": "cost_model",
    },
)
