"""FailureConfig's retries are for lost workers and storage that was out of reach. An error that the same code,
data and checkpoint raise again on every attempt (a checkpoint of another model, a loss gone NaN, a row that
cannot be read) ends the run at once: retried, it restarted the worker group `max_failures` times, and forever
with `max_failures=-1`.

Attempts that make no progress end the run after RAY_JAX_TRAIN_RETRIES_WITHOUT_PROGRESS (5) of them in a row,
whatever `max_failures` allows: each such attempt starts where the last one did, so with `max_failures=-1` the run
looped for good, and Ray's memory monitor kills look like lost workers. An attempt made progress if it reported a
checkpoint or a "step" past the furthest one reported before it, or, for a loop whose reports carry no "step", if
it reported at all (a "step" counted from 0 each epoch still progresses through its checkpoints). So attempts
that die before their first report (a worker killed for memory at its first step, a node that cannot start the
backend) count, and so do attempts that resume, report again the step they resumed at (as the
built-in loop does, resumed at its end), and fail there again: a final model that could not be written restarted
the run without end.

An exception class says it is such an error with the class attribute `retry_repeats_it = True`; the library's own
(CheckpointMismatchError, RestoreTargetError, NonFiniteLossError, NoLossTokensError, TextDataError, the data
path's DataError and IteratorsOutOfStepError, and UsageError: a mesh, rule, state or argument of a call into the
library that cannot work as written) do, and a
custom loop's exceptions may too; so does a permission error (EACCES, EPERM, EROFS: storage the run may not write in). The worker marks the error it raises when such an error is in its chain (as the
`from` cause of another, say): the chain does not survive the trip to the controller, the mark does.
"""
from __future__ import annotations

import errno
import logging
import os
import sys
from typing import Iterator

from ray.train.v2._internal.execution.callback import ReportCallback
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
from ray.train.v2._internal.execution.failure_handling.default import _is_preemption_failure
from ray.train.v2.api.exceptions import WorkerGroupError

logger = logging.getLogger(__name__)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it wraps: Python's chain, and a Ray task error's `cause` (the user's exception)."""
    seen = set()
    stack = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        stack.extend([getattr(error, "cause", None), error.__cause__, error.__context__,
                      *(getattr(error, "worker_failures", None) or {}).values()])


# Storage the run may not write in: a retry writes there again. With max_failures=-1 an unwritable run directory
# restarted the workers 29 times in 150 s, without end (a failure-injection review).
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def repeats_on_retry(exc: BaseException) -> bool:
    """Whether `exc`, an error in its chain, or a worker's error inside a failed run is one a retry repeats."""
    return any(getattr(error, "retry_repeats_it", False) is True
               or (isinstance(error, OSError) and error.errno in _UNWRITABLE) for error in _causes(exc))


def marking_repeated_errors(train_func):
    """`train_func` (a worker's loop), marking an error it raises that a retry would repeat."""
    import functools

    @functools.wraps(train_func)
    def run(*args, **kwargs):
        try:
            return train_func(*args, **kwargs)
        except BaseException as exc:
            saving = sys.modules.get("ray_jax_train.checkpoint.core")  # not imported: nothing saved here
            if saving is not None and not isinstance(exc, KeyboardInterrupt):
                saving.finish_saves_in_flight()
            if repeats_on_retry(exc):
                try:
                    exc.retry_repeats_it = True  # pickled with the error, which its chain is not
                except AttributeError:  # an exception class with __slots__: its own class may still say so
                    pass
            raise

    return run


# Reports the controller has received, those of them with a "step", the furthest step they gave, and those with a
# checkpoint. Ray hands the
# policy and the callbacks to the controller actor as separate arguments, so they share these (one controller per
# process), not a reference.
_reports_seen = 0
_reports_with_step = 0
_furthest_step = float("-inf")
_checkpoints_seen = 0

RETRIES_WITHOUT_PROGRESS = "RAY_JAX_TRAIN_RETRIES_WITHOUT_PROGRESS"


def retries_without_progress_limit() -> int:
    """Read on the driver (the controller does not get its environment): 0 turns the rule off."""
    value = os.environ.get(RETRIES_WITHOUT_PROGRESS, "5")
    try:
        limit = int(value)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{RETRIES_WITHOUT_PROGRESS}={value!r}: give a whole number of attempts, 0 or more "
                         "(0: retry as FailureConfig allows, however many attempts end before their first report)")
    return limit


