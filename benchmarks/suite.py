"""The benchmark suite: one command, interleaved variants, JSON + markdown table + PNG chart.

    python benchmarks/suite.py --out bench_out                # full: ~40-55 min on a 2-core CPU
    python benchmarks/suite.py --smoke --out bench_out/smoke  # tiny sizes, 1 round: checks that it runs
    python benchmarks/suite.py --gpu ...                      # also MFU on the GPU (benchmarks/mfu_gpu.py)

Each round runs every variant once (bare, in-worker, ours, ours-warm-cache, ours-restart with and without the cache,
ours-devices, torch, ray-jax, ours-step, scale-1, scale-2, bare-1/2, in-worker-1/2, fsdp-2, data; reversed on odd
rounds), so load drift on a shared machine hits all of them alike; the figures are per-round ratios, reported as
median and min-max over rounds. Steady-state throughput skips the compile and `--warmup` steps.
Nothing here asserts anything about time. Measurements (targets from the benchmarks issue):

    overhead   ours (JaxTrainer, 1 worker, built-in loop) / the same jitted step in a bare process   >= 0.98
    vs_torch   ours / TorchTrainer with an equivalent PyTorch Llama                                  >= 1.0
    vs_ray_jax ours / Ray's ray.train.v2.jax.JaxTrainer + Ray's iter_jax_batches + hand-written step >= 1.0
               (and like for like: that hand-written step on our JaxTrainer + our iter_jax_batches / Ray's)
    scaling    2 workers / 1 worker, 1 CPU each (cpu_affinity=True), same batch per worker          >= 1.8
               (split: the same step in 1 and 2 pinned processes without Ray, and in pinned JaxTrainer workers
               without our data path and loop)
    sharding   the 2 workers with the state split (fsdp=2) / replicated (dp=2): tokens/s and state MB per device
    input      iter_jax_batches alone / what the step consumes (tokens/s)                          >= 10
    startup    fit() -> first finished step: ours (cold / warm compilation cache) vs TorchTrainer
    restart    a SIGKILLed worker -> the restarted group's first finished step, without / with the cache (1 and 2
               workers)
    checkpoint benchmarks/checkpoint_cost.py (throughput with saves / without, save & restore MB/s)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import suite_variants as V  # noqa: E402

# GPT-2-shaped small Llama: vocab 4096, d 256, 4 layers, 4 heads, seq 128, batch 16 (per worker).
# ffn 688 ~ 8/3 x d: SwiGLU's three matrices hold what GPT-2's two 4d ones do.
FULL = {"vocab": 4096, "d": 256, "ffn": 688, "layers": 4, "heads": 4, "seq": 128, "batch": 16}
SMOKE = {"vocab": 256, "d": 32, "ffn": 64, "layers": 1, "heads": 2, "seq": 16, "batch": 4}
VARIANTS = ("bare", "in_worker", "ours", "ours_warm", "ours_restart", "ours_restart_nocache", "ours_restart2",
            "ours_restart2_nocache", "ours_devices", "ours_nokeep", "ours_synclog", "torch", "torch_keep", "ray_jax", "ours_step",
            "scale1", "scale2", "bare1", "bare2", "in_worker1", "in_worker2", "fsdp2", "data")
# (f)'s "no slower than TorchTrainer" is held to the warm cache: every restart has it (it is on by default), and
# a cold start compiles what torch's eager mode never does.
TARGETS = {"overhead": 0.98, "vs_torch": 1.0, "vs_torch_devices": 1.0, "vs_ray_jax": 1.0, "vs_ray_jax_same_step": 1.0,
           "scaling": 1.8, "input": 10.0, "startup_torch_over_ours_warm": 1.0}


class Context:
    """What every variant of a run shares: sizes, step counts, the dataset, and scratch directories."""

    def __init__(self, size: Dict[str, int], steps: int, warmup: int, log_every: int, scratch: str):
        import ray.data

        self.size, self.steps, self.warmup, self.log_every, self.scratch = size, steps, warmup, log_every, scratch
        rows = steps * size["batch"] * 2  # enough for one pass of the 2-worker run
        self.dataset = ray.data.range(rows, override_num_blocks=4).map_batches(
            V.make_rows, fn_kwargs={"vocab": size["vocab"], "seq": size["seq"]}, batch_format="numpy").materialize()
        self.storage = os.path.join(scratch, "storage")
        self.tokens_per_step = size["batch"] * size["seq"]
        self._n = 0
        self.profile: Optional[Tuple[int, int]] = None  # (first step, steps) traced in built-in-loop variants
        self.profile_out = ""

    def timing_dir(self, name: str) -> str:
        self._n += 1
        return os.path.join(self.scratch, "timing", f"{self._n:03d}_{name}")

    def throughput(self, timing: Dict[str, Any], workers: int = 1) -> float:
        steps, seconds = V.steady(timing["log_times"], self.warmup)
        return steps * self.tokens_per_step * workers / seconds


def _read(timing_dir: str) -> Dict[str, Any]:
    with open(os.path.join(timing_dir, "timing.json")) as f:
        return json.load(f)


def _fit(trainer) -> float:
    """fit(); returns the wall-clock time fit() was called (workers stamp their first step in the same clock)."""
    t0 = time.time()
    result = trainer.fit()
    if result.error:
        raise result.error
    return t0


def _run_config(ctx: Context, name: str):
    from ray.train import RunConfig

    return RunConfig(name=f"{name}_{ctx._n}", storage_path=ctx.storage)


# -- variants: each returns {"tokens_per_s": ..., optional "startup_s": ...} -----------------------------------


def bare_process(size: Dict[str, int], steps: int, warmup: int, log_every: int) -> Dict[str, Any]:
    """`V.bare_run`'s timing from a process of its own, started with the allocator settings our CPU workers get
    (`JaxConfig(keep_cpu_memory=True)`), so that (a) compares trainer with loop and not two allocators."""
    from ray_jax_train.allocator import KEEP_CPU_MEMORY_TUNABLES

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import suite_variants as V; "
            "print(json.dumps(V.bare_run(*json.loads(sys.argv[2]))))")
    env = dict(os.environ, GLIBC_TUNABLES=KEEP_CPU_MEMORY_TUNABLES, JAX_PLATFORMS="cpu")
    sizes = json.dumps([size, steps, warmup, log_every])
    done = subprocess.run([sys.executable, "-c", code, HERE, sizes], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the bare process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_bare(ctx: Context, rnd: int) -> Dict[str, float]:
    """(a)'s baseline: the jitted step in a process of its own (`bare_process`)."""
    return {"tokens_per_s": ctx.throughput(bare_process(ctx.size, ctx.steps, ctx.warmup, ctx.log_every))}


