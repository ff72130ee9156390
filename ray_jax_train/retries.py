"""FailureConfig's retries are for lost workers and storage that was out of reach. An error that the same code,
data and checkpoint raise again on every attempt (a checkpoint of another model, a loss gone NaN, a row that
cannot be read) ends the run at once: retried, it restarted the worker group `max_failures` times, and forever
with `max_failures=-1`.

An exception class says it is such an error with the class attribute `retry_repeats_it = True`; the library's own
(CheckpointMismatchError, NonFiniteLossError, NoLossTokensError, NoFullBatchError, TextDataError) do, and a
custom loop's exceptions may too; so does a permission error (EACCES, EPERM, EROFS: storage the run may not write in). The worker marks the error it raises when such an error is in its chain (as the
`from` cause of another, say): the chain does not survive the trip to the controller, the mark does.
"""
from __future__ import annotations

import errno
import logging
from typing import Iterator

from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
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
            if repeats_on_retry(exc):
                try:
                    exc.retry_repeats_it = True  # pickled with the error, which its chain is not
                except AttributeError:  # an exception class with __slots__: its own class may still say so
                    pass
            raise

    return run


class RetriesSkipRepeatedErrors(DefaultFailurePolicy):
    """Ray's policy, except that a worker group error a retry would repeat is raised at once."""

    def make_decision(self, training_failed_error) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError) and repeats_on_retry(training_failed_error):
            logger.warning("Not retrying: the workers' error would repeat on every attempt (FailureConfig's "
                           "retries are for lost workers and storage); the run ends with it.")
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)
