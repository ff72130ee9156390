"""FailureConfig's retries are for lost workers and storage that was out of reach. An error that the same code,
data and checkpoint raise again on every attempt (a checkpoint of another model, a loss gone NaN, a row that
cannot be read) ends the run at once: retried, it restarted the worker group `max_failures` times, and forever
with `max_failures=-1`.

An exception class says it is such an error with the class attribute `retry_repeats_it = True`; the library's own
(CheckpointMismatchError, NonFiniteLossError, NoLossTokensError, NoFullBatchError, TextDataError) do, and a
custom loop's exceptions may too.
"""
from __future__ import annotations

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
        stack.extend([getattr(error, "cause", None), error.__cause__, error.__context__])


def repeats_on_retry(exc: BaseException) -> bool:
    return any(getattr(type(error), "retry_repeats_it", False) for error in _causes(exc))


class RetriesSkipRepeatedErrors(DefaultFailurePolicy):
    """Ray's policy, except that a worker group error a retry would repeat is raised at once."""

    def make_decision(self, training_failed_error) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError) and any(
                repeats_on_retry(failure) for failure in training_failed_error.worker_failures.values()):
            logger.warning("Not retrying: the workers' error would repeat on every attempt (FailureConfig's "
                           "retries are for lost workers and storage); the run ends with it.")
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)