def run_in_worker(ctx: Context, rnd: int) -> Dict[str, float]:
    """(a) split in two: the bare loop inside a JaxTrainer worker (Ray's processes, no data path, no built-in loop)."""
    from ray.train import ScalingConfig

    import ray_jax_train as rjt

    timing_dir = ctx.timing_dir("in_worker")
    trainer = rjt.JaxTrainer(
        V.in_worker_loop, train_loop_config={"size": ctx.size, "steps": ctx.steps, "warmup": ctx.warmup,
                                             "log_every": ctx.log_every, "timing_dir": timing_dir},
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=_run_config(ctx, "in_worker"))
    _fit(trainer)
    return {"tokens_per_s": ctx.throughput(_read(timing_dir))}


def run_bare_pinned(processes: int) -> Callable:
    """(d) without Ray (`bare1`, `bare2`): the data-parallel step in 1 or 2 processes of their own, pinned to a
    core each, jax.distributed + gloo between them (`scale_no_ray.py`): the machine's and the collective's share."""

    def run(ctx: Context, rnd: int) -> Dict[str, float]:
        import scale_no_ray

        return {"tokens_per_s": scale_no_ray.run(processes, ctx.steps, ctx.warmup, size=ctx.size,
                                                 log_every=ctx.log_every)}

    return run


def run_in_worker_dp(workers: int) -> Callable:
    """(d) with Ray but without our data path and loop (`in_worker1`, `in_worker2`): the same data-parallel step
    as `bare1` / `bare2`, inside JaxTrainer workers pinned as `scale1` / `scale2` are."""

    def run(ctx: Context, rnd: int) -> Dict[str, float]:
        from ray.train import ScalingConfig

        import ray_jax_train as rjt

        name = f"in_worker{workers}"
        timing_dir = ctx.timing_dir(name)
        trainer = rjt.JaxTrainer(
            V.in_worker_dp_loop, train_loop_config={"size": ctx.size, "steps": ctx.steps,
                                                    "log_every": ctx.log_every, "timing_dir": timing_dir},
            jax_config=rjt.JaxConfig(cpu_affinity=True),
            scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
            run_config=_run_config(ctx, name))
        _fit(trainer)
        return {"tokens_per_s": ctx.throughput(_read(timing_dir), workers)}

    return run


