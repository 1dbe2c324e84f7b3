"""The cluster: configuration (`config`, with the address rules of
`addresses`), a task's server (`server`), the local cluster of child processes
(`local`), the GPUs each local task sees (`gpus`), and its network isolation
(`isolation`), bounded start-up (`connect`), and Kubernetes manifests for a
cluster of pods (`jobset`, whose pods build their `TF_CONFIG` themselves, and
`tfjob`; what they share is `manifest`'s).

The public names are re-exported here; `server_main` is the child tasks'
entry point (`python -m tf_distbelief.cluster.server_main`).
"""

from tf_distbelief import _lazy

# Lazy (`_lazy`): `python -m tf_distbelief.cluster.health`, the pods' liveness
# probe, and a ps or worker task's `server_main` import only what they use.
__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "ALLOWED_JOBS": "config",
        "DEFAULT_START_TIMEOUT_SECS": "local",
        "JOB_ALIASES": "config",
        "SERVER_JOBS": "config",
        "LocalCluster": "local",
        "enter_private_network": "isolation",
        "resolve_cluster": "config",
        "run_server": "server",
        "server_config": "server",
        "training_cluster_resolver": "config",
        "validate_cluster": "config",
    },
)
