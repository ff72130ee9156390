"""Host-side agreement between the processes of one jax.distributed job, through its key-value store.

Checkpoint decisions (which checkpoint to restore, whether to save now) must be identical on every process,
because orbax saves are collective. They go through the coordinator's key-value store rather than a device
collective so that a process whose restore raised can still take part, and so they never interleave with
the training step's collectives.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from typing import Dict, List, Optional

logger = logging.getLogger(__name__)

_rounds = itertools.count()
_TIMEOUT_MS = 10 * 60 * 1000
_WARN_AFTER_MS = 60 * 1000
_RULE = ("Checkpoint calls are collective: call save/maybe_save/restore/wait (save_and_report, restore) on every "
         "worker with the same step, not only on rank 0 as with Ray's own checkpoints")


class CollectiveTimeoutError(TimeoutError):
    """Some processes never reached a checkpoint exchange that every process must join."""
# This process's keys from earlier rounds, deleted once a later round shows every process is past them: never
# deleted, the coordinator kept two keys per process per preemption check (one every 10 steps) for the whole run.
_written: List[str] = []


def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


def allgather(tag: str, value: str, timeout_ms: int = _TIMEOUT_MS, key: Optional[str] = None,
              rule: Optional[str] = None) -> List[str]:
    """Every process's `value`, in process order.

    Without `key`, all processes must call it in the same order (the round number is the key). A `key`
    unique to this exchange lets it run in any thread, in any order relative to other exchanges. `rule`: what a
    process that never arrives was told to do (the checkpoint calls' rule by default).
    """
    if process_count() == 1:
        return [value]
    from jax._src import distributed

    client = distributed.global_state.client
    in_order = key is None
    if in_order:
        note_waiting_thread()
    key = f"ray_jax_train/ckpt/{next(_rounds)}/{tag}" if in_order else f"ray_jax_train/ckpt/{key}"
    mine = f"{key}/{process_index()}"
    client.key_value_set(mine, value)
    values = _gather(client, tag, [f"{key}/{p}" for p in range(process_count())], timeout_ms, in_order, rule)
    if in_order:
        # Every process has written this round, so each has read every earlier one: ours can go.
        for old in _written:
            client.key_value_delete(old)
        _written[:] = [mine]
    return values


def keys_that_differ(tag: str, values: Dict[str, str], timeout_ms: int = _TIMEOUT_MS,
                     rule: Optional[str] = None) -> List[str]:
    """The keys of `values` (digests by leaf, say) whose value is not the same on every process: one in-order
    exchange."""
    import json

    everyone = [json.loads(s) for s in allgather(tag, json.dumps(values), timeout_ms=timeout_ms, rule=rule)]
    return [key for key in values if len({theirs.get(key) for theirs in everyone}) > 1]


def differ_between_processes(keys: List[str]) -> str:
    """'a, b ... differ between the N processes', for `keys_that_differ`'s answer."""
    listed = ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
    return f"{listed} differ{'' if len(keys) > 1 else 's'} between the {process_count()} processes"


def broadcast(tag: str, value: str, timeout_ms: int = _TIMEOUT_MS) -> str:
    """Process 0's `value` on every process."""
    if process_count() == 1:
        return value
    from jax._src import distributed

    client = distributed.global_state.client
    note_waiting_thread()
    key = f"ray_jax_train/ckpt/{next(_rounds)}/{tag}"
    if process_index() == 0:
        client.key_value_set(key, value)
        _written.append(key)
        return value
    return _gather(client, tag, [key], timeout_ms, in_order=True)[0]


# Set by each process when its training function ends (`mark_loop_done`): a process still waiting at an in-order
# exchange for one whose function has returned waits for nothing, and says so at once instead of at the timeout.
_DONE_KEY = "ray_jax_train/loop_done/{}"
_POLL_MS = 2000


def mark_loop_done(outcome: str = "returned") -> None:
    """Record in the job's key-value store that this process's training function has ended ("returned"/"raised")."""
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None or process_count() == 1:
            return
        client.key_value_set(_DONE_KEY.format(process_index()), outcome)
    except Exception as exc:  # noqa: BLE001 - advice for others' errors only: it must not fail a finished loop
        logger.debug("Could not record the end of this process's loop: %s", exc)


# Set while a process waits in Ray's report barrier (every `ray.train.report` waits there for all workers): how many
# report barriers it has entered. A process at an in-order exchange for one that waits in a report this process has
# not made yet waits for nothing (the other waits for it in turn): a save or restore on some workers only. That holds
# only where each process reports and waits in one thread (a loop's usual shape): a process that has used several
# threads for them publishes no count, and judges no other.
_BARRIER_KEY = "ray_jax_train/report_barrier/{}"
_barriers_entered = 0
_threads: set = set()  # the threads that reported or waited at an in-order exchange in this process


def note_waiting_thread() -> None:
    """Called by in-order waits (checkpoint exchanges, iterator openings): see `_in_later_report`."""
    _threads.add(threading.get_ident())


@contextlib.contextmanager
def in_report_barrier():
    """Around Ray's report barrier on each worker (`ReportBarrierMarks`): counts it, and marks this process as in it."""
    global _barriers_entered
    _barriers_entered += 1
    _threads.add(threading.get_ident())
    client = _client()
    marked = client is not None and _mark(client, str(_barriers_entered) if len(_threads) == 1 else "")
    try:
        yield
    finally:
        if marked:
            _mark(client, "")


def _client():
    """The job's key-value client where this is one process of several; None otherwise. Asks nothing of JAX's backend
    when there is no jax.distributed client (it would start the backend at a report made before any JAX work)."""
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        return client if client is not None and process_count() > 1 else None
    except Exception:  # noqa: BLE001 - no jax.distributed in this process: nothing to mark
        return None


def _mark(client, value: str) -> bool:
    try:
        client.key_value_set(_BARRIER_KEY.format(process_index()), value, allow_overwrite=True)
        return True
    except Exception as exc:  # noqa: BLE001 - advice for others' errors only: a report must not fail on it
        logger.debug("Could not mark this process's report barrier: %s", exc)
        return False


def _in_later_report(client, process: int, key: str) -> Optional[int]:
    """The report barrier `process` waits in without having written `key`, if this process has not entered it (so
    it waits for this one); else None. The mark is read before the key: `process` writes the key, if at all, before
    it enters the barrier, so a key missing after the mark was read will not come while it waits there."""
    if _threads - {threading.get_ident()}:
        return None  # this process reports or waits in several threads: its own count says nothing here
    try:
        entered = int(client.key_value_try_get(_BARRIER_KEY.format(process)) or 0)
    except Exception:
        return None
    if entered <= _barriers_entered:
        return None
    try:
        client.key_value_try_get(key)
        return None
    except Exception:
        return entered


def _returned(client, process: int, key: str) -> bool:
    """Whether `process` has returned from its training function without writing `key`. Its end mark is read before
    the key: it writes the key (if ever) before its mark, so a mark seen means a key written by then is seen too."""
    try:
        if client.key_value_try_get(_DONE_KEY.format(process)) != "returned":
            return False  # running, or raised: Ray ends the group with that process's own error
    except Exception:
        return False
    try:
        client.key_value_try_get(key)
        return False
    except Exception:
        return True


def why_never(client, process: int, key: str) -> Optional[str]:
    """Why `process` will never write `key`, where that is known now; None where it may yet. Only for a wait in the
    loop's own thread (the one that reports): its training function has returned, or it waits in a report barrier
    that this process has not entered, so for this one, which waits for it."""
    if _returned(client, process, key):
        return "its training function has already returned"
    report = _in_later_report(client, process, key)
    if report is not None:
        return (f"it waits in ray.train.report (its report number {report}; this process has made "
                f"{_barriers_entered}) for this one to report too, so neither can go on")
    return None


def _missing(client, keys: List[str]) -> List[int]:
    missing = []
    for key in keys:
        try:
            client.key_value_try_get(key)
        except Exception:
            missing.append(int(key.rsplit("/", 1)[-1]) if len(keys) > 1 else 0)
    return missing


def _gather(client, tag: str, keys: List[str], timeout_ms: int, in_order: bool = False,
            rule: Optional[str] = None) -> List[str]:
    """The values under `keys`; a warning after a minute, then an error, naming the processes that never wrote.
    In an in-order exchange (the loop's own thread), a process whose training function has returned will never
    write: that is an error at once. Not in a keyed one: those also run in Ray's upload thread, which finishes
    after the training function has returned.

    A process waiting in Ray's report barrier for this one is an error at once too (`_in_later_report`).

    A bare blocking get waited silently for the whole timeout (10 minutes) and then named only a key: what a
    rank-0-only save looks like, since the other ranks wait in Ray's report meanwhile, or have returned."""
    rule = rule or _RULE
    what = "checkpoint exchange" if rule == _RULE else "exchange"
    started = time.monotonic()
    deadline = started + timeout_ms / 1000
    warn_at = started + _WARN_AFTER_MS / 1000
    warned = False
    values = []
    for key in keys:
        while True:
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)
            try:
                values.append(client.blocking_key_value_get(key, max(1, min(left_ms, _POLL_MS))))
                break
            except Exception as exc:
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise
            waited_for = int(key.rsplit("/", 1)[-1]) if len(keys) > 1 else 0  # a broadcast waits for process 0
            never = why_never(client, waited_for, key) if in_order else None
            if never:
                raise CollectiveTimeoutError(
                    f"Process {process_index()} is at the {what} {tag!r}, which process {waited_for} "
                    f"will never reach: {never}. {rule}.")
            now = time.monotonic()
            if now < deadline and (warned or now < warn_at):
                continue
            missing = _missing(client, keys)
            if now >= deadline:
                raise CollectiveTimeoutError(
                    f"Process {process_index()} waited {timeout_ms / 1000:.0f} s at the {what} "
                    f"{tag!r} for process(es) {missing}, which never reached it. {rule}." + (
                        " If they are only slower (a large state on slow storage), raise "
                        "JaxCheckpointer(timeout_s=...)." if rule == _RULE else "")) from None
            if not warned and now >= warn_at:
                warned = True
                logger.warning("Process %d has waited %.0f s at the %s %r for process(es) %s. %s; "
                               "a worker that is only slower (compiling, reading a large state) arrives later.",
                               process_index(), time.monotonic() - started, what, tag, missing, rule)
    return values
