"""A `jax.profiler` trace of a few train steps, on every worker, kept in the run's storage.

A few steady-state steps are what answers "where does a step's time go" (compute, collectives, waiting on the
other workers, the host); a trace of the whole run is gigabytes and slows every step. Each worker writes its own
trace, so a slow worker shows as the one whose collectives do not wait.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

# XLA:CPU records its thunks (one per fused op) in a trace only with this flag; GPU and TPU always do.
CPU_TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"


class StepProfiler:
    """Traces steps `start_step .. start_step + num_steps - 1` (1-based, as the loop counts and logs them).

    The files go to `<destination>/worker_<rank>/plugins/profile/<time>/*.xplane.pb`, which TensorBoard's profile
    plugin, XProf or `jax.profiler.ProfileData.from_file` read; on object stores they are uploaded when the
    window closes.
    """

    def __init__(self, start_step: Optional[int], num_steps: int, destination: str, filesystem=None, rank: int = 0):
        self.start_step, self.num_steps = start_step, num_steps
        self.destination = f"{destination.rstrip('/')}/worker_{rank}"
        self.filesystem = filesystem
        self._files: Optional[contextlib.ExitStack] = None
        self._step_annotation: Any = None

    @property
    def last_step(self) -> Optional[int]:
        return None if self.start_step is None else self.start_step + self.num_steps - 1

    def skip_resumed(self, step: int) -> None:
        """A run resumed past the window traces nothing (its first steps would include the compile)."""
        if self.start_step is not None and step >= self.start_step:
            logger.warning("Not profiling: the run resumed at step %d, past profile_start_step=%d.", step,
                           self.start_step)
            self.start_step = None

    def before_step(self, step: int) -> None:
        """Call before running step `step`."""
        import jax

        from ray_jax_train.storage import local_dir_for

        if step == self.start_step and self._files is None:
            self._files = contextlib.ExitStack()
            local = self._files.enter_context(local_dir_for(self.destination, self.filesystem))
            jax.profiler.start_trace(local)
            logger.info("Profiling steps %d-%d into %s.", self.start_step, self.last_step, self.destination)
        if self._files is not None:
            # Marks each step in the trace, so TensorBoard's step view and a reader can split the time by step.
            self._step_annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._step_annotation.__enter__()

    def after_step(self, step: int, outputs: Any) -> None:
        """Call after dispatching step `step`, with what it returned (waited on when the window closes)."""
        if self._step_annotation is not None:
            self._step_annotation.__exit__(None, None, None)
            self._step_annotation = None
        if self._files is not None and step >= self.last_step:
            self.stop(outputs)

    def stop(self, outputs: Any = None) -> None:
        """Ends the trace, once the traced steps have finished, and uploads it. Safe to call when not tracing."""
        import jax

        if self._step_annotation is not None:
            self._step_annotation.__exit__(None, None, None)
            self._step_annotation = None
        if self._files is None:
            return
        files, self._files = self._files, None
        try:
            if outputs is not None:
                jax.block_until_ready(outputs)  # dispatch is asynchronous: the window's steps must be in the trace
        finally:
            try:
                jax.profiler.stop_trace()
            finally:
                files.close()
        logger.info("Wrote the profile of steps %d-%d to %s.", self.start_step, self.last_step, self.destination)
