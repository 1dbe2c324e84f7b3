"""tf_distbelief: DistBelief (Dean et al., NIPS 2012) as TensorFlow parts.

The public surface; the modules hold the details (import modules, not names):

* `cluster`: `TF_CONFIG`, validation, ps/worker servers, `LocalCluster`.
* `strategy`: `DistBeliefStrategy`, a ParameterServerStrategy with variables
  sharded over the ps tasks.
* `adagrad`: AdaGrad applied on the ps shards (section 4.1).
* `downpour`, `downpour_schedule`: Downpour SGD (section 4.1).
* `lbfgs`, `ps_vectors`, `sandblaster`: Sandblaster L-BFGS (section 4.2).
* `model_parallel`, `partitioned_dense`, `partitioned_locally_connected`: one
  replica split across devices (section 3).
* `training`, `job`: `Model.fit` with progress, checkpoints and resume; the
  library side of `launch/train.py`.
"""

from tf_distbelief.adagrad import Adagrad
from tf_distbelief.cluster import (
    ClusterConfigError,
    ClusterStartError,
    LocalCluster,
    resolve_cluster,
)
from tf_distbelief.downpour import Downpour, DownpourMetrics, DownpourTrainer
from tf_distbelief.downpour_schedule import DownpourConfig
from tf_distbelief.sandblaster import (
    SandblasterObjective,
    SandblasterStats,
    SandblasterTrainer,
)
from tf_distbelief.strategy import DistBeliefStrategy, Keras3Error

__all__ = [
    "Adagrad",
    "ClusterConfigError",
    "ClusterStartError",
    "DistBeliefStrategy",
    "Downpour",
    "DownpourConfig",
    "DownpourMetrics",
    "DownpourTrainer",
    "Keras3Error",
    "LocalCluster",
    "SandblasterObjective",
    "SandblasterStats",
    "SandblasterTrainer",
    "resolve_cluster",
]
