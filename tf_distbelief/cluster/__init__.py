"""The cluster: configuration (`config`, with the address rules of
`addresses`), a task's server (`server`), the local cluster of child processes
(`local`), the GPUs each local task sees (`gpus`), and its network isolation
(`isolation`), bounded start-up (`connect`), and Kubernetes manifests for a
cluster of pods (`jobset`, whose pods build their `TF_CONFIG` themselves, and
`tfjob`; what they share is `manifest`'s).

The public names are re-exported here; `server_main` is the child tasks'
entry point (`python -m tf_distbelief.cluster.server_main`).
"""

from tf_distbelief.cluster.config import (
    ALLOWED_JOBS,
    JOB_ALIASES,
    SERVER_JOBS,
    resolve_cluster,
    training_cluster_resolver,
    validate_cluster,
)
from tf_distbelief.cluster.isolation import enter_private_network
from tf_distbelief.cluster.local import (
    DEFAULT_START_TIMEOUT_SECS,
    LocalCluster,
)
from tf_distbelief.cluster.server import run_server, server_config

__all__ = [
    "ALLOWED_JOBS",
    "DEFAULT_START_TIMEOUT_SECS",
    "JOB_ALIASES",
    "SERVER_JOBS",
    "LocalCluster",
    "enter_private_network",
    "resolve_cluster",
    "run_server",
    "server_config",
    "training_cluster_resolver",
    "validate_cluster",
]
