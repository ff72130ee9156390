"""Library chatter off: Ray, Ray Data, JAX and orbax log at INFO per report, per save and per dataset run, which
buries a training log. The CLI is quiet unless --verbose; the Python trainer unless `verbose=True`. Warnings and
errors always show."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import re
from typing import Any, Callable, Dict

QUIET_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",  # XLA/absl C++ info lines
    "GRPC_VERBOSITY": "ERROR",
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning,ignore::UserWarning",
    "RAY_DATA_LOG_LEVEL": "WARNING",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    # Ray core's C++ ERROR notices that need no action (an actor "has constructor arguments in the object store",
    # for Ray Data's and Train's own actors). The cost: Ray announces the variable in one "Set ray log level from
    # environment variable RAY_BACKEND_LOG_LEVEL" line per process it starts, logged before the level applies.
    "RAY_BACKEND_LOG_LEVEL": "fatal",
}
# Ray Data logs a failed task's whole traceback at ERROR (twice), then raises it: the error, once, is ours to report.
DATA_TASK_ERROR_LOGGERS = ("ray.data._internal.execution.streaming_executor_state", "ray.data.exceptions")
# Ray Data warns that its progress bars are off, which is what quiet_data_context asked for.
PROGRESS_NOTICE_LOGGER = "ray.data._internal.progress"
# Start-up lines that workers print whatever the log level, and that ask nothing of the user: Ray's announcement of
# RAY_BACKEND_LOG_LEVEL (once per process), Ray Data's notice that the bars we turned off are off, and JAX's
# coordinator address (an error names it where it matters).
# Also Ray core's notice that an actor's constructor arguments are in the object store (Ray Data's and Train's own
# actors), Ray Data's line per finished dataset run, gloo's connection count, a deprecation inside Ray Train, and
# Train's cleaner reporting each finished run's placement group (a Tune trial that ASHA stopped, say).
_NOTICE_LINES = re.compile(r"logging\.cc:\d+: Set ray log level from environment variable"
                           r"|Progress bars disabled\. To enable, set"
                           r"|(Starting|Connecting to) JAX distributed service on "
                           r"|has constructor arguments in the object store and max_restarts > 0"
                           r"|Dataset \S+ execution finished in [\d.]+ seconds"
                           r"|\[Gloo\] Rank \d+ is connected to \d+ peer ranks"
                           r"|ExecutionOptions\.exclude_resources` is deprecated|self\.exclude_resources = exclude_res"
                           r"|Ray Train controller actor \(\w+\) is dead\. Cleaning up placement group"
                           r"|Failed to query Ray Train Controller actor state\. State API may be temporarily"
                           # Tune's trial actors ask for 0.1 CPU (they only wait on their Train run): Ray then
                           # warns that it starts more worker processes than CPUs, which is meant.
                           r"|PYTHON worker processes have been started on node")
# A worker whose peer died is ended by JAX's coordination service (Ray then restarts the group): its line saying so
# stays; what it prints before it (two error lines) and after it (a C++ stack trace, the SIGABRT report, Python's
# fatal-error dump: 25 lines that read like a crash of their own, a soak review) does not.
_PEER_DIED = re.compile(r"Terminating process because the JAX distributed service detected fatal errors")
_PEER_DIED_BEFORE = re.compile(r"Failed to cancel preemption barrier|Polled an error from coordination service")
_QUIET_LOGGERS = ("absl", "orbax", "jax", "ray.train", "ray.data", "ray.tune", "ray_jax_train.checkpoint")


def quiet_worker() -> None:
    """Ray worker setup hook: library INFO lines (orbax per-save chatter, Train's per-report lines) off."""
    import logging
    import warnings

    import ray

    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    # Some Ray modules name their logger by file path (logging.getLogger(__file__)), outside "ray.*": Train's
    # "Reporting training result N: TrainingReport(...)" line, once per report, comes from one of them.
    ray_files = os.path.join(os.path.dirname(ray.__file__), "")
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(_QUIET_LOGGERS + (ray_files,))]
    for name in set(names) | set(_QUIET_LOGGERS):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:  # pragma: no cover - absl comes with jax
        pass


