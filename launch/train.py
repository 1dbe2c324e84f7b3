"""Trains a model on a DistBelief cluster.

Local cluster (no `TF_CONFIG`): the script starts `--num_workers` workers and
`--num_ps` ps tasks on 127.0.0.1, trains, prints test accuracy, and ends them;
on Linux it first re-executes itself in a private network namespace
(`--isolate_network`), since TensorFlow's servers listen on every interface.
With `TF_CONFIG` the same command runs on every machine; each task does its part
(ps/worker serve, chief trains, evaluator evaluates checkpoints).

  python launch/train.py --model=digits --optimizer=adagrad --num_workers=2 --num_ps=2
"""

import os
import sys

# The repository's entry to the command that a pip install names
# `tf-distbelief-train` (`tf_distbelief.launch.train`): it runs the checkout's
# package, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tf_distbelief.launch import train  # noqa: E402  (no TensorFlow)

if __name__ == "__main__":
    train.main()
