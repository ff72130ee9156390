"""Throughput and utilisation: tokens/s, MFU against a per-device peak, and a rank-0 progress bar.

MFU = achieved model FLOP/s / (devices * peak FLOP/s per device). Model FLOPs per token come from the config
(`models.flops_per_token`, the 6N + attention convention). Peaks are dense bf16 figures from vendor data
sheets for known accelerators; on CPU there is no data sheet, so a short matmul measures one.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable, Dict, Optional, Union

# Dense bf16 peak FLOP/s per JAX device, matched by substring of `device.device_kind`, most specific first. A
# device is a GPU, or a TPU chip where its TensorCores act as one (v4 and v5p megacore; v5e and v6e have one): v2,
# v3 and TPU7x show each of a chip's two TensorCores as a device of its own, so theirs is half the chip's figure.
PEAK_FLOPS = (
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("gh200", 989e12),
    ("b200", 2250e12),
    ("a100", 312e12),
    ("a10g", 125e12),
    ("l40s", 362e12),
    ("l40", 181e12),
    ("l4", 121e12),
    ("v100", 125e12),
    ("rtx 4090", 165e12),
    ("tpu7x", 2307e12 / 2),
    ("tpu v6", 918e12),
    ("tpu v5p", 459e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5", 459e12),
    ("tpu v4", 275e12),
    ("tpu v3", 123e12 / 2),
    ("tpu v2", 46e12 / 2),
)

_measured: Dict[str, float] = {}


def peak_flops_per_device(device=None) -> float:
    """The device's peak FLOP/s: from the table, else measured (CPU, unknown GPUs) once per process."""
    import jax

    device = device or jax.local_devices()[0]
    kind = (getattr(device, "device_kind", "") or "").lower()
    for name, flops in PEAK_FLOPS:
        if name in kind:
            return flops
    if kind not in _measured:
        # An accelerator missing from the table: its bf16 tensor-core peak, roughly, from a large bf16 matmul
        # (a small float32 one would measure a fraction of it and read MFU above 100%).
        on_cpu = getattr(device, "platform", "cpu") == "cpu"
        # One CPU device's matmul already runs on all the process's cores (XLA:CPU shares one thread pool), so
        # the measured figure is the process's peak: split it over its CPU devices, or with num_cpu_devices=N
        # the peak was N times too high and MFU N times too low.
        _measured[kind] = (measure_matmul_flops(device) / len(jax.local_devices(backend="cpu")) if on_cpu
                           else measure_matmul_flops(device, size=8192, dtype="bfloat16"))
    return _measured[kind]


def measure_matmul_flops(device=None, size: int = 512, repeats: int = 5, dtype: str = "float32") -> float:
    """Best-of-`repeats` FLOP/s of a [size x size] matmul on `device` (a fraction of a second)."""
    import jax
    import jax.numpy as jnp

    device = device or jax.local_devices()[0]
    x = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()  # compile
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


class Throughput:
    """Tokens/s and MFU over the interval between two log steps (the only points where we sync)."""

    def __init__(self, flops_per_token: float, tokens_per_step: int, num_devices: int,
                 peak_per_device: Union[float, Callable[[], float]]):
        """`peak_per_device` may be a function (a CPU's peak is measured with a matmul): `measure_peak` calls it
        where the device is idle, else the first `read` does."""
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.num_devices = num_devices
        self._peak_per_device = peak_per_device
        self._since: Optional[float] = None
        self._steps = 0

    def start(self) -> None:
        """Call after a synced step (e.g. after the first, compiling one) to open an interval."""
        self._since, self._steps = time.perf_counter(), 0

    def step(self) -> None:
        self._steps += 1

    def measure_peak(self) -> None:
        """Measure a measured peak now: call with the device idle and nothing dispatched (after the first step's
        sync), since a matmul timed beside a running step reads low and every MFU of the run high. The open
        interval restarts after it."""
        if callable(self._peak_per_device):
            self._peak_per_device = self._peak_per_device()
            self.restart_if_just_read()

    def restart_if_just_read(self) -> None:
        """Call after a checkpoint save: if no step has run since the last `read` (a save at a log step, right
        after its sync), the interval opens again now, so the save is not counted as training time. Left in,
        tokens/s swung by 2x between intervals with a save and those without. A save between log steps stays in:
        the steps dispatched before it ran on the device meanwhile."""
        if self._since is not None and self._steps == 0:
            self._since = time.perf_counter()

    def read(self) -> Dict[str, float]:
        """Throughput since `start` or the last `read`; call right after a host sync."""
        now = time.perf_counter()
        if self._since is None or self._steps == 0:
            self._since, self._steps = now, 0
            return {}
        seconds, steps = max(now - self._since, 1e-9), self._steps
        tokens_per_s = steps * self.tokens_per_step / seconds
        mfu = tokens_per_s * self.flops_per_token / self.peak  # the first read may measure the peak: not timed
        self._since, self._steps = time.perf_counter(), 0
        return {"tokens_per_s": tokens_per_s, "step_time_s": seconds / steps, "mfu": mfu}

    @property
    def peak(self) -> float:
        if callable(self._peak_per_device):
            self._peak_per_device = self._peak_per_device()
        return self.num_devices * self._peak_per_device


