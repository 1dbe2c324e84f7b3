"""Kubernetes manifests of a training job (what `launch/k8s.py` writes).

* `manifest`: what every kind shares: the settings (`PodsConfig`), a role's
  pod spec, the `NetworkPolicy`, YAML.
* `jobset`: a `JobSet` (kubernetes-sigs), whose pods build their
  `TF_CONFIG` themselves (`cluster.jobset_pod`).
* `tfjob`: a Kubeflow `TFJob`, whose operator gives each pod its `TF_CONFIG`.

The pods read their cluster with `tf_distbelief.cluster` (`source`).
"""