def _ours(ctx: Context, name: str, *, steps: int, workers: int = 1, affinity: bool = False,
          cache_dir: str = None, cpu_devices: int = 1, mesh: Dict[str, int] = None,
          keep_memory: bool = True, sync_log: bool = False) -> Dict[str, float]:
    from ray.train import ScalingConfig

    import ray_jax_train as rjt
    from ray_jax_train.lm.profiling import CPU_TRACE_FLAG

    timing_dir = ctx.timing_dir(name)
    arguments = dict(V.lm_arguments(ctx.size, steps, ctx.log_every, workers), num_cpu_devices=cpu_devices, mesh=mesh)
    profiled = ctx.profile is not None and steps >= ctx.profile[0] + ctx.profile[1] - 1
    if profiled:
        arguments.update(profile_start_step=ctx.profile[0], profile_num_steps=ctx.profile[1])
    config = {"arguments": arguments,
              "model_config": V.model_dict(ctx.size), "total_steps": steps, "timing_dir": timing_dir,
              "sync_log": sync_log}
    run_config = _run_config(ctx, name)
    trainer = rjt.JaxTrainer(
        V.ours_loop, train_loop_config=config,
        jax_config=rjt.JaxConfig(cpu_affinity=affinity, compilation_cache_dir=cache_dir, num_cpu_devices=cpu_devices,
                                 xla_flags=[CPU_TRACE_FLAG] if profiled else [], keep_cpu_memory=keep_memory),
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=run_config, datasets={"train": ctx.dataset})
    t0 = _fit(trainer)
    if profiled:  # the scratch storage goes at the end; keep the traces beside the report
        shutil.copytree(os.path.join(ctx.storage, run_config.name, "profile"),
                        os.path.join(ctx.profile_out, run_config.name))
    timing = _read(timing_dir)
    out = {"startup_s": timing["first_step_time"] - t0, "state_mb_per_device": timing["state_mb_per_device"]}
    if steps > ctx.warmup:
        out["tokens_per_s"] = ctx.throughput(timing, workers)
    return out


def _cache_dir(ctx: Context, rnd: int) -> str:
    """This round's compilation cache, under the run storage as a restart would find it; cold for `ours`."""
    return os.path.join(ctx.storage, f"jax_cache_round{rnd}")


def run_ours(ctx: Context, rnd: int) -> Dict[str, float]:
    shutil.rmtree(_cache_dir(ctx, rnd), ignore_errors=True)
    return _ours(ctx, "ours", steps=ctx.steps, cache_dir=_cache_dir(ctx, rnd))


def run_ours_nokeep(ctx: Context, rnd: int) -> Dict[str, float]:
    """`ours` with glibc's allocator defaults (`JaxConfig(keep_cpu_memory=False)`): what the default gains in the
    trainer, not only in a bare process."""
    return _ours(ctx, "ours_nokeep", steps=ctx.steps, keep_memory=False)


def run_ours_synclog(ctx: Context, rnd: int) -> Dict[str, float]:
    """`ours` with each log step's record finished before the next step is dispatched (the loop before session
    29): ours / ours_synclog is what finishing it after the dispatch gains on this machine."""
    return _ours(ctx, "ours_synclog", steps=ctx.steps, sync_log=True)


def run_ours_warm(ctx: Context, rnd: int) -> Dict[str, float]:
    """A restart of `ours`: same programs, the cache `ours` just filled; only start-up is measured."""
    return _ours(ctx, "ours_warm", steps=ctx.log_every, cache_dir=_cache_dir(ctx, rnd))


def run_restart(cache: bool, workers: int = 1) -> Callable:
    """A real restart: the first attempt is SIGKILLed at its first report and Ray starts the group again. Timed
    from the kill to the restarted loop's first finished step, with the compilation cache in the run's storage
    (the default) or without it. With 2 workers the group waits for both processes' programs, so this shows
    whether process 1 also loads from the cache that process 0 wrote."""

    def run(ctx: Context, rnd: int) -> Dict[str, float]:
        from ray.train import FailureConfig, RunConfig, ScalingConfig

        import ray_jax_train as rjt

        name = ("ours_restart" if workers == 1 else f"ours_restart{workers}") + ("" if cache else "_nocache")
        timing_dir = ctx.timing_dir(name)
        config = {"arguments": V.lm_arguments(ctx.size, ctx.log_every, ctx.log_every, workers=workers),
                  "model_config": V.model_dict(ctx.size), "total_steps": ctx.log_every, "timing_dir": timing_dir}
        trainer = rjt.JaxTrainer(
            V.restart_loop, train_loop_config=config, jax_config=rjt.JaxConfig(compilation_cache=cache),
            scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"{name}_{ctx._n}", storage_path=ctx.storage,
                                 failure_config=FailureConfig(max_failures=1)),
            datasets={"train": ctx.dataset})
        _fit(trainer)
        with open(os.path.join(timing_dir, "killed_at.json")) as f:
            killed = json.load(f)["time"]
        return {"restart_s": _read(timing_dir)["first_step_time"] - killed}

    return run