NOT_RETRIED = "Stopped retrying: "


def _explain(error: WorkerGroupError, why: str) -> None:
    """`why` at the head of the error's message: the error reaches fit()'s caller through its __reduce__, which
    keeps the message and the workers' errors only (a note was lost on the way)."""
    message = getattr(error, "_error_message", None)
    if isinstance(message, str):
        error._error_message = f"{why}\n{message}"
        error.args = tuple(str(arg).replace(message, error._error_message, 1) for arg in error.args[:1])


def why_not_retried(exc: BaseException) -> str:
    """The reason this policy gave for ending the run without a retry, if it gave one ('' otherwise)."""
    for error in _causes(exc):
        message = getattr(error, "_error_message", None)
        if isinstance(message, str) and message.startswith(NOT_RETRIED):
            return message.splitlines()[0]
    return ""


class CountsReports(ReportCallback):
    """Counts reports, their steps and checkpoints in the controller: what tells an attempt's progress."""

    def after_report(self, training_report, metrics) -> None:
        global _reports_seen, _reports_with_step, _furthest_step, _checkpoints_seen
        _reports_seen += 1
        if getattr(training_report, "checkpoint", None) is not None:
            _checkpoints_seen += 1
        steps = [m["step"] for m in metrics or () if isinstance(m, dict) and _is_number(m.get("step"))]
        if steps:
            _reports_with_step += 1
            _furthest_step = max(_furthest_step, *steps)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN is no step


class RetriesSkipRepeatedErrors(DefaultFailurePolicy):
    """Ray's policy, except that a worker group error a retry would repeat is raised at once, and so is the last
    of `without_progress` failed attempts in a row that reported nothing (preemptions aside)."""

    def __init__(self, failure_config, without_progress: int = 5):
        super().__init__(failure_config)
        self._without_progress = without_progress
        self._attempts_without_progress = 0
        self._mark_reports()

    def __setstate__(self, state):
        # Unpickled in the controller: counting starts from this process's reports so far.
        self.__dict__.update(state)
        self._mark_reports()

    def _mark_reports(self) -> None:
        self._reports_at_last_failure = _reports_seen
        self._stepped_at_last_failure = _reports_with_step
        self._furthest_at_last_failure = _furthest_step
        self._checkpoints_at_last_failure = _checkpoints_seen

    def _progressed(self) -> bool:
        """Whether the attempt that failed got further than the ones before it (see the module's docstring)."""
        reports = _reports_seen - self._reports_at_last_failure
        if _checkpoints_seen != self._checkpoints_at_last_failure:
            return True
        if reports and _reports_with_step - self._stepped_at_last_failure == reports:
            return _furthest_step > self._furthest_at_last_failure
        return reports > 0

    def make_decision(self, training_failed_error) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError) and repeats_on_retry(training_failed_error):
            logger.warning("Not retrying: the workers' error would repeat on every attempt (FailureConfig's "
                           "retries are for lost workers and storage); the run ends with it.")
            return FailureDecision.RAISE
        if isinstance(training_failed_error, WorkerGroupError) and not _is_preemption_failure(training_failed_error):
            progressed = self._progressed()
            self._mark_reports()
            self._attempts_without_progress = 0 if progressed else self._attempts_without_progress + 1
            if self._without_progress and self._attempts_without_progress >= self._without_progress:
                n = self._attempts_without_progress
                why = (f"{NOT_RETRIED}{n} attempt{'s' if n != 1 else ''} in a row failed before their "
                       "first report or before reporting a step past the furthest one reported, each starting "
                       "where the last did (a worker killed for memory at its first step, say: a smaller batch or "
                       "model, or more memory per worker, is the fix; the error above says what else). "
                       f"{RETRIES_WITHOUT_PROGRESS}=0 where fit() is called (the CLI's environment) lets "
                       "max_failures retry them.")
                logger.warning(why)
                _explain(training_failed_error, why)
                return FailureDecision.RAISE
        return super().make_decision(training_failed_error)
