"""JaxTrainer: Ray Train V2's DataParallelTrainer with a real jax.distributed backend on every platform."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import math
import numbers
import os
import time
import uuid
from typing import Any, Callable, Dict, Optional, Union

import ray
from ray.train import DataConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.execution.callback import (ControllerCallback, ReportCallback, TrainContextCallback,
                                                       WorkerGroupCallback)
from ray.train.v2.api.config import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from ray_jax_train.allocator import with_worker_allocator
from ray_jax_train.backend import JaxConfig, place_compilation_cache, resolve_jax_config
from ray_jax_train.data_config import JaxDataConfig

logger = logging.getLogger(__name__)


def check_train_loop(fn: Callable) -> None:
    """Fail on the driver, not in N workers, when the loop cannot be called as fn() or fn(config)."""
    if not callable(fn):
        raise TypeError(f"train_loop_per_worker must be a function, got {type(fn).__name__}.")
    if inspect.isclass(fn):  # Ray would call it, make an instance in every worker, and train nothing
        raise TypeError(f"train_loop_per_worker is the class {fn.__qualname__}; calling it only builds an instance. "
                        f"Pass a function, or an instance whose __call__ runs the loop ({fn.__qualname__}(...)).")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in positional and p.default is inspect.Parameter.empty
    ]
    if len(required) > 1:
        raise ValueError(
            f"train_loop_per_worker {getattr(fn, '__name__', fn)!r} takes {len(required)} required arguments "
            f"{required}; it must take none or one (the train_loop_config dict). Put everything else in "
            "train_loop_config, or give the extra arguments defaults / bind them with functools.partial."
        )
    keyword_only = [p.name for p in inspect.signature(fn).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty]
    if keyword_only:
        raise ValueError(
            f"train_loop_per_worker {getattr(fn, '__name__', fn)!r} has required keyword-only arguments "
            f"{keyword_only}, which Ray never passes (it calls fn() or fn(config)). Give them defaults, bind them "
            "with functools.partial, or read them from train_loop_config."
        )


def check_datasets(datasets: Optional[Dict[str, Any]]) -> None:
    """Fail on the driver, not in every worker (as "'numpy.ndarray' object has no attribute 'name'"), when a
    dataset is not a Ray Dataset (or a function that makes one)."""
    import ray.data

    if datasets is None:
        return
    if not isinstance(datasets, dict):
        raise TypeError(f"datasets must be a dict of name -> ray.data.Dataset, got {type(datasets).__name__}; "
                        "e.g. datasets={'train': ds}.")
    for name, dataset in datasets.items():
        if not isinstance(dataset, ray.data.Dataset) and not callable(dataset):
            raise TypeError(
                f"datasets[{name!r}] is a {type(dataset).__name__}, not a ray.data.Dataset. Make one first: "
                "ray.data.from_numpy(array), ray.data.from_items(rows), ray.data.from_pandas(df), or "
                "ray.data.read_parquet(path) and the like.")


def check_run_settings(train_loop_config, scaling_config, run_config):
    """The run's settings of the wrong kind, said by argument with the fix; `run_config` with a relative local
    storage_path made absolute. Before, a dict for a config failed deep in Ray ("'dict' object has no attribute
    'use_tpu'"), and a storage problem in Ray's controller, as a traceback naming neither (a Python API review)."""
    from ray_jax_train import storage

    if train_loop_config is not None and not isinstance(train_loop_config, dict):
        raise TypeError(f"train_loop_config must be a dict (the loop gets it as its argument), got a "
                        f"{type(train_loop_config).__name__}; e.g. train_loop_config={{'lr': 1e-3}}")
    if not isinstance(scaling_config, ScalingConfig):
        raise TypeError(f"scaling_config must be a ray.train.ScalingConfig, got a {type(scaling_config).__name__}; "
                        "e.g. ScalingConfig(num_workers=2)")
    for name, amount in (scaling_config.resources_per_worker or {}).items():
        # Ray takes any number here, and a negative one then fails every worker group's placement, retried
        if isinstance(amount, bool) or not isinstance(amount, numbers.Real) or not amount >= 0:
            raise ValueError(f"ScalingConfig(resources_per_worker={scaling_config.resources_per_worker}): {name!r} "
                             f"must be a number of at least 0, got {amount!r}; e.g. {{'CPU': 1}}")
    if run_config is None:
        return None
    if not isinstance(run_config, RunConfig):
        kind = type(run_config)
        raise TypeError(f"run_config must be a ray.train.RunConfig, got a {kind.__module__}.{kind.__qualname__}; "
                        "e.g. RunConfig(name='my-run', storage_path='/shared/runs') (Ray Train V2's, not "
                        "ray.air's or ray.tune's)")
    where = run_config.storage_path
    if where is None or getattr(run_config, "storage_filesystem", None) is not None:
        return run_config
    where = os.fspath(where)
    fix = "give an absolute directory every node sees, or a URI (s3://, gs://, file://)"
    if storage.is_uri(where):
        if where.startswith("file://"):  # parsed here; a bucket's would ask the network
            try:
                storage.filesystem(where)
            except ValueError as exc:
                raise ValueError(f"RunConfig(storage_path=...): {exc}") from None
        return run_config
    if os.path.isfile(os.path.expanduser(where)):
        raise ValueError(f"RunConfig(storage_path={where!r}) is a file, not a directory; {fix}")
    if storage.absolute(where) != where:  # Ray's controller read a relative path as a URI without a scheme
        run_config = dataclasses.replace(run_config, storage_path=storage.absolute(where))
    return run_config


class JaxTrainer(DataParallelTrainer):
    """Runs `train_loop_per_worker` on N workers that form one `jax.distributed` job.

    A drop-in superset of `ray.train.v2.jax.JaxTrainer`: same arguments, but CPU workers are connected too
    (gloo collectives), GPU workers each see only their own GPUs, `scaling_config` may be omitted (one
    worker), and `jax_config` adds CPU device counts, a mesh, and JAX/XLA settings for the workers.
    """

    def __init__(
        self,
        train_loop_per_worker: Union[Callable[[], Any], Callable[[Dict], Any]],
        *,
        train_loop_config: Optional[Dict] = None,
        jax_config: Optional[JaxConfig] = None,
        scaling_config: Optional[ScalingConfig] = None,
        dataset_config: Optional[DataConfig] = None,
        run_config: Optional[RunConfig] = None,
        datasets: Optional[Dict[str, Any]] = None,
        validation_config=None,
    ):
        check_train_loop(train_loop_per_worker)
        check_datasets(datasets)
        if isinstance(dataset_config, JaxDataConfig):
            dataset_config.check_names(datasets)
        scaling_config = scaling_config or ScalingConfig(num_workers=1)
        run_config = check_run_settings(train_loop_config, scaling_config, run_config)
        jax_config = _as_our_jax_config(jax_config)
        problem = run_name_problem(getattr(run_config, "name", None))
        if problem:
            raise ValueError(f"RunConfig(name=...): {problem}")
        from ray_jax_train.retries import retries_without_progress_limit

        retries_without_progress_limit()  # a bad setting is named here, not at fit()
        jax_config = resolve_jax_config(jax_config, scaling_config, run_config)
        if scaling_config.num_workers != 0:
            run_config = with_worker_allocator(jax_config, run_config)
        if scaling_config.num_workers == 0:
            logger.warning(
                "ScalingConfig(num_workers=0) is Ray's local mode: the loop runs in this process and fit() starts "
                "no Ray, so JaxConfig's worker settings (jax.distributed, num_cpu_devices, XLA flags and env vars, "
                "mesh) are not applied; get_mesh() spans this process's devices."
            )
        super().__init__(
            train_loop_per_worker=train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=jax_config,
            scaling_config=scaling_config,
            dataset_config=dataset_config,
            run_config=run_config,
            datasets=datasets,
            validation_config=validation_config,
        )
        place_compilation_cache(self.backend_config, self.run_config)

    @property
    def jax_config(self) -> JaxConfig:
        return self.backend_config

    def fit(self):
        """Ray's `fit`; Ctrl-C raises KeyboardInterrupt once Ray has aborted the run, as in any Python program.

        Ray's own SIGINT handler aborts the run and then ends in `sys.exit(0)` (the process exits 1) or in the
        controller's death, so a script or the CLI could not tell an interrupt from a failure."""
        if self.scaling_config.num_workers != 0:  # local mode runs in this process and needs no Ray of ours
            ensure_ray_leaves_cpu_for_data(self.scaling_config, _needs_data_tasks(self.datasets))
        set_aside_a_broken_checkpoint_snapshot(self.run_config)
        self._interrupted = False
        self._controller = None
        with _sigint_handler_restored():
            try:
                with _fast_report_polling(), _cleaner_finds_the_dashboard(), _no_watcher_where_nothing_drains():
                    result = super().fit()
            except KeyboardInterrupt:
                if not self._interrupted:  # raised past Ray's SIGINT handler (a timer's handler, say): the run
                    self._abort(self._controller)  # trained on to its end in the background, its actors held
                raise
            except (Exception, SystemExit) as exc:
                if self._interrupted:
                    raise KeyboardInterrupt("training interrupted (SIGINT); Ray aborted the run") from exc
                raise
            finally:
                controller, self._controller = self._controller, None
        if self._interrupted:
            raise KeyboardInterrupt("training interrupted (SIGINT); Ray aborted the run")
        return _with_latest_metrics(result, controller)

    @staticmethod
    def _abort(controller, at_once: bool = False) -> None:
        """Abort the run; after RAY_JAX_TRAIN_ABORT_WAIT_S (60 s), or `at_once`, end its controller instead (its
        workers and placement group go with it): one busy placing workers that do not fit never takes an abort up."""
        if controller is None:
            return
        if not at_once:
            wait_s = float(os.environ.get("RAY_JAX_TRAIN_ABORT_WAIT_S", "60"))
            try:
                ray.get(controller.abort.remote(), timeout=wait_s)
                return
            except ray.exceptions.RayActorError:  # the abort ends the controller: done
                return
            except ray.exceptions.GetTimeoutError:
                logger.warning("The run did not stop within %g s (its workers may be waiting to be placed): "
                               "ending its controller.", wait_s)
        try:
            ray.kill(controller, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - gone already
            logger.debug("Could not end the run's controller: %s", exc)

    def _register_sigint_handler(self, controller):
        """Ctrl-C aborts the run, as Ray's handler does, but not for ever: a controller busy placing workers that
        do not fit never took the abort up (8 minutes, until a third Ctrl-C ended the process with sys.exit: a
        Python API review). A second Ctrl-C ends the controller at once; fit() raises KeyboardInterrupt."""
        import signal

        self._controller = controller  # held past run() so fit() can ask it for the latest report
        presses = 0

        def abort(signum, frame):
            nonlocal presses
            presses += 1
            self._interrupted = True
            if presses == 1:
                logger.warning("Interrupted: aborting the run (a second Ctrl-C ends it at once).")
            self._abort(controller, at_once=presses > 1)

        signal.signal(signal.SIGINT, abort)

    def _get_train_func(self):
        from ray_jax_train.retries import marking_repeated_errors

        return marking_repeated_errors(super()._get_train_func())

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        from ray_jax_train.retries import RetriesSkipRepeatedErrors, retries_without_progress_limit

        controller_init_kwargs["failure_policy"] = RetriesSkipRepeatedErrors(
            self.run_config.failure_config, retries_without_progress_limit())
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _create_default_callbacks(self):
        from ray_jax_train.retries import CountsReports

        callbacks = _without_idle_dataset_manager(super()._create_default_callbacks(), self.train_run_context,
                                                  self.datasets)
        return _without_blind_cleaner(callbacks) + [
            AbortIsNoPreemption(), LatestMetrics(), CountsReports(), ReportBarrierMarks(), SaysWhyItWaits(),
            ToleratesRemovedCheckpoints(), ExitsEvenIfRayHangsAtExit()]


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def run_name_problem(name: Optional[str]) -> Optional[str]:
    """Why Ray Train cannot run under `name`, if it cannot: its controller tags its metrics with the run name, and
    those take ASCII only. A name with an 'ä' failed every attempt with a stack trace per metric (an upgrade
    review), after the driver had prepared the data."""
    if name is None or name.isascii():
        return None
    return (f"{name!r} has characters other than ASCII, and Ray Train tags its metrics with the run name, which "
            "must be ASCII; use ASCII letters, digits, '-', '_' or '.' (the storage path may be any)")


@contextlib.contextmanager
def _sigint_handler_restored():
    """The SIGINT handler as it was before fit(): Ray's (which aborts the run, then calls sys.exit(0) at its third
    Ctrl-C) stayed installed after fit() returned, so in a notebook the next Ctrl-C interrupted nothing and the ones
    after raised SystemExit (a notebook review)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # Ray installs none off the main thread
        return
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if previous is not None:  # None: installed outside Python, which cannot be put back
            signal.signal(signal.SIGINT, previous)


def set_aside_a_broken_checkpoint_snapshot(run_config) -> Optional[str]:
    """Ray refuses to start a run whose record of its checkpoints names one that is gone (deleted by hand, a copy
    cut short) or does not parse, and advises a new name or deleting the folder: the good checkpoints with it (a
    chaos review). The record is set aside instead (renamed, not deleted) and the run resumes from the newest
    complete checkpoint left, which the built-in loop's checkpointer adopts; its path is returned."""
    from ray_jax_train import storage

    name, root = getattr(run_config, "name", None), getattr(run_config, "storage_path", None)
    if not name or not root or getattr(run_config, "storage_filesystem", None) is not None:
        return None
    snapshot = storage.join(root, name, RAY_SNAPSHOT)
    try:
        text = storage.read_text(snapshot)
    except OSError:  # none yet (a new run), or storage out of reach: Ray's start says so
        return None
    try:
        names = [r["checkpoint_dir_name"] for r in json.loads(text).get("checkpoint_results", [])]
        gone = [n for n in names if not storage.exists(storage.join(root, name, n))]
        problem = f"names {', '.join(gone)}, which {'is' if len(gone) == 1 else 'are'} gone" if gone else None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        problem = f"cannot be read ({exc})"
    except OSError:
        return None  # storage out of reach: Ray's start says so
    if problem is None:
        return None
    # Joined, not appended: a URI's query (an S3 endpoint_override) stays at its end, or the move went nowhere.
    aside = storage.join(root, name, f"{RAY_SNAPSHOT}.broken-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    fs, path = storage.filesystem(snapshot)
    try:
        fs.move(path, storage.filesystem(aside)[1])
    except OSError as exc:  # read-only storage, say: Ray's own refusal follows
        logger.warning("Ray's record of the checkpoints of run %r (%s) %s, and could not be set aside: %s", name,
                       snapshot, problem, exc)
        return None
    logger.warning("Ray's record of the checkpoints of run %r (%s) %s; Ray would refuse to start the run. It is set "
                   "aside as %s. A loop that restores through JaxCheckpointer (the built-in one does) resumes from the "
                   "newest complete checkpoint left in the run's directory; Ray itself offers none now.", name,
                   snapshot, problem, aside)
    return aside


class SaysWhyItWaits(ControllerCallback):
    """A worker group Ray cannot place (a node lost, another job holding the resources) is retried every
    RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s) without end and without a word of ours: the run looked hung, or
    crashed, to whoever watched its log (an ops review). Each failed placement now says what it waits for."""

    def __init__(self):
        self._scaling = None
        self._waits = 0

    def after_controller_start(self, train_run_context) -> None:
        self._scaling = getattr(train_run_context, "scaling_config", None)
        logging_config = getattr(getattr(train_run_context, "run_config", None), "logging_config", None)
        level = logging.getLevelName(str(getattr(logging_config, "log_level", "INFO")).upper())
        if isinstance(level, int) and level >= logging.WARNING:  # a quiet run (the CLI's): our line, not Ray's pages
            for name in _CONTROLLER_LOGGERS:
                logging.getLogger(name).addFilter(_worth_a_quiet_log)

    def after_controller_state_update(self, previous_state, current_state) -> None:
        from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

        error = getattr(current_state, "training_failed_error", None)
        if not isinstance(getattr(error, "controller_failure", None), WorkerGroupStartupTimeoutError):
            self._waits = 0 if type(current_state).__name__ == "RunningState" else self._waits
            return
        self._waits += 1
        logger.warning("ray-jax-train: %s", waiting_message(self._scaling, self._waits))


# Seconds a controller process may spend in its exit once Python is done (Ray's own C++ exit handlers, ~2 s) before
# SIGALRM ends it: Ray 2.60's core worker can deadlock there, and the process then outlives its run and its cluster.
EXIT_DEADLINE_S = ("RAY_JAX_TRAIN_EXIT_DEADLINE_S", "20")


def exit_within_a_deadline() -> None:
    """Make this process's exit end within RAY_JAX_TRAIN_EXIT_DEADLINE_S (20 s) of Python's atexit handlers.

    Ray 2.60's core worker destructor (a C exit handler, run after Python's) can deadlock on its own io_context's
    mutex: `~CoreWorkerProcessImpl` -> `scheduler::shutdown` destroys a queued publish whose `~Publisher` answers a
    pending long poll by posting to that same scheduler (gdb on a leaked ray::TrainController: main thread in
    `post_immediate_completion` under `__run_exit_handlers`, its log ending in "Destructing CoreWorkerProcessImpl").
    Its raylet-death check runs on the io_context already stopped, so the process stayed for good, after its driver
    and its cluster were gone (one per full test suite). An alarm set here, with SIGALRM's default action, ends such
    a process; one that exits normally is gone before it rings, with its own exit status."""
    import atexit
    import signal

    def arm():
        deadline = float(os.environ.get(*EXIT_DEADLINE_S))
        if deadline > 0:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # terminate: no Python handler can run after finalization
            signal.alarm(max(1, math.ceil(deadline)))

    atexit.register(arm)


class ExitsEvenIfRayHangsAtExit(ControllerCallback):
    """The controller's process (where this callback runs) ends within a deadline once it exits: see
    `exit_within_a_deadline`. A leaked ray::TrainController, its raylet and driver long gone, was found after test
    suites; a notebook's, a Ctrl-C'd CLI's or a stopped Tune trial's run would leak one the same way."""

    def after_controller_start(self, train_run_context) -> None:
        try:  # an actor's process only: local mode (num_workers=0) runs its controller in the user's own process
            in_an_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
        except Exception:  # noqa: BLE001 - no runtime context: not an actor
            in_an_actor = False
        if in_an_actor:
            exit_within_a_deadline()


class ToleratesRemovedCheckpoints(ControllerCallback):
    """A checkpoint directory removed by hand mid-run (to free disk, say) ended the run at Ray's next retention step:
    Ray's checkpoint manager deletes the checkpoints past num_to_keep through `delete_fs_path`, which raises
    FileNotFoundError for a path already gone, in the controller, where FailureConfig retries nothing (a
    failure-injection review). Nothing is lost by skipping that deletion: Ray has already dropped the checkpoint
    from its record, and the workers' restores fall back past a missing one."""

    def after_controller_start(self, train_run_context) -> None:
        try:
            from ray.train.v2._internal.execution.checkpoint import checkpoint_manager
        except ImportError:  # another Ray layout: its own behaviour stands
            return
        delete = checkpoint_manager.delete_fs_path
        if getattr(delete, "_tolerates_removed", False):
            return

        def delete_unless_gone(fs, fs_path):
            try:
                delete(fs, fs_path)
            except FileNotFoundError:
                logger.warning("ray-jax-train: checkpoint %s was removed outside the run before Ray's retention "
                               "(num_to_keep) came to delete it; nothing left to delete, training goes on.", fs_path)

        delete_unless_gone._tolerates_removed = True
        checkpoint_manager.delete_fs_path = delete_unless_gone


# Ray's controller logs each failed placement with its whole traceback, twice (the control loop, the failure policy);
# and a stopped Tune trial's dead report queue, once.
_CONTROLLER_LOGGERS = ("ray.train.v2._internal.execution.controller.controller",
                                "ray.train.v2._internal.execution.failure_handling.default")


def _worth_a_quiet_log(record: logging.LogRecord) -> bool:
    """False for Ray's pages that a quiet run's log replaces or needs not: a failed placement (our line says it),
    and a Tune trial stopped by its scheduler, whose report queue dies with its placement group (the search's
    summary says it was stopped; 40 lines of traceback in a search that went well read as a crash: an ops review)."""
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
        text += f" {record.exc_info[1]}"
    stopped_trial = "_QueueActor" in text and "placement group was removed" in text
    return "worker group startup timed out" not in text and not stopped_trial


def waiting_message(scaling, waits: int) -> str:
    """What a run waits for when Ray cannot place its workers, against what the cluster has free now."""
    per_worker = dict(scaling.resources_per_worker or {}) if scaling is not None else {}
    if scaling is not None and not per_worker:
        per_worker = {"GPU": 1} if scaling.use_gpu else {"CPU": 1}
    workers = getattr(scaling, "num_workers", "?")
    try:
        free = {k: round(v, 2) for k, v in sorted(ray.available_resources().items())
                if k in per_worker or k == "CPU"}
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    except Exception:  # noqa: BLE001 - the note only: Ray's own state may be out of reach
        free, alive = {}, "?"
    every = float(os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", 60))
    return (f"the workers cannot be placed ({waits} attempt(s), one every {every:g} s): {workers} x {per_worker} "
            f"needed, and the cluster's {alive} live node(s) have {free} free now. A lost node, or another job holding "
            "them? Ray keeps trying until they are free (a node comes back, the autoscaler adds one, the other job "
            "ends); stop the run (Ctrl-C, ray job stop) to give up: it resumes from its latest checkpoint when run "
            "again.")


class LatestMetrics(ReportCallback):
    """Keeps the latest report's metrics (rank 0's) in the controller.

    Ray V2 fills `Result.metrics` from the latest *checkpoint* only, so a run that reports without checkpoints
    returns None and one that checkpoints now and then returns stale metrics, though `Result`'s docstring (and
    Ray Train V1, and TorchTrainer users' code) means the latest report."""

    def __init__(self):
        self.metrics = None
        self.with_checkpoint = False

    def after_report(self, training_report, metrics) -> None:
        self.metrics = dict(metrics[0]) if metrics else None
        self.with_checkpoint = getattr(training_report, "checkpoint", None) is not None


def _latest_metrics_in(controller) -> Optional[Dict[str, Any]]:
    """Runs inside the controller actor (`__ray_call__`): the latest report's metrics, or None where Ray's own
    are the latest report's already (it came with a checkpoint: Ray's copy also holds what validation added)."""
    for callback in getattr(controller, "_callbacks", []):
        if isinstance(callback, LatestMetrics):
            return None if callback.with_checkpoint else callback.metrics
    return None


def _with_latest_metrics(result, controller):
    """`result` with `metrics` set to the latest report's, when the controller can still say what that was."""
    if controller is None:  # fit() off the main thread (a Tune trial): Ray registered no handler, so no handle
        return result
    try:
        latest = ray.get(controller.__ray_call__.remote(_latest_metrics_in), timeout=30)
    except Exception as exc:  # noqa: BLE001 - the run itself finished: keep Ray's result rather than fail it
        logger.debug("could not read the latest report's metrics from the controller: %r", exc)
        return result
    if latest is not None:
        result.metrics = latest
    return result


class ReportBarrierMarks(TrainContextCallback):
    """Marks each worker as in Ray's report barrier while it waits there, in the jax.distributed key-value store: a
    worker at a checkpoint exchange that the other will not reach (a save on rank 0 only, while the others report)
    then fails at once, saying so, instead of both waiting for the exchange's timeout (10 minutes)."""

    @contextlib.contextmanager
    def on_checkpoint_sync(self):
        from ray_jax_train.checkpoint._sync import in_report_barrier

        with in_report_barrier():
            yield


class AbortIsNoPreemption(WorkerGroupCallback):
    """Ray aborts a run (Ctrl-C on the driver) by killing its workers; their checkpointer's SIGTERM handler would
    take that for a preemption, promise a checkpoint, and train on until the kill. Told first, they just exit."""

    def __init__(self):
        self._worker_group = None

    def after_worker_group_start(self, worker_group) -> None:
        self._worker_group = worker_group

    def after_worker_group_shutdown(self, worker_group_context) -> None:
        self._worker_group = None

    def before_worker_group_abort(self, worker_group_context) -> None:
        if self._worker_group is None:
            return
        from ray_jax_train.backend import _sigterm_is_shutdown

        try:
            ray.get(self._worker_group.execute_async(_sigterm_is_shutdown), timeout=5)
        except Exception:  # noqa: BLE001 - a dead or hung worker: Ray kills it anyway
            pass


def _as_our_jax_config(jax_config) -> Optional[JaxConfig]:
    """Ours as is; Ray's `ray.train.v2.jax.JaxConfig` (or a subclass) converted; anything else refused."""
    if jax_config is None or isinstance(jax_config, JaxConfig):
        return jax_config
    from ray.train.v2.jax import JaxConfig as RayJaxConfig

    if isinstance(jax_config, RayJaxConfig):
        # Ray's own JaxConfig carries only use_tpu/use_gpu: keep their meaning.
        return JaxConfig(use_tpu=jax_config.use_tpu, use_gpu=jax_config.use_gpu)
    raise TypeError(
        f"jax_config must be a ray_jax_train.JaxConfig (or Ray's ray.train.v2.jax.JaxConfig), got "
        f"{type(jax_config).__module__}.{type(jax_config).__qualname__}. Pass rjt.JaxConfig(...); another "
        "framework's backend config (e.g. TorchConfig) belongs to that framework's trainer."
    )


def _without_blind_cleaner(callbacks):
    """Leave out Ray Train's placement-group cleaner when Ray runs without its dashboard.

    The cleaner asks the dashboard's State API every second whether the controller is alive. Without a dashboard
    (`ray.init(include_dashboard=False)`, as in the quick start, the CLI and the tests) every query fails: it
    logs a warning each second, spends ~2% of a core, and can never clean anything up.
    """
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    if _dashboard_running():
        return callbacks
    return [c for c in callbacks if not isinstance(c, PlacementGroupCleanerCallback)]


class DatasetsCallbackWithoutIdleManager(DatasetsCallback):
    """Ray's datasets callback, except that a run given no datasets starts no DatasetManager actor.

    Ray Train starts one per worker group whatever the datasets: a process that imports Ray Data (~3 s of CPU at
    each start, a 2-core machine's second per fit) and is held through the run, only to answer "not found" to a
    loop that reads its data its own way. Such a run's workers get Ray's answer without the actor; the driver's
    DataContext still reaches them.
    """

    def before_init_train_context(self, workers):
        if self._datasets:
            return super().before_init_train_context(workers)
        return {"dataset_shard_provider": [NoDatasets()] * len(workers)}


class NoDatasets:
    """The dataset shard provider of a run given no datasets: what Ray's says then."""

    def get_dataset_shard(self, dataset_info):
        raise KeyError(f"Dataset shard for '{dataset_info.dataset_name}' not found. Please ensure that the dataset "
                       "is passed through the Trainer `datasets` argument.")


def _without_idle_dataset_manager(callbacks, train_run_context, datasets):
    """Ray's own datasets callback swapped for one that starts no actor for a run without datasets (a subclass
    of it, or someone's own, is left as it is)."""
    return [DatasetsCallbackWithoutIdleManager(train_run_context=train_run_context, datasets=datasets)
            if type(c) is DatasetsCallback else c for c in callbacks]


def _dashboard_running() -> bool:
    """Whether the cluster's dashboard registered itself. Asked of the cluster, not of this process: a Ray worker
    (a Tune trial) is told a dashboard address whether or not one runs. When unsure, keep Ray's default."""
    try:
        from ray._private.services import get_webui_url_from_internal_kv

        return bool(get_webui_url_from_internal_kv())
    except Exception:
        return True


PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def no_node_can_be_drained() -> bool:
    """Whether this process started the Ray it runs on (a local `ray.init()`, the CLI's `--address local`) and
    that Ray is one node: no autoscaler or cloud provider stands behind it, so no drain notice can come."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "head", False):  # joined a cluster someone else started (or a worker)
        return False
    try:
        return sum(1 for n in ray.nodes() if n.get("Alive")) == 1
    except Exception:  # noqa: BLE001 - unsure: keep Ray's default
        return False


@contextlib.contextmanager
def _no_watcher_where_nothing_drains():
    """Ray Train starts a preemption watcher actor per worker group, to pass on node drain notices: a process
    that imports Ray Train (~1.5 s of a CPU at every start) and then polls the GCS. A cluster this process
    started on its own machine is drained by nobody, so there the watcher is left out (Ray's own switch, which
    it propagates to the controller); a value the user set is left alone."""
    if not no_node_can_be_drained():
        yield
        return
    with env_unless_set(PREEMPTION_WATCHER, "0"):
        yield


@contextlib.contextmanager
def _fast_report_polling(interval_s: str = "0.1"):
    """Poll workers every 0.1 s instead of Ray's 2 s while this trainer runs.

    A worker's `ray.train.report` waits until the controller has collected its previous report (a queue of
    one), and the controller collects on each poll. At Ray's default 2 s, a loop that reports more often than
    every 2 s stalls in `report`: measured 2.0 s per call on 1 or 2 workers. Ray propagates this variable from
    the driver to its controller; a value the user set is left alone.
    """
    with env_unless_set("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", interval_s):
        yield


@contextlib.contextmanager
def _cleaner_finds_the_dashboard():
    """Name the cluster's dashboard to Train's placement-group cleaner while this trainer runs (`fit()` joined to a
    `ray start` cluster; a private Ray gets it from `with_named_dashboard`). With another Ray instance on the head
    machine, Ray's own address lookup refuses to pick one: the cleaner died with a traceback in every job, and a run
    that ended badly left its placement group holding the cluster's CPUs. Ray propagates the variable to the
    controller, whose actors (the cleaner) inherit it."""
    from ray.train.v2._internal import constants

    key = "RAY_API_SERVER_ADDRESS"
    url = None
    if not os.environ.get(key) and ray.is_initialized():  # an empty one names nothing either
        try:
            from ray._private.services import get_webui_url_from_internal_kv

            url = get_webui_url_from_internal_kv()
        except Exception:  # noqa: BLE001 - no dashboard, or not asked from here: Ray's default stands
            url = None
    if not url:
        yield
        return
    added, before = key not in constants.ENV_VARS_TO_PROPAGATE, os.environ.get(key)
    constants.ENV_VARS_TO_PROPAGATE.add(key)
    os.environ[key] = url if "://" in url else f"http://{url}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
        if added:
            constants.ENV_VARS_TO_PROPAGATE.discard(key)


@contextlib.contextmanager
def env_unless_set(key: str, value: str):
    """`key=value` in this process while the block runs, unless the user set `key` already."""
    if key in os.environ:
        yield
        return
    os.environ[key] = value
    try:
        yield
    finally:
        os.environ.pop(key, None)


def init_ray(*, num_cpus: Optional[int] = None, **kwargs) -> bool:
    """Start Ray as a training script wants it, on a laptop and on a cluster alike. Returns whether it joined a cluster.

    With `address=` or `RAY_ADDRESS` set (`ray job submit` sets it for its entrypoint) this joins that cluster, whose size is its
    own: Ray refuses `num_cpus` there, so a script that passed it would fail only once submitted. Otherwise a private
    local Ray starts (never another `ray start` on this machine by accident; a live one is named in a warning) with
    `num_cpus` logical CPUs, by default the cores and at least 4: oversubscribing one machine leaves Ray Data CPUs
    beside the training workers.
    Nothing happens if Ray is already initialised. Other keyword arguments go to `ray.init` either way.
    """
    import ray

    if ray.is_initialized():
        return False
    address = kwargs.pop("address", None) or os.environ.get("RAY_ADDRESS") or "local"
    if address != "local":
        ray.init(address=address, **kwargs)
        return True
    _warn_if_ray_start_cluster_runs(kwargs.get("_temp_dir"))
    _start_where_it_lasts(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1),
                          **with_import_guard(with_named_dashboard(kwargs)))
    _started_ray.add(ray.get_runtime_context().get_node_id())
    return False


# Ray's GCS keeps a record of every actor task, up to Ray's default of 100,000 (about 350 MB): the controller's
# 0.1 s status polls and the reports add about 20 a second, so a private Ray's GCS grew 4 MB a minute for 80 minutes
# (a review; capped at 2,000 it stayed flat). 10,000 keeps ~35 MB of recent task history for `ray list tasks`.
TASK_EVENTS_IN_GCS = ("RAY_task_events_max_num_task_in_gcs", "10000")


def _start_where_it_lasts(**init_kwargs) -> None:
    """`ray.init` of a private Ray, from a thread that lives as long as this process. Ray's node processes die with
    the thread that forked them (PR_SET_PDEATHSIG is per thread): a first fit() in a thread of the user's lost Ray
    when that thread ended, and the process a minute later (a notebook review)."""
    with env_unless_set(*TASK_EVENTS_IN_GCS):  # read by the GCS this starts
        _start_in_a_lasting_thread(**init_kwargs)


def _start_in_a_lasting_thread(**init_kwargs) -> None:
    import threading

    import ray

    if threading.current_thread() is threading.main_thread():
        ray.init(**init_kwargs)
        return
    started, failure = threading.Event(), []

    def keep():
        try:
            ray.init(**init_kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            failure.append(exc)
            return
        finally:
            started.set()
        threading.Event().wait()  # never set: the thread, and with it Ray's node processes, last until exit

    threading.Thread(target=keep, name="ray-jax-train-starts-ray", daemon=True).start()
    started.wait()
    if failure:
        raise failure[0]


def with_named_dashboard(init_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """`ray.init` keyword arguments for a private local Ray whose dashboard (if it starts one) is on a port of our
    choosing, named to the job's processes. Train's placement-group cleaner polls the state API, and with several
    Ray instances on one machine Ray's own address lookup refuses to pick one: the cleaner died with a traceback."""
    import importlib.util

    kwargs = dict(init_kwargs)
    if kwargs.get("include_dashboard") is False or not all(
            importlib.util.find_spec(m) is not None for m in ("aiohttp", "aiohttp_cors", "opencensus")):
        return kwargs
    if kwargs.get("dashboard_port") is None:
        kwargs["dashboard_port"] = _free_port()
    host = kwargs.get("dashboard_host")
    host = "127.0.0.1" if host in (None, "", "0.0.0.0", "localhost", "::") else host
    runtime_env = dict(kwargs.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.setdefault("RAY_API_SERVER_ADDRESS", f"http://{host}:{kwargs['dashboard_port']}")
    runtime_env["env_vars"] = env_vars
    kwargs["runtime_env"] = runtime_env
    return kwargs


def with_import_guard(init_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """`ray.init` keyword arguments whose workers each run `guard_cut_imports` first (a worker_process_setup_hook),
    unless the user gave a hook of their own. Ray's cancel of a task cut a worker's first import of fsspec, and
    every later Ray Data read on that worker failed (see _imports.py). Only for a Ray this package starts: a job's
    driver joining a cluster cannot add a hook without clashing with one the job was submitted with."""
    from ray_jax_train._imports import worker_setup_hook

    kwargs = dict(init_kwargs)
    runtime_env = dict(kwargs.get("runtime_env") or {})
    if "worker_process_setup_hook" not in runtime_env:
        runtime_env["worker_process_setup_hook"] = worker_setup_hook()
    kwargs["runtime_env"] = runtime_env
    return kwargs


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _running_ray_start_cluster(temp_dir: Optional[str] = None) -> Optional[str]:
    """The address of a live cluster that `ray start` recorded on this machine (the one `ray.init()` joins), or None."""
    import socket

    try:
        from ray._private.services import find_bootstrap_address

        address = find_bootstrap_address(temp_dir)
        host, _, port = (address or "").rpartition(":")
        if not host:
            return None
        # `ray stop` removes the record but a killed head leaves it behind: count it only if its GCS port answers
        # (a local connect, well under a millisecond; 0.2 s at worst).
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.2):
            return address
    except Exception:
        return None


def _warn_if_ray_start_cluster_runs(temp_dir: Optional[str] = None) -> Optional[str]:
    """Before starting a private Ray: say so once if a `ray start` cluster runs here, which it leaves unused."""
    address = _running_ray_start_cluster(temp_dir)
    if address:
        logger.warning(
            "Starting a private local Ray, although a Ray cluster started with `ray start` is running on this "
            "machine at %s. To train on that cluster instead, set RAY_ADDRESS=auto (or RAY_ADDRESS=%s), or call "
            "ray.init() before fit().", address, address,
        )
    return address


def worker_cpus(scaling_config) -> float:
    # Ray's own count: 1 by default, 0 for use_gpu or use_tpu without resources_per_worker (ray/air/config.py).
    return float(scaling_config.num_cpus_per_worker)


def _needs_data_tasks(datasets) -> bool:
    """Whether feeding `datasets` runs Ray Data tasks (which need CPUs): a materialized dataset (`from_items`,
    `.materialize()`) is read straight from the object store, and Ray's own trainer runs beside it on full CPUs."""
    from ray.data.dataset import MaterializedDataset

    return any(not isinstance(ds, MaterializedDataset) for ds in (datasets or {}).values())


_started_ray = set()  # the head node of each private Ray that fit() started in this process (no autoscaler there)


def _check_the_private_ray_has(scaling_config, num_workers: int) -> None:
    """Worker resources the Ray that fit() started on this machine lacks (a GPU here, a lower-case 'cpu', more of
    them than it has): no autoscaler will add them, and Ray retried placing the workers every minute for ever (a
    Python API review)."""
    import ray

    have = ray.cluster_resources()
    want = {k: float(v) * num_workers for k, v in scaling_config._resources_per_worker_not_none.items()
            if float(v) > 0}
    short = {k: v for k, v in want.items() if have.get(k, 0.0) < v}
    if not short:
        return
    hints = [f"did you mean {k!r} for {key!r}? " for key in short for k in have if k.lower() == key.lower()]
    shown = ", ".join(f"{k} {v:g}" for k, v in sorted(have.items()) if not k.startswith(("node:", "memory",
                                                                                             "object_store")))
    raise ValueError(
        f"ScalingConfig asks its {num_workers} worker(s) for {short} in all, and the Ray that fit() started on this machine has "
        f"{'less' if any(k in have for k in short) else 'none'} ({shown}): no node will ever join it, so the workers "
        f"would wait for ever. {''.join(hints)}Ask for what this machine has (use_gpu=False on a machine without "
        "GPUs), or join a cluster that has it: rjt.init_ray(address=...) or RAY_ADDRESS before fit().")


def ensure_ray_leaves_cpu_for_data(scaling_config, has_datasets: bool) -> None:
    """Avoid the silent deadlock where the workers hold every CPU and Ray Data can never run a read task.

    Starting Ray ourselves (a local run) we oversubscribe logical CPUs, which is harmless on one machine.
    On an existing cluster we say so up front instead of hanging.
    """
    import os

    import ray

    num_workers = scaling_config.num_workers if isinstance(scaling_config.num_workers, int) else 1
    needed = num_workers * worker_cpus(scaling_config)
    just_started = not ray.is_initialized()
    if just_started:
        init_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(needed) + 2))
    if _started_ray and ray.get_runtime_context().get_node_id() in _started_ray:
        _check_the_private_ray_has(scaling_config, num_workers)
        if just_started:  # sized for these workers and Ray Data beside them
            return
    if needed <= 0 or not has_datasets or os.environ.get("RAY_JAX_TRAIN_SKIP_CPU_CHECK") == "1":
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    if total < needed:
        # The workers do not fit yet: Ray waits for them (an autoscaler may add nodes), so the case of workers
        # that fit but leave Ray Data nothing cannot be told from here.
        logger.warning("The %d training workers need %g CPUs but the cluster has %g now; they wait until Ray "
                       "finds them.", num_workers, needed, total)
        return
    if total - needed < 1:
        raise ValueError(
            f"The {num_workers} training workers reserve {needed:g} CPUs, all {total:g} of the cluster's, so Ray "
            "Data would have no CPU to read the datasets and training would hang. Give Ray more (logical) CPUs, "
            "e.g. rjt.init_ray() or ray.init(num_cpus=...) before the first Ray Data call (making a dataset "
            "starts Ray with one logical CPU per core), or `ray start --num-cpus ...`; or fewer CPUs per worker with "
            "ScalingConfig(resources_per_worker={'CPU': ...}); or pass datasets that need no reading any more "
            "(ds.materialize(), if they fit in the object store). Set RAY_JAX_TRAIN_SKIP_CPU_CHECK=1 if an "
            "autoscaler will add nodes."
        )