def run_ours_devices(ctx: Context, rnd: int) -> Dict[str, float]:
    """`ours` with one XLA CPU device per core (`JaxConfig(num_cpu_devices=...)`), the batch split over them.

    One CPU device runs a step's elementwise fusions on one thread (about 1.3 busy threads on 2 cores); a device
    per core runs one data-parallel program per core, and the in-process gradient all-reduce is a memory copy.
    """
    return _ours(ctx, "ours_devices", steps=ctx.steps, cpu_devices=os.cpu_count() or 1)


def run_scale(workers: int) -> Callable:
    def run(ctx: Context, rnd: int) -> Dict[str, float]:
        return _ours(ctx, f"scale{workers}", steps=ctx.steps, workers=workers, affinity=True)

    return run


def run_fsdp2(ctx: Context, rnd: int) -> Dict[str, float]:
    """`scale2` with the train state split over the 2 workers (mesh {"fsdp": -1}, so fsdp=2) instead of replicated.

    Same global batch and cores; XLA gathers each weight before use and reduce-scatters its gradient across the
    two processes (gloo), in place of one gradient all-reduce. What it buys is the state bytes per device.
    """
    return _ours(ctx, "fsdp2", steps=ctx.steps, workers=2, affinity=True, mesh={"fsdp": -1})


def run_torch(ctx: Context, rnd: int, name: str = "torch") -> Dict[str, float]:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_jax_train.allocator import KEEP_CPU_MEMORY_TUNABLES

    timing_dir = ctx.timing_dir(name)
    run_config = _run_config(ctx, name)
    if name == "torch_keep":
        run_config.worker_runtime_env = {"env_vars": {"GLIBC_TUNABLES": KEEP_CPU_MEMORY_TUNABLES}}
    trainer = TorchTrainer(
        V.torch_loop, train_loop_config={"size": ctx.size, "steps": ctx.steps, "batch_size": ctx.size["batch"],
                                         "log_every": ctx.log_every, "timing_dir": timing_dir},
        scaling_config=ScalingConfig(num_workers=1), run_config=run_config,
        datasets={"train": ctx.dataset})
    t0 = _fit(trainer)
    timing = _read(timing_dir)
    return {"tokens_per_s": ctx.throughput(timing), "startup_s": timing["first_step_time"] - t0,
            "params": timing["params"], "threads": timing["threads"]}


def _hand_written(ctx: Context, name: str, loop, trainer_cls, **kw) -> Dict[str, float]:
    from ray.train import ScalingConfig

    timing_dir = ctx.timing_dir(name)
    trainer = trainer_cls(
        loop, train_loop_config={"model_config": V.model_dict(ctx.size), "steps": ctx.steps,
                                 "batch_size": ctx.size["batch"], "log_every": ctx.log_every,
                                 "timing_dir": timing_dir},
        scaling_config=ScalingConfig(num_workers=1), run_config=_run_config(ctx, name),
        datasets={"train": ctx.dataset}, **kw)
    t0 = _fit(trainer)
    timing = _read(timing_dir)
    return {"tokens_per_s": ctx.throughput(timing), "startup_s": timing["first_step_time"] - t0}


def run_ray_jax(ctx: Context, rnd: int) -> Dict[str, float]:
    from ray.train.v2.jax import JaxTrainer as RayJaxTrainer

    return _hand_written(ctx, "ray_jax", V.ray_jax_loop, RayJaxTrainer)


def run_ours_step(ctx: Context, rnd: int) -> Dict[str, float]:
    """(c) like for like: Ray's variant's hand-written step, on our JaxTrainer and our iter_jax_batches."""
    import ray_jax_train as rjt

    return _hand_written(ctx, "ours_step", V.ours_step_loop, rjt.JaxTrainer)


