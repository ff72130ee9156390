"""What JaxTrainer costs the MLP example: start-up to first step, and steady-state step time vs a bare process.

Variants run interleaved (bare, trainer, bare, trainer, ...) so machine drift hits both; the figure is the
ratio bare_step_time / trainer_step_time per round (1.0 = no overhead), reported as median and min-max.

    python benchmarks/core_overhead.py --rounds 3 --workers 2 --out bench_out/core_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import mlp_data_parallel as example  # noqa: E402


def steady_step_time(log_times, warmup_step: int) -> float:
    """Seconds per step between the first log at/after `warmup_step` and the last log."""
    points = [(s, t) for s, t in log_times if s >= warmup_step]
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (t1 - t0) / (s1 - s0)


def bare_run(steps: int, batch_size: int, log_every: int, warmup: int) -> dict:
    """The example's jitted step in this process, host batches built the same way, no Ray."""
    import jax
    import numpy as np

    optimizer = example.make_optimizer(3e-3)
    params = jax.tree.map(jax.numpy.asarray, example.init_params(0))
    opt_state = optimizer.init(params)
    step_fn = jax.jit(example.make_train_step(optimizer), donate_argnums=(0, 1))
    ids = np.arange(steps * batch_size).reshape(steps, batch_size)
    log_times = []
    for i in range(steps):
        batch = example.make_rows({"id": ids[i]})
        params, opt_state, loss = step_fn(params, opt_state, jax.device_put(batch["x"]), jax.device_put(batch["y"]))
        if (i + 1) % log_every == 0:
            float(loss)
            log_times.append((i + 1, time.time()))
    return {"step_s": steady_step_time(log_times, warmup)}


def trainer_run(workers: int, steps: int, batch_size: int, log_every: int, warmup: int, storage: str) -> dict:
    from ray.train import RunConfig, ScalingConfig

    import ray_jax_train as rjt

    record = tempfile.mkdtemp(prefix="core_overhead_")
    config = {"steps": steps, "batch_size": batch_size, "learning_rate": 3e-3, "log_every": log_every,
              "record_dir": None, "timing_dir": record}
    trainer = rjt.JaxTrainer(
        _timed_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=storage), datasets={"train": example.make_dataset(steps * batch_size)},
    )
    t0 = time.time()
    result = trainer.fit()
    if result.error:
        raise result.error
    with open(os.path.join(record, "timing.json")) as f:
        timing = json.load(f)
    return {"step_s": steady_step_time(timing["log_times"], warmup), "fit_to_first_step_s": timing["first"] - t0}


def _timed_loop(config):
    """The example's loop, writing its log timestamps for the driver."""
    import jax

    config = dict(config)
    timing_dir = config.pop("timing_dir")
    config["record_dir"] = os.path.join(timing_dir, "rec")
    example.train_loop_per_worker(config)
    if jax.process_index() == 0:
        with open(os.path.join(config["record_dir"], "run.json")) as f:
            run = json.load(f)
        with open(os.path.join(timing_dir, "timing.json"), "w") as f:
            json.dump({"log_times": run["log_times"], "first": run["first_step_done"]}, f)


def main(argv=None):
    import ray

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="bench_out/core_overhead.json")
    args = parser.parse_args(argv)

    here = os.path.dirname(os.path.abspath(__file__))
    pythonpath = os.pathsep.join([here, os.path.join(here, "..", "examples")])
    ray.init(num_cpus=max(os.cpu_count() or 1, args.workers + 2), include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    storage = tempfile.mkdtemp(prefix="core_overhead_storage_")
    warmup, log_every = args.steps // 4, 20
    rounds = []
    for r in range(args.rounds):
        bare = bare_run(args.steps, args.batch_size, log_every, warmup)
        ours = trainer_run(args.workers, args.steps, args.batch_size, log_every, warmup, storage)
        rounds.append({"bare_step_s": bare["step_s"], "trainer_step_s": ours["step_s"],
                       "ratio": bare["step_s"] / ours["step_s"], "fit_to_first_step_s": ours["fit_to_first_step_s"]})
        print(json.dumps(rounds[-1]), flush=True)
    ratios = [r["ratio"] for r in rounds]
    starts = [r["fit_to_first_step_s"] for r in rounds]
    summary = {
        "workers": args.workers, "global_batch": args.batch_size, "steps": args.steps,
        "ratio_bare_over_trainer_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "fit_to_first_step_s_median": statistics.median(starts), "rounds": rounds,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
