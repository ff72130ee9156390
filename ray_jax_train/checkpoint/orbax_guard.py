"""Orbax's own save, called in a loop, checked to name one directory on every process.

Ray's checkpoint guide (for its own JaxTrainer, which starts no jax.distributed job on CPU) saves with orbax into a
directory per worker and reports each with `Checkpoint.from_directory`. In a jax.distributed job an orbax save is
collective: each process writes its shards into one directory and they meet at barriers named after it. With a
directory per worker they never meet: `wait_until_finished()` hung with no message, and without it the run
reported an unfinished `*.orbax-checkpoint-tmp` as its checkpoint. The guard compares the directories first (one
key-value exchange per save) and refuses the save, naming the fix, before orbax writes anything.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

from ray_jax_train.errors import UsageValueError

_local = threading.local()


@contextlib.contextmanager
def unchecked():
    """Around this package's own orbax saves: they name one directory on every process by construction."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _where(directory) -> str:
    path = os.fspath(directory) if isinstance(directory, os.PathLike) else str(directory)
    return path if "://" in path else os.path.abspath(path)


def check_one_directory(directory) -> None:
    """Every process's save directory, compared; a ValueError naming them where they differ."""
    from ray_jax_train.checkpoint import _sync

    if _sync.process_count() == 1:
        return
    # In order with the package's other exchanges: a save made on rank 0 only, while the others report, is named
    # at once (see _sync.why_never).
    where = _sync.allgather("orbax save", _where(directory))
    if len(set(where)) > 1:
        shown = ", ".join(f"process {p}: {w}" for p, w in enumerate(where[:4])) + (" ..." if len(where) > 4 else "")
        raise UsageValueError(
            f"orbax's save was called with a different directory on each worker ({shown}). In a jax.distributed "
            "job (this trainer's default) an orbax save is collective: every process writes its shards into one "
            "directory, and a directory per worker, as Ray's checkpoint guide shows for its own JaxTrainer, never "
            "completes. Use rjt.save_and_report(step, state) or rjt.JaxCheckpointer, which save into the run's "
            "storage and report through Ray; or give every worker the same directory on storage all of them see; "
            "or JaxConfig(distributed=False) for a separate JAX per worker.")


def install() -> None:
    """Wrap orbax's Checkpointer.save and AsyncCheckpointer.save in this process (idempotent)."""
    import orbax.checkpoint as ocp

    for cls in (ocp.Checkpointer, ocp.AsyncCheckpointer):
        original = cls.__dict__.get("save")
        if original is None or getattr(original, "_ray_jax_train_guard", False):
            continue

        @functools.wraps(original)
        def save(self, directory, *args, _original=original, **kwargs):
            if not getattr(_local, "depth", 0):  # not ours, and not a save nested in one already checked
                check_one_directory(directory)
            with unchecked():
                return _original(self, directory, *args, **kwargs)

        save._ray_jax_train_guard = True
        cls.save = save