def run_data(ctx: Context, rnd: int) -> Dict[str, float]:
    from ray.train import ScalingConfig

    import ray_jax_train as rjt

    timing_dir = ctx.timing_dir("data")
    trainer = rjt.JaxTrainer(
        V.data_only_loop, train_loop_config={"batch_size": ctx.size["batch"], "epochs": 3, "timing_dir": timing_dir},
        scaling_config=ScalingConfig(num_workers=1), run_config=_run_config(ctx, "data"),
        datasets={"train": ctx.dataset})
    _fit(trainer)
    return {"tokens_per_s": ctx.throughput(_read(timing_dir))}


RUNNERS = {"bare": run_bare, "in_worker": run_in_worker, "bare1": run_bare_pinned(1), "bare2": run_bare_pinned(2),
           "in_worker1": run_in_worker_dp(1), "in_worker2": run_in_worker_dp(2),
           "ours": run_ours, "ours_warm": run_ours_warm,
           "ours_restart": run_restart(True), "ours_restart_nocache": run_restart(False),
           "ours_restart2": run_restart(True, 2), "ours_restart2_nocache": run_restart(False, 2),
           "ours_devices": run_ours_devices, "ours_nokeep": run_ours_nokeep, "ours_synclog": run_ours_synclog,
           "torch": run_torch,
           "torch_keep": lambda ctx, rnd: run_torch(ctx, rnd, "torch_keep"),
           "ray_jax": run_ray_jax, "ours_step": run_ours_step, "scale1": run_scale(1), "scale2": run_scale(2), "fsdp2": run_fsdp2,
           "data": run_data}


# -- summary -------------------------------------------------------------------------------------------------


def _ratio(rounds: List[Dict], num: str, den: str, key: str = "tokens_per_s") -> List[float]:
    return [r[num][key] / r[den][key] for r in rounds if num in r and den in r and key in r[num] and key in r[den]]


