"""The planner: predicted throughput of parameter-server training and Downpour.

`cost_model` holds the model (pure Python, no TensorFlow); `python -m
tf_distbelief.planner --params=42M --workers=200 --ps=8 --nic=10gbit
--step_ms=100` prints its table (docs/planning.md).
"""
