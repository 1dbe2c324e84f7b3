"""The local cluster: ps and worker tasks as child processes of the chief.

* `local_cluster`: `LocalCluster`, the tasks on this host, started,
  supervised (restarted when lost) and stopped with the chief.
* `gpus`: the GPUs each local task sees.
* `hung_tasks`: the watch that treats a task that stopped answering as lost
  (its own process, `python -m tf_distbelief.cluster.local.hung_tasks`).
* `children`: child processes that die with the chief.
* `proc_stat`: a process's kernel counters (`/proc/<pid>/stat`).

Its network (a private namespace, an emulated NIC per task) is
`cluster.network`'s. The public names are on `tf_distbelief.cluster`.
"""