def _stats(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(rounds: List[Dict]) -> Dict[str, Dict]:
    """Per-round ratios -> median/min/max, with the issue's target and whether the median meets it."""
    ratios = {
        "overhead": _ratio(rounds, "ours", "bare"),
        # (a) split: Ray's processes alone (same loop in a worker), then our data path + built-in loop on top.
        "overhead_ray_share": _ratio(rounds, "in_worker", "bare"),
        "overhead_ours_share": _ratio(rounds, "ours", "in_worker"),
        "vs_torch": _ratio(rounds, "ours", "torch"),
        "vs_torch_devices": _ratio(rounds, "ours_devices", "torch"),
        # TorchTrainer with the allocator settings our CPU workers get (keep_cpu_memory): what torch would gain.
        "vs_torch_keep": _ratio(rounds, "ours", "torch_keep"),
        # keep_cpu_memory inside the trainer: the default / glibc's defaults.
        "keep_gain": _ratio(rounds, "ours", "ours_nokeep"),
        # A log step finished after the next step's dispatch / before it.
        "log_after_dispatch_gain": _ratio(rounds, "ours", "ours_synclog"),
        "devices_gain": _ratio(rounds, "ours_devices", "ours"),
        "vs_ray_jax": _ratio(rounds, "ours", "ray_jax"),
        "vs_ray_jax_same_step": _ratio(rounds, "ours_step", "ray_jax"),
        "scaling": _ratio(rounds, "scale2", "scale1"),
        # (d) split like (a), for 1 and for 2 pinned workers: the same step without Ray (the machine and the
        # collective), in JaxTrainer workers (Ray's processes), then our data path + built-in loop on top.
        "scaling_no_ray": _ratio(rounds, "bare2", "bare1"),
        "scaling_in_worker": _ratio(rounds, "in_worker2", "in_worker1"),
        "scale1_ray_share": _ratio(rounds, "in_worker1", "bare1"),
        "scale1_ours_share": _ratio(rounds, "scale1", "in_worker1"),
        "scale2_ray_share": _ratio(rounds, "in_worker2", "bare2"),
        "scale2_ours_share": _ratio(rounds, "scale2", "in_worker2"),
        # Sharding: FSDP's speed and state bytes per device against data parallelism on the same 2 workers.
        "fsdp_over_dp": _ratio(rounds, "fsdp2", "scale2"),
        "fsdp_state_over_dp": _ratio(rounds, "fsdp2", "scale2", "state_mb_per_device"),
        "input": _ratio(rounds, "data", "ours"),
        # Start-up: > 1 means ours reaches its first finished step sooner.
        "startup_torch_over_ours_cold": _ratio(rounds, "torch", "ours", "startup_s"),
        "startup_torch_over_ours_warm": _ratio(rounds, "torch", "ours_warm", "startup_s"),
        "startup_cold_over_warm": _ratio(rounds, "ours", "ours_warm", "startup_s"),
        "restart_nocache_over_cache": _ratio(rounds, "ours_restart_nocache", "ours_restart", "restart_s"),
        "restart2_nocache_over_cache": _ratio(rounds, "ours_restart2_nocache", "ours_restart2", "restart_s"),
    }
    out = {}
    for name, values in ratios.items():
        if values:
            out[name] = dict(_stats(values), target=TARGETS.get(name))
            if name in TARGETS:
                out[name]["met"] = out[name]["median"] >= TARGETS[name]
    return out


def variant_stats(rounds: List[Dict]) -> Dict[str, Dict]:
    out = {}
    for name in VARIANTS:
        for key in ("tokens_per_s", "startup_s", "restart_s", "state_mb_per_device"):
            values = [r[name][key] for r in rounds if name in r and key in r[name]]
            if values:
                out.setdefault(name, {})[key] = _stats(values)
    return out


LABELS = {
    "overhead": "(a) overhead: ours / bare process",
    "overhead_ray_share": "(a) split: bare loop in a JaxTrainer worker / bare process",
    "overhead_ours_share": "(a) split: ours / bare loop in a JaxTrainer worker", "vs_torch": "(b) ours / TorchTrainer",
    "vs_torch_devices": "(b) ours, a CPU device per core / TorchTrainer",
    "vs_torch_keep": "(b) ours / TorchTrainer with our workers' allocator settings",
    "keep_gain": "(b) ours / ours with keep_cpu_memory=False",
    "log_after_dispatch_gain": "(a) ours / ours finishing each log step before the next dispatch",
    "devices_gain": "(b) ours, a CPU device per core / ours, one device",
    "vs_ray_jax": "(c) ours / Ray's JaxTrainer",
    "vs_ray_jax_same_step": "(c) same hand-written step: our JaxTrainer / Ray's",
    "scaling": "(d) scaling: 2 workers / 1 (affinity)",
    "scaling_no_ray": "(d) the same step without Ray: 2 pinned processes / 1",
    "scaling_in_worker": "(d) the same step in pinned JaxTrainer workers, no data path or loop: 2 / 1",
    "scale1_ray_share": "(d) split, 1 worker: step in a pinned worker / in a pinned process",
    "scale1_ours_share": "(d) split, 1 worker: scale1 / step in a pinned worker",
    "scale2_ray_share": "(d) split, 2 workers: step in pinned workers / in pinned processes",
    "scale2_ours_share": "(d) split, 2 workers: scale2 / step in pinned workers",
    "fsdp_over_dp": "(i) sharding: 2 workers, fsdp=2 / dp=2, tokens/s",
    "fsdp_state_over_dp": "(i) sharding: 2 workers, fsdp=2 / dp=2, train state bytes per device",
    "input": "(e) input pipeline / step consumption",
    "startup_torch_over_ours_cold": "(f) start-up: torch / ours, cold cache",
    "startup_torch_over_ours_warm": "(f) start-up: torch / ours, warm cache",
    "startup_cold_over_warm": "(f) start-up: ours cold / ours warm",
    "restart_nocache_over_cache": "(f) restart after a kill, kill → first step: no cache / cache in the run's storage",
    "restart2_nocache_over_cache": "(f) the same restart with 2 workers: no cache / cache",
}


def _fmt(s: Dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def cpu_topology() -> Dict[str, Any]:
    """Which usable CPUs share a physical core: (d) pins workers to cores, and two hyperthreads are not two cores."""
    from ray_jax_train.backend import _usable_cores, sibling_groups

    cores = _usable_cores()
    groups = sibling_groups(cores)
    return {"cpus": len(cores), "physical_cores": len(groups), "siblings": groups}


def _topology_note(topology) -> str:
    if not topology:
        return ""
    pairs = [s for s in topology["siblings"] if len(s) > 1]
    shown = ", ".join("+".join(map(str, s)) for s in pairs[:4]) + (" ..." if len(pairs) > 4 else "")
    return (f" {topology['cpus']} CPUs on {topology['physical_cores']} physical cores"
            + (f" (one core each: {shown})" if pairs else "") + ".")


def markdown(report: Dict[str, Any]) -> str:
    lines = [f"Run {report['date']} on {report['machine']}; `{report['command']}`; {report['rounds']} rounds, "
             f"{report['steps']} steps per throughput variant ({report['warmup']} warm-up steps not timed)."
             + _topology_note(report.get("cpu_topology")), "",
             "| measurement | median [min–max] | target | met |", "| --- | --- | --- | --- |"]
    for name, s in report["summary"].items():
        target = f"≥ {s['target']:g}" if s.get("target") else "—"
        met = ("yes" if s["met"] else "**no**") if "met" in s else "—"
        lines.append(f"| {LABELS.get(name, name)} | {_fmt(s)} | {target} | {met} |")
    lines += ["", "| variant | tokens/s median [min–max] | fit() → first step, s | kill → first step after the "
              "restart, s | train state, MB per device |", "| --- | --- | --- | --- | --- |"]
    for name, s in report["variants"].items():
        tps = _fmt(s["tokens_per_s"], 0) if "tokens_per_s" in s else "—"
        start = _fmt(s["startup_s"], 1) if "startup_s" in s else "—"
        restart = _fmt(s["restart_s"], 1) if "restart_s" in s else "—"
        state = f"{s['state_mb_per_device']['median']:.1f}" if "state_mb_per_device" in s else "—"
        lines.append(f"| {name} | {tps} | {start} | {restart} | {state} |")
    ckpt = report.get("checkpoint")
    if ckpt:
        lines += ["", f"Checkpoint cost (benchmarks/checkpoint_cost.py, {ckpt.get('workload', 'mlp')} workload, "
                      f"{ckpt['workers']} worker(s), "
                      f"{ckpt['state_mb']:.0f} MB state, save every {ckpt['save_every']} steps): throughput with "
                      f"saves / without = {ckpt['throughput_ratio_median']:.2f} (median of phases); save "
                      f"{ckpt['save_mb_per_s']:.0f} MB/s committed ({ckpt['save_blocking_s']:.2f} s blocking), "
                      f"restore {ckpt['restore_mb_per_s']:.0f} MB/s."]
    for gpu in report.get("gpu") or []:
        mfu = f"{100 * gpu['mfu']:.1f}%" if gpu.get("mfu") is not None else "n/a"
        lines += ["", f"GPU ({gpu['device']}, {gpu.get('size', '')}): {gpu['tokens_per_s']:,.0f} tokens/s, MFU {mfu}."]
    return "\n".join(lines) + "\n"


def chart(report: Dict[str, Any], path: str) -> None:
    """Ratios (median, min-max whiskers) against their targets, one bar each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = list(report["summary"].items())
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(items) + 1.5))
    for i, (name, s) in enumerate(items):
        color = "tab:gray" if "met" not in s else ("tab:green" if s["met"] else "tab:red")
        ax.barh(i, s["median"], xerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]], color=color, capsize=3)
        if s.get("target"):
            ax.plot([s["target"]] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2)
    ax.set_yticks(range(len(items)), [LABELS.get(n, n) for n, _ in items])
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linestyle=":", linewidth=0.8)
    ax.set_xlabel("ratio (median, min–max over rounds; black tick = target)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")  # the long row labels would push the axis title off
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------------------------


def _busy_fraction(seconds: float) -> float:
    """Share of all cores not idle over `seconds` (from /proc/stat; 0 where that does not exist)."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def settle(max_wait_s: float = 30.0, busy_below: float = 0.15) -> None:
    """Wait until the previous variant's processes have wound down (cores mostly idle), so that a variant
    does not pay for its predecessor's teardown: one second windows, at most `max_wait_s`."""
    deadline = time.time() + max_wait_s
    while time.time() < deadline and _busy_fraction(1.0) > busy_below:
        pass


# A variant that needs another to have run just before it in the same round (it reads that one's cache).
FOLLOWS = {"ours_warm": "ours"}


def round_order(variants: List[str], rnd: int) -> List[str]:
    """The variants in order on even rounds and reversed on odd ones (A B, B A), so whichever runs first in a
    round, on a machine still busy from the one before, favours no variant; `FOLLOWS` pairs stay in order."""
    order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
    for later, earlier in FOLLOWS.items():
        if later in order and earlier in order:
            order.remove(later)
            order.insert(order.index(earlier) + 1, later)
    return order


def _register_by_value() -> None:
    """Ship the worker loops by value: workers need not have benchmarks/ on their path (e.g. the test cluster)."""
    import ray.cloudpickle

    import checkpoint_cost

    for module in (V, checkpoint_cost):
        ray.cloudpickle.register_pickle_by_value(module)


def run_checkpoint(smoke: bool, out_dir: str) -> Dict[str, Any]:
    import checkpoint_cost

    storage = tempfile.mkdtemp(prefix="suite_ckpt_")
    try:
        # The MLP stress case (a 50 MB state, tens of ms per step): the LM workload takes ~12 min on 2 cores.
        if smoke:
            args = ["--workload", "mlp", "--workers", "1", "--hidden", "64", "--layers", "1", "--batch", "8",
                    "--save-every", "5", "--phase-steps", "10", "--rounds", "1"]
        else:
            args = ["--workload", "mlp", "--workers", "2", "--hidden", "1024", "--layers", "4", "--batch", "64",
                    "--save-every", "50", "--phase-steps", "100", "--rounds", "3"]
        return checkpoint_cost.main(args + ["--storage-path", storage])
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def run_gpu(smoke: bool, out_dir: str) -> List[Dict[str, Any]]:
    """benchmarks/mfu_gpu.py in its own process, so its JAX sees the GPU whatever this process's JAX is."""
    out = os.path.join(out_dir, "mfu_gpu.json")
    cmd = [sys.executable, os.path.join(HERE, "mfu_gpu.py"), "--out", out] + (["--smoke"] if smoke else ["--sizes", "125m"])
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="directory for suite.json, suite.md, suite.png")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 round, few steps")
    # 28 timed steps (~30 s) per variant: with 12, one variant moved by +-15% between rounds on a shared 2-core box.
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="steps per throughput variant, warm-up included")
    parser.add_argument("--warmup", type=int, default=4, help="steps after the compiling one before timing")
    parser.add_argument("--log-every", type=int, default=4, help="host sync / timestamp every N steps")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--no-checkpoint", action="store_true", help="skip (g), benchmarks/checkpoint_cost.py")
    parser.add_argument("--gpu", action="store_true", help="also run (h), benchmarks/mfu_gpu.py, on this machine's GPU")
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core {platform.machine()} CPU")
    parser.add_argument("--profile", nargs=2, type=int, metavar=("FIRST_STEP", "STEPS"),
                        help="trace these steps of every built-in-loop variant (jax.profiler, every worker) into "
                             "OUT/profile/<run>/worker_<rank>; read them with benchmarks/trace_summary.py. A traced "
                             "run's timings are not comparable with untraced ones")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.log_every = 1, min(args.steps, 4), 1, 1
    if args.warmup % args.log_every or args.steps % args.log_every:
        parser.error("--warmup and --steps must be multiples of --log-every (timing starts and ends at a sync)")

    import ray

    if not ray.is_initialized():
        # 2 training workers + Ray Data tasks on a small machine: oversubscribe logical CPUs, as the tests do.
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
                     [HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])}})  # keep packages found on PYTHONPATH
    _register_by_value()
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="suite_")
    started = time.time()
    try:
        ctx = Context(SMOKE if args.smoke else FULL, args.steps, args.warmup, args.log_every, scratch)
        if args.profile:
            ctx.profile, ctx.profile_out = tuple(args.profile), os.path.join(args.out, "profile")
        rounds: List[Dict[str, Any]] = []
        for rnd in range(args.rounds):
            results: Dict[str, Any] = {}
            for name in round_order(args.variants, rnd):
                if not args.smoke:
                    settle()
                t = time.time()
                results[name] = RUNNERS[name](ctx, rnd)
                print(f"round {rnd} {name}: {json.dumps(results[name])} ({time.time() - t:.0f} s)", flush=True)
            rounds.append(results)
        checkpoint = None if args.no_checkpoint else run_checkpoint(args.smoke, args.out)
        gpu = run_gpu(args.smoke, args.out) if args.gpu else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    report = {
        "date": datetime.date.today().isoformat(), "machine": args.machine,
        "command": "python benchmarks/suite.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "size": ctx.size, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "log_every": args.log_every, "wall_s": time.time() - started,
        "summary": summarise(rounds), "variants": variant_stats(rounds), "raw_rounds": rounds,
        "checkpoint": checkpoint, "gpu": gpu, "cpu_topology": cpu_topology(),
    }
    with open(os.path.join(args.out, "suite.json"), "w") as f:
        json.dump(report, f, indent=2)
    table = markdown(report)
    with open(os.path.join(args.out, "suite.md"), "w") as f:
        f.write(table)
    chart(report, os.path.join(args.out, "suite.png"))
    print(table, flush=True)
    return report


if __name__ == "__main__":
    main()
