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
        """A run resumed after `step` completed steps compiles in step `step + 1`: a window that has begun by
        then traces nothing (it would time the compile, or be cut short)."""
        if self.start_step is not None and step > 0 and step + 1 >= self.start_step:
            logger.warning("Not profiling: the run resumed after step %d, at or past profile_start_step=%d.",
                           step, self.start_step)
            self.start_step = None

    def before_step(self, step: int) -> None:
        """Call before running step `step`."""
        import jax

        from ray_jax_train.storage import local_dir_for

        if step == self.start_step and self._files is None:
            files = contextlib.ExitStack()
            try:
                jax.profiler.start_trace(files.enter_context(local_dir_for(self.destination, self.filesystem)))
            except Exception:  # e.g. the user's own trace is running: train on, untraced
                files.close()
                logger.warning("Could not start the profile of steps %d-%d; training on without it.",
                               self.start_step, self.last_step, exc_info=True)
                self.start_step = None
                return
            self._files = files
            logger.info("Profiling steps %d-%d into %s.", self.start_step, self.last_step, self.destination)
        if self._files is not None:
            # Marks each step's dispatch in the trace (TensorBoard's step view); with asynchronous dispatch the
            # step's computation runs after its marker, on XLA's threads.
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
        """Ends the trace, once the traced steps have finished, and uploads it. Safe to call when not tracing.

        Never raises: a profile that cannot be written (full disk, an upload error) is logged, and training, or
        the error that is already on its way out of the loop, goes on.
        """
        import jax

        if self._step_annotation is not None:
            self._step_annotation.__exit__(None, None, None)
            self._step_annotation = None
        if self._files is None:
            return
        files, self._files = self._files, None
        try:
            try:
                if outputs is not None:
                    jax.block_until_ready(outputs)  # dispatch is asynchronous: the window's steps must be traced
            finally:
                try:
                    jax.profiler.stop_trace()
                finally:
                    files.close()
            logger.info("Wrote the profile of steps %d-%d to %s.", self.start_step, self.last_step, self.destination)
        except Exception:
            logger.warning("Could not write the profile of steps %d-%d to %s.", self.start_step, self.last_step,
                           self.destination, exc_info=True)


def with_trace_flags(jax_config, args):
    """`jax_config` with XLA:CPU's per-op trace events on when `args` profiles steps (harmless off CPU)."""
    import dataclasses

    if args.profile_start_step is None or CPU_TRACE_FLAG in jax_config.xla_flags:
        return jax_config
    return dataclasses.replace(jax_config, xla_flags=[*jax_config.xla_flags, CPU_TRACE_FLAG])
