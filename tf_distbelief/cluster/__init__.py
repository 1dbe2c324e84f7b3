"""The cluster: what it is, a task's server, and the three ways it runs.

* What a cluster is, for any task: its description and checks (`config`,
  with the address rules of `addresses`), where this task's comes from
  (`source`: `TF_CONFIG`, or a JobSet pod's identity, `jobset_pod`), a ps or
  worker task's server (`server`, whose entry point is `python -m
  tf_distbelief.cluster.server_main`), the status probe of a task (`health`)
  and the chief's bounded start-up (`connect`).
* `local`: the local cluster, ps and worker tasks as child processes of the
  chief (`LocalCluster`), the GPUs each sees and the hung task watch.
* `network`: the local cluster's network: its isolation from the host's
  (`enter_private_network`) and an emulated NIC per task.
* `k8s`: Kubernetes manifests for a cluster of pods (a JobSet, a TFJob).

The public names are re-exported here.
"""

from tf_distbelief import _lazy

# Lazy (`_lazy`): `python -m tf_distbelief.cluster.health`, the pods' liveness
# probe, and a ps or worker task's `server_main` import only what they use.
__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "ALLOWED_JOBS": "config",
        "DEFAULT_START_TIMEOUT_SECS": "local.local_cluster",
        "JOB_ALIASES": "config",
        "SERVER_JOBS": "config",
        "LocalCluster": "local.local_cluster",
        "enter_private_network": "network.isolation",
        "resolve_cluster": "source",
        "run_server": "server",
        "server_config": "server",
        "training_cluster_resolver": "config",
        "validate_cluster": "config",
    },
)