def quiet_data_context() -> Callable[[], None]:
    """Ray Data's progress bars and per-execution banners off in this process (the driver, or a Tune trial, which
    builds its datasets in its own process with Ray Data's defaults). Returns what puts them back as they were (a
    Python caller's own context after `tune.run` made the search's datasets)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    was = context.enable_progress_bars, context.print_on_execution_start
    context.enable_progress_bars = False
    context.print_on_execution_start = False

    def undo() -> None:
        context.enable_progress_bars, context.print_on_execution_start = was

    return undo


def quiet_train_loop(config: Dict[str, Any]) -> None:
    """The built-in LM loop, with library INFO logging silenced first in this worker."""
    from ray_jax_train.lm.loop import train_loop_per_worker

    quiet_worker()
    try:
        return train_loop_per_worker(config)
    except Exception as exc:
        import ray

        if isinstance(exc, ray.exceptions.ActorDiedError):
            from ray_jax_train.checkpoint.signals import _run_controller_is_gone

            if _run_controller_is_gone():
                # Ray is taking the run down (a Tune scheduler stopped the trial, the driver went): Train's own
                # actors died under the loop, and the traceback Ray would print for it needs no reader.
                logging.getLogger(__name__).info("The run was stopped (%s); this worker ends.", type(exc).__name__)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        raise


# What a process's own C++ core prints to its stderr as `ray.init` starts it: the announcement above, which no logger
# setting reaches (it is logged before the level applies).
_DRIVER_START_LINE = re.compile(rb"logging\.cc:\d+: Set ray log level from environment variable")


@contextlib.contextmanager
def without_ray_start_line():
    """Within it, this process's stderr (the file descriptor, which Ray's C++ logging writes to) passes through a
    filter that drops `_DRIVER_START_LINE` and forwards everything else as it comes. Where stderr has no
    descriptor (a notebook, a captured test) nothing changes."""
    import threading

    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    read, write = os.pipe()
    os.dup2(write, fd)
    os.close(write)

    def forward():
        # Never stops reading while the pipe is open: a writer to a full pipe would block (a process Ray starts
        # inherits fd 2 unless Ray redirects it; its later lines pass through here).
        with os.fdopen(read, "rb", buffering=0) as pipe:
            pending = b""
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                kept = b"".join(line + b"\n" for line in lines if not _DRIVER_START_LINE.search(line))
                try:
                    if kept:
                        os.write(saved, kept)
                except OSError:  # the terminal went away: drop the output, keep draining the pipe
                    pass
            if pending:
                try:
                    os.write(saved, pending)
                except OSError:
                    pass

    thread = threading.Thread(target=forward, name="ray_jax_train-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)  # the pipe closes unless a process started within inherited it
        thread.join(timeout=2)
        if not thread.is_alive():
            os.close(saved)


def quiet_run_settings() -> Dict[str, Any]:
    """`RunConfig` keyword arguments that keep workers to warnings (their env vars apply when each one starts)."""
    from ray.train.v2.api.config import LoggingConfig

    # Not RAY_BACKEND_LOG_LEVEL: the notices it hides come from actors the driver starts (Ray Data's, Train's), which
    # only a runtime_env given to ray.init reaches (the CLI's); in the workers it would only add its announcement.
    env = {k: v for k, v in QUIET_ENV.items() if k != "RAY_BACKEND_LOG_LEVEL"}
    return {"logging_config": LoggingConfig(log_level="WARNING"), "worker_runtime_env": {"env_vars": env}}


@contextlib.contextmanager
def quiet_driver(enabled: bool = True):
    """Within it, this process's Ray Data banners and Ray's INFO lines are off; they are as they were after it (a
    training script's own settings and logging stay its own)."""
    import logging

    import ray.data

    if not enabled:
        yield
        return
    context = ray.data.DataContext.get_current()
    saved_context = (context.enable_progress_bars, context.print_on_execution_start)
    levels = {"ray.data": logging.WARNING, "ray.train": logging.WARNING, "ray.tune": logging.WARNING,
              PROGRESS_NOTICE_LOGGER: logging.ERROR, **{name: logging.CRITICAL for name in DATA_TASK_ERROR_LOGGERS}}
    saved_levels = {name: logging.getLogger(name).level for name in levels}
    quiet_data_context()
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    unfilter = filter_worker_notices()
    try:
        yield
    finally:
        unfilter()
        context.enable_progress_bars, context.print_on_execution_start = saved_context
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)


def filter_worker_notices() -> Callable[[], None]:
    """Leave out of the workers' output that this driver prints the start-up lines that need no action (see
    `_NOTICE_LINES`); the workers' log files keep them. Returns the undo. Ray must be up; without Ray's printing
    handler (`log_to_driver=False`, or a Ray whose internals moved) nothing changes."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # pragma: no cover - a Ray that moved it
        return lambda: None
    with dispatcher._lock:
        handlers = list(dispatcher.handlers)
        index = next((i for i, (name, _) in enumerate(handlers) if name == "ray_print_logs"), None)
        if index is None:
            return lambda: None
        name, original = handlers[index]
        keep = WorkerLines()

        def print_but_notices(data):
            lines = keep((data.get("ip"), data.get("pid")), data.get("lines", ()))
            if lines:
                original({**data, "lines": lines})

        handlers[index] = (name, print_but_notices)
        dispatcher.handlers = handlers

    def undo() -> None:
        with dispatcher._lock:
            dispatcher.handlers = [(n, original if h is print_but_notices else h) for n, h in dispatcher.handlers]

    return undo


class WorkerLines:
    """Which of a worker's output lines a quiet driver prints: not the start-up notices (`_NOTICE_LINES`), and of a
    worker the JAX coordination service ends because a peer died, only the line that says so."""

    def __init__(self):
        self._ending: set = set()  # workers (node ip, pid: pids repeat across nodes) that printed the ending line

    def __call__(self, worker, lines) -> list:
        kept = []
        for line in lines:
            if worker in self._ending or _NOTICE_LINES.search(line) or _PEER_DIED_BEFORE.search(line):
                continue
            if _PEER_DIED.search(line):
                self._ending.add(worker)
            kept.append(line)
        return kept


def every_worker_line() -> Callable[[], None]:
    """Turn off Ray's log deduplication in this driver (returns the undo): it folds lines that differ only in their
    numbers, so of trials that log at the same steps one trial's progress showed and the others' read "[repeated
    3x across cluster]" (a review of a Tune search)."""
    try:
        from ray._private import ray_logging
    except ImportError:  # pragma: no cover - a Ray that moved it
        return lambda: None
    if not hasattr(ray_logging, "RAY_DEDUP_LOGS"):  # pragma: no cover
        return lambda: None
    kept, ray_logging.RAY_DEDUP_LOGS = ray_logging.RAY_DEDUP_LOGS, False

    def undo() -> None:
        ray_logging.RAY_DEDUP_LOGS = kept

    return undo
