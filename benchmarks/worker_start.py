"""Start-up of a JaxTrainer worker group, for two checkouts interleaved (A B B A): from `fit()` to the loop's first
line, and the whole fit, for a loop that does nothing but report (2 CPU workers, jax.distributed over gloo).

    git worktree add /tmp/old <rev>
    python benchmarks/worker_start.py /tmp/old .      # prints a table and new / old ratios of the medians

Each (checkout, round) runs in a process of its own with its own local Ray, the checkout first on PYTHONPATH (the
workers inherit it); the first fit of each is left out (Ray's worker pool and the OS caches warm up there).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import ray
from ray.train import RunConfig, ScalingConfig
import ray_jax_train as rjt

ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})

def loop():
    import time
    import ray.train
    ray.train.report({"loop_started": time.time()})

out = []
for i in range(int(sys.argv[1])):
    started = time.time()
    result = rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name=f"start{i}", storage_path=sys.argv[2])).fit()
    out.append({"to_loop_s": result.metrics["loop_started"] - started, "fit_s": time.time() - started})
print("RESULT " + json.dumps({"file": rjt.__file__, "fits": out}))
"""


# Runs at every start-up after the .pth files: an editable install's import hook would win over PYTHONPATH, in
# this process and in the Ray workers it starts (they inherit PYTHONPATH, so this file too).
SITECUSTOMIZE = """import sys
sys.meta_path = [f for f in sys.meta_path
                 if "__editable__" not in (getattr(f, "__module__", "") or "") + type(f).__module__]
"""


def run(checkout: str, fits: int, storage: str) -> dict:
    hook = os.path.join(storage + "_site")
    os.makedirs(hook, exist_ok=True)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    paths = [hook, checkout] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.pop("RAY_ADDRESS", None)
    # Not from this directory: `-c` puts the working directory first on sys.path, and Ray gives it to the workers.
    done = subprocess.run([sys.executable, "-c", CHILD, str(fits), storage], env=env, capture_output=True, text=True,
                          timeout=600, cwd=hook)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{checkout}: exit {done.returncode}\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if not result["file"].startswith(os.path.abspath(checkout)):
        raise RuntimeError(f"{checkout}: imported {result['file']}, not the checkout's package")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=2, help="A B B A pairs")
    parser.add_argument("--fits", type=int, default=5, help="fits per process, the first left out")
    parser.add_argument("--out", default="/tmp/worker_start")
    args = parser.parse_args()
    samples = {"old": [], "new": []}
    for rnd in range(args.rounds):
        for which in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
            checkout = os.path.abspath(getattr(args, which))
            fits = run(checkout, args.fits, os.path.join(args.out, f"{which}{rnd}"))["fits"][1:]
            samples[which] += fits
            print(f"round {rnd} {which}: to loop " + " ".join(f"{f['to_loop_s']:.2f}" for f in fits)
                  + " s; fit " + " ".join(f"{f['fit_s']:.2f}" for f in fits) + " s", flush=True)
    print("\n| checkout | fit() to loop, median (min-max) | whole fit, median |\n| --- | --- | --- |")
    med = {}
    for name, fits in samples.items():
        to_loop = [f["to_loop_s"] for f in fits]
        med[name] = (statistics.median(to_loop), statistics.median(f["fit_s"] for f in fits))
        print(f"| {name} | {med[name][0]:.2f} s ({min(to_loop):.2f}-{max(to_loop):.2f}) | {med[name][1]:.2f} s |")
    print(f"\nnew / old: fit() to loop {med['new'][0] / med['old'][0]:.2f}, whole fit {med['new'][1] / med['old'][1]:.2f}")


if __name__ == "__main__":
    main()