class Progress:
    """Rank 0's progress: one line per log step (step, loss, tokens/s, time left), in a terminal as in a log file.

    Not a bar: Ray's `tqdm_ray` state never reached the driver from a Train V2 worker (a terminal showed blank lines
    and no progress at all, a review), and a bar's carriage returns turn a log file (`ray job logs`, CI, a pipe)
    into one long line of redrawn bars."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, label: Optional[str] = None):
        self.enabled, self.total, self.label = enabled, total, label
        self.step, self.first = initial, None  # (time, step) when the first step finished: compile left out

    def update(self, steps: int, metrics: Optional[Dict[str, float]] = None) -> None:
        self.step += steps
        if self.first is None and steps:
            self.first = (time.perf_counter(), self.step)
        if self.enabled and metrics:
            # The process's own stdout, which Ray forwards to the driver: Train V2 sends print() to its logger too,
            # so a print shows twice.
            stream = sys.__stdout__ or sys.stdout
            stream.write(self.line(metrics) + "\n")
            stream.flush()

    def line(self, metrics: Dict[str, float]) -> str:
        parts = [f"step {self.step}/{self.total}"]
        parts += [f"{k} {metrics[k]:.4g}" for k in ("loss", "eval_loss", "learning_rate") if k in metrics]
        if "tokens_per_s" in metrics:
            parts.append(f"{metrics['tokens_per_s']:.0f} tokens/s")
        if self.first is not None and self.step > self.first[1]:
            per_step = (time.perf_counter() - self.first[0]) / (self.step - self.first[1])
            parts.append(f"{_duration(per_step * (self.step - self.first[1]))} training, "
                         f"{_duration(per_step * max(self.total - self.step, 0))} left")
        return f"[train{f' {self.label}' if self.label else ''}] " + ", ".join(parts)



def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def read_metrics(run_dir) -> list:
    """The per-log-step records the loop wrote to `<run dir>/metrics.jsonl` (empty list if none), one per step:
    after a resume, the later attempt's record of a step replaces the earlier one's, and a line cut short by a
    killed run is skipped (as `plot` reads them)."""
    import os

    from ray_jax_train.plot import read_records

    try:
        return read_records(os.fspath(run_dir))  # a local path or a storage URI
    except FileNotFoundError:
        return []


def with_final_metrics(result):
    """Ray's `Result` with `metrics` set to the last logged step's record where Train V2 left it None.

    Train V2 takes `Result.metrics` from the latest checkpoint, so a run that saved none returned None although
    its loop logged every step; the record comes from the run's metrics.jsonl, read through the result's own
    filesystem (a local path or a bucket alike)."""
    if result.metrics is not None or result.path is None:
        return result
    from ray_jax_train.plot import parse_records

    try:
        with result.filesystem.open_input_stream(f"{result.path}/metrics.jsonl") as stream:
            records = parse_records(stream.read().decode("utf-8", errors="replace"))
    except (FileNotFoundError, OSError):
        return result
    if records:
        result.metrics = records[-1]
    return result
