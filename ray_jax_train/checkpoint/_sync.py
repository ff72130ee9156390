"""Host-side agreement between the processes of one jax.distributed job, through its key-value store.

Checkpoint decisions (which checkpoint to restore, whether to save now) must be identical on every process,
because orbax saves are collective. They go through the coordinator's key-value store rather than a device
collective so that a process whose restore raised can still take part, and so they never interleave with
the training step's collectives.
"""
from __future__ import annotations

import itertools
from typing import List, Optional

_rounds = itertools.count()
_TIMEOUT_MS = 10 * 60 * 1000
# This process's keys from earlier rounds, deleted once a later round shows every process is past them: never
# deleted, the coordinator kept two keys per process per preemption check (one every 10 steps) for the whole run.
_written: List[str] = []


def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


def allgather(tag: str, value: str, timeout_ms: int = _TIMEOUT_MS, key: Optional[str] = None) -> List[str]:
    """Every process's `value`, in process order.

    Without `key`, all processes must call it in the same order (the round number is the key). A `key`
    unique to this exchange lets it run in any thread, in any order relative to other exchanges.
    """
    if process_count() == 1:
        return [value]
    from jax._src import distributed

    client = distributed.global_state.client
    in_order = key is None
    key = f"ray_jax_train/ckpt/{next(_rounds)}/{tag}" if in_order else f"ray_jax_train/ckpt/{key}"
    mine = f"{key}/{process_index()}"
    client.key_value_set(mine, value)
    values = [client.blocking_key_value_get(f"{key}/{p}", timeout_ms) for p in range(process_count())]
    if in_order:
        # Every process has written this round, so each has read every earlier one: ours can go.
        for old in _written:
            client.key_value_delete(old)
        _written[:] = [mine]
    return values


def broadcast(tag: str, value: str, timeout_ms: int = _TIMEOUT_MS) -> str:
    """Process 0's `value` on every process."""
    if process_count() == 1:
        return value
    from jax._src import distributed

    client = distributed.global_state.client
    key = f"ray_jax_train/ckpt/{next(_rounds)}/{tag}"
    if process_index() == 0:
        client.key_value_set(key, value)
        _written.append(key)
        return value
    return client.blocking_key_value_get(key, timeout_ms)
