"""ray_jax_train: JAX as a first-class citizen of Ray Train."""
from ray_jax_train.backend import JaxConfig
from ray_jax_train.data import batch_sharding, iter_jax_batches
from ray_jax_train.mesh import get_mesh, make_mesh
from ray_jax_train.trainer import JaxTrainer

__all__ = ["JaxConfig", "JaxTrainer", "batch_sharding", "get_mesh", "iter_jax_batches", "make_mesh"]
__version__ = "0.1.0"
