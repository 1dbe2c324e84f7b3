"""The local cluster's network, kept apart from the host's.

* `isolation`: a private network namespace for the whole local job, so that
  TensorFlow's unauthenticated servers listen on no interface of the host.
* `emulated`: inside it, an emulated network: each ps and worker task in a
  namespace of its own, behind a NIC of a set rate (`--emulate_nic`).

The public names are on `tf_distbelief.cluster`.
"""
