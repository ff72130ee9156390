"""Train-state checkpoints for JaxTrainer loops: sharded, asynchronous, retained by Ray, exactly resumable.

`JaxCheckpointer` is the object a loop uses; `save_and_report` / `restore` are the same operations as plain
functions; `ResumableBatches` is the deterministic data path that makes a resumed run bit-identical to an
uninterrupted one. See `core.py` for the design.
"""
from ray_jax_train.checkpoint.batches import ResumableBatches
from ray_jax_train.checkpoint.core import (
    CheckpointCorruptError,
    StorageNotSharedError,
    CheckpointMismatchError,
    JaxCheckpointer,
    RestoreTargetError,
    Restored,
    abstract_state,
    checksums,
    restore,
    save_and_report,
    wait_for_saves,
)
from ray_jax_train.checkpoint.signals import FAULTS_ENV

__all__ = [
    "FAULTS_ENV",
    "CheckpointCorruptError",
    "StorageNotSharedError",
    "CheckpointMismatchError",
    "RestoreTargetError",
    "JaxCheckpointer",
    "Restored",
    "ResumableBatches",
    "abstract_state",
    "checksums",
    "restore",
    "save_and_report",
    "wait_for_saves",
]
