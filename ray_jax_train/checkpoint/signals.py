"""SIGTERM as a preemption notice, and the test-only fault-injection switch.

SIGTERM: the first one only sets a flag; the checkpointer sees it at its next preemption check (agreed across
all workers, since a save is collective), saves, waits until Ray has registered the checkpoint, and then
re-raises SIGTERM so that Ray's own handler ends the worker and Ray restarts the group from that checkpoint.
A second SIGTERM, or `grace_s` without a save, ends the worker the ordinary way. So does a SIGTERM that comes
after the run's controller died: Ray ending the workers of a stopped Tune trial or a killed driver, where no
checkpoint could be registered. (Ctrl-C on the driver aborts through the controller, whose abort tells the
workers first: see the backend's `AbortIsNoPreemption`.)

Python only lets the main thread install signal handlers, and a Ray Train loop runs in a side thread, so the
handler is installed by a call on the worker actor itself (a plain actor runs its methods on the main thread).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import List, Optional, Tuple

logger = logging.getLogger(__name__)

FAULTS_ENV = "RAY_JAX_TRAIN_FAULTS"
_FAULT_ACTIONS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}


class _SigtermState:
    installed = False
    active = True  # False once training is over: a SIGTERM then is an ordinary shutdown, not preemption
    received_at: Optional[float] = None
    handled = False  # its checkpoint is saved and the worker keeps training (exit_after_sigterm_save=False)
    timer: Optional[threading.Timer] = None
    releasing = False  # release_sigterm's own SIGTERM is on its way
    preemption = False  # the SIGTERM came while the run's controller lives: a notice, not Ray ending the run
    previous = None
    grace_s = 120.0

    def __init__(self):
        self.decided = threading.Event()  # preemption or teardown: set once the controller has been asked
        self.lock = threading.Lock()


_sigterm = _SigtermState()


def sigterm_received() -> bool:
    """A SIGTERM arrived, was found to be no teardown of the run, and still asks for a checkpoint. While that is
    being found out (a round trip to the controller) this waits for it, so that every caller, the workers'
    agreement on a save included, sees the same answer."""
    if _sigterm.received_at is None:
        return False
    _sigterm.decided.wait(timeout=15)
    return _sigterm.preemption and not _sigterm.handled


def sigterm_handled() -> None:
    """The SIGTERM's checkpoint is registered and the worker trains on: no further saves for it, and no exit when
    the grace period ends (a second SIGTERM still ends the worker)."""
    _sigterm.handled = True
    if _sigterm.timer is not None:
        _sigterm.timer.cancel()


def _exit_the_ordinary_way(signum=signal.SIGTERM, frame=None):
    previous = _sigterm.previous
    if callable(previous):
        previous(signum, frame)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        os.kill(os.getpid(), signal.SIGTERM)


def _handler(signum, frame):
    if not _sigterm.active:
        _exit_the_ordinary_way(signum, frame)
        return
    if _sigterm.received_at is not None:
        if not _sigterm.releasing:  # not the one release_sigterm sends itself
            logger.warning("Second SIGTERM: exiting now.")
        _exit_the_ordinary_way(signum, frame)
        return
    _sigterm.received_at = time.time()
    # A preemption, or Ray ending the run (its controller gone: a stopped Tune trial, a killed driver)? Asking the
    # controller takes a round trip, which a signal handler must not wait for.
    threading.Thread(target=_preemption_or_teardown, daemon=True, name="sigterm-check").start()


def _preemption_or_teardown() -> None:
    gone = _sigterm.active and _run_controller_is_gone()
    with _sigterm.lock:
        if gone or not _sigterm.active:  # torn down, or training ended meanwhile: no save to wait for
            _sigterm.active = False
            _sigterm.decided.set()
            release_sigterm()  # ends the worker now, as Ray's own handler would have
            return
        _sigterm.timer = threading.Timer(_sigterm.grace_s, lambda: release_sigterm())
        _sigterm.timer.daemon = True
        _sigterm.timer.start()
        _sigterm.preemption = True
        # Said before the decision is published: a caller woken by it (the save) never runs ahead of the notice.
        logger.warning(
            "SIGTERM received: the workers save a checkpoint at their next preemption check, then this worker exits "
            "(it exits anyway in %.0fs).", _sigterm.grace_s,
        )
        _sigterm.decided.set()


def _run_controller_is_gone(timeout_s: float = 5.0) -> bool:
    """Whether this worker's Ray Train controller is dead. Ray kills a run's workers right after their controller
    when whoever owned the run (a Tune trial, a driver) goes: no one would register a checkpoint saved then."""
    try:
        import ray
        from ray.train.v2._internal.execution.context import get_train_context

        controller = get_train_context().controller_actor
        ray.get(controller.__ray_ready__.remote(), timeout=timeout_s)
        return False
    except ray.exceptions.ActorDiedError:
        return True
    except Exception:  # noqa: BLE001 - no train context, an unreachable or slow controller: a preemption, maybe
        return False


def _install_on_main_thread(grace_s: float) -> bool:
    if _sigterm.installed:
        return True
    _sigterm.grace_s = grace_s
    _sigterm.previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _handler)
    _sigterm.installed = True
    return True


def install_sigterm_handler(grace_s: float = 120.0) -> bool:
    """Turn SIGTERM into a save request in this worker. Returns False where it cannot be installed."""
    _sigterm.active = True
    if _sigterm.installed:
        return True
    if threading.current_thread() is threading.main_thread():
        return _install_on_main_thread(grace_s)
    try:
        import ray

        actor = ray.get_runtime_context().current_actor
        return bool(ray.get(actor.execute.remote(_install_on_main_thread, grace_s), timeout=60))
    except Exception as exc:  # never fatal: training goes on, only without SIGTERM saves
        logger.warning("Could not install the SIGTERM handler (%s); SIGTERM will not trigger a checkpoint.", exc)
        return False


def deactivate_sigterm_handler() -> None:
    """Training is over: let SIGTERM end the worker at once, without a save or a preemption message."""
    with _sigterm.lock:
        _sigterm.active = False
        if _sigterm.received_at is not None and not _sigterm.handled:  # decided or not: nothing will be saved
            release_sigterm()


def release_sigterm() -> None:
    """After the preemption checkpoint (or the grace period): let the pending SIGTERM end the worker."""
    if _sigterm.received_at is not None:
        _sigterm.releasing = True
        os.kill(os.getpid(), signal.SIGTERM)


# ------------------------------------------------------------------------------------------------------------
# Fault injection (tests only)
# ------------------------------------------------------------------------------------------------------------


def parse_faults(spec: str) -> List[Tuple[str, int, int]]:
    """`"sigkill@7:1,sigterm@12:0"` -> [(action, step, world_rank)]; the rank defaults to 0."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            action, rest = item.split("@")
            step, _, rank = rest.partition(":")
            faults.append((action.lower(), int(step), int(rank or 0)))
        except ValueError:
            raise ValueError(f"{FAULTS_ENV}={spec!r}: {item!r} is not ACTION@STEP[:RANK], e.g. sigkill@7:1.") from None
        if action.lower() not in _FAULT_ACTIONS:
            raise ValueError(f"{FAULTS_ENV}: unknown action {action!r}; use one of {sorted(_FAULT_ACTIONS)}.")
    return faults


def maybe_inject_fault(step: int) -> None:
    """If `RAY_JAX_TRAIN_FAULTS` names this step and this worker's rank, signal this process (once per run).

    Each fault fires once per run: a marker file in the run's storage directory records that it fired, so the
    restarted group passes the same step. Tests set the variable through `JaxConfig(env_vars=...)`.
    """
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    for action, at, fault_rank in parse_faults(spec):
        if at != step or fault_rank != rank:
            continue
        storage = context.get_storage()
        fs = storage.storage_filesystem
        marker_dir = f"{storage.experiment_fs_path}/.ray_jax_train_faults"
        marker = f"{marker_dir}/{action}@{at}:{fault_rank}"
        import pyarrow.fs as pafs

        if fs.get_file_info(marker).type != pafs.FileType.NotFound:
            continue
        fs.create_dir(marker_dir, recursive=True)
        with fs.open_output_stream(marker) as f:
            f.write(b"fired")
        logger.warning("Fault injection: %s at step %d on rank %d.", action, step, rank)
        os.kill(os.getpid(), _FAULT_ACTIONS[action])
        if action == "sigkill":
            time.sleep(60)  # never returns: SIGKILL cannot be caught
