"""ray_jax_train: JAX as a first-class citizen of Ray Train.

Every public name loads on first use: every Ray worker that unpickles a function or config of ours imports this
package, and a Ray Data worker tokenising text should not pay 0.8 s of a CPU for ray.train, nor a training worker
for flax or transformers before its loop asks for them.
"""
import importlib

from ray_jax_train._imports import guard_cut_imports, worker_setup_hook
from ray_jax_train._imports import in_ray_worker as _in_ray_worker
from ray_jax_train._imports import mend_cut_imports as _mend_cut_imports
from ray_jax_train._imports import uninterrupted_imports as _uninterrupted_imports

# Ray cancels a task by an interrupt and reuses its worker: an import cut there must not leave the worker's
# fsspec (or any package) half-made for every later task (see _imports.py).
_mend_cut_imports()  # one cut before this process imported the package
if _in_ray_worker():
    guard_cut_imports()  # the cuts to come

__version__ = "0.1.0"

_LAZY = {
    # the core: trainer, backend, mesh, data
    "JaxTrainer": "ray_jax_train.trainer",
    "init_ray": "ray_jax_train.trainer",
    "JaxConfig": "ray_jax_train.backend",
    "compilation_cache_hits": "ray_jax_train.backend",
    "compilation_cache_misses": "ray_jax_train.backend",
    "JaxDataConfig": "ray_jax_train.data_config",
    "get_mesh": "ray_jax_train.mesh",
    "make_mesh": "ray_jax_train.mesh",
    "iter_jax_batches": "ray_jax_train.data",
    "batch_sharding": "ray_jax_train.data",
    "DataError": "ray_jax_train.data",
    "DataTypeError": "ray_jax_train.data",
    "DataValueError": "ray_jax_train.data",
    "IteratorsOutOfStepError": "ray_jax_train.data",
    "NoFullBatchError": "ray_jax_train.data",
    "UsageError": "ray_jax_train.errors",
    "UsageTypeError": "ray_jax_train.errors",
    "UsageValueError": "ray_jax_train.errors",
    # model configuration (EasyDeL-style scaling)
    "LlamaConfig": "ray_jax_train.config",
    "ModelScaling": "ray_jax_train.config",
    "MeshSpec": "ray_jax_train.config",
    # models and Hugging Face weights
    "LlamaForCausalLM": "ray_jax_train.models",
    "create_model": "ray_jax_train.models",
    "from_pretrained": "ray_jax_train.models",
    "save_pretrained": "ray_jax_train.models",
    "flops_per_token": "ray_jax_train.models",
    "generate": "ray_jax_train.models",
    "generate_text": "ray_jax_train.models",
    "generation_eos_ids": "ray_jax_train.models",
    # the causal-LM trainer (EasyDeL's RayDistributedTrainer API, on Ray)
    "RayDistributedTrainer": "ray_jax_train.lm",
    "TrainingArguments": "ray_jax_train.lm",
    "NonFiniteLossError": "ray_jax_train.lm",
    "NoLossTokensError": "ray_jax_train.lm",
    "export_checkpoint": "ray_jax_train.lm",
    # checkpoints
    "JaxCheckpointer": "ray_jax_train.checkpoint",
    "ResumableBatches": "ray_jax_train.checkpoint",
    "abstract_state": "ray_jax_train.checkpoint",
    "save_and_report": "ray_jax_train.checkpoint",
    "restore": "ray_jax_train.checkpoint",
    "wait_for_saves": "ray_jax_train.checkpoint",
    "Restored": "ray_jax_train.checkpoint",
    "CheckpointCorruptError": "ray_jax_train.checkpoint",
    "StorageNotSharedError": "ray_jax_train.checkpoint",
    "CheckpointMismatchError": "ray_jax_train.checkpoint",
    "RestoreTargetError": "ray_jax_train.checkpoint",
    # model parallelism: partition rules for params and optimizer state
    "PartitionRules": "ray_jax_train.sharding",
    "llama_partition_rules": "ray_jax_train.sharding",
    "partition_specs": "ray_jax_train.sharding",
    "shardings_for": "ray_jax_train.sharding",
    "shard_by_rules": "ray_jax_train.sharding",
    "ProcessCopiesDifferError": "ray_jax_train.sharding",
    "check_llama_parallelism": "ray_jax_train.sharding",
    "make_hybrid_mesh": "ray_jax_train.sharding",
    "bytes_per_device": "ray_jax_train.sharding",
    # text pipeline
    "train_tokenizer": "ray_jax_train.text",
    "load_tokenizer": "ray_jax_train.text",
    "local_corpus": "ray_jax_train.text",
    "load_text_dataset": "ray_jax_train.text",
    "build_lm_dataset": "ray_jax_train.text",
    "tokenize_and_pack": "ray_jax_train.text",
    "pack_documents": "ray_jax_train.text",
    "process_sample_data": "ray_jax_train.text",
    "process_messages_data": "ray_jax_train.text",
    "extract_column_names": "ray_jax_train.text",
}

__all__ = ["guard_cut_imports", "worker_setup_hook", *_LAZY]


# Subpackages the docs name as `ray_jax_train.<name>` (`ray_jax_train.tune.run`): reachable after a plain import.
_SUBMODULES = ("checkpoint", "cli", "config", "data", "lm", "mesh", "models", "plot", "run_config", "sharding",
               "storage", "text", "tune")


def __getattr__(name):
    if name in _SUBMODULES:
        with _uninterrupted_imports():
            return importlib.import_module(f"ray_jax_train.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_jax_train' has no attribute {name!r}")
    with _uninterrupted_imports():
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
