"""(h) in one command on a GPU machine: what the built-in Llama reaches there, bare and through the whole stack.

Six stages, each in a process of its own with a time limit, so one that fails or hangs leaves the others' figures:
  0. `attention_check.py`: cuDNN's fused attention against the model's materialised one (outputs and gradients,
     causal / packed / windowed / left-padded), before any figure that uses it.
  1. `mfu_gpu.py --sizes 125m --attention xla cudnn`: the bare jitted train step at ~125M (vocab 32k, batch
     16 x 2048), bf16, with materialised and with fused attention.
  2. `ray-jax-train fit examples/llama_125m_gpu.yaml` on one GPU worker: Ray, jax.distributed on CUDA, Ray Data
     batches, the built-in loop and an orbax checkpoint, a ~100M Llama (the 125m shape with the run's trained 8k
     vocabulary) on the standard library's source, batch 16 x 1024, attention "auto". Tokens/s and MFU are the
     loop's own log-window figures, the first two windows dropped.
  3. `mfu_gpu.py` at stage 2's exact shape: the plain step (both attentions), and the loop's own step
     (`--step builtin`) bare. Loop / its own step is (a) on GPU; its own step / the plain one is what the loop's
     step computes beyond it.
  4. `mfu_gpu.py --sizes 1b --attention cudnn`: TinyLlama-1.1B shaped, batch 4 x 2048, then batch 8.
  5. `ray-jax-train fit` of the same config at ~1B (TinyLlama's shape, the trained 8k vocabulary, batch 8 x 2048,
     60 steps, no checkpoint): the loop at the second size.
`--loops-only` runs stages 0, 2 and 5. `--cpu-suite VARIANT...` runs none of them: only `suite.py`'s CPU variants
on that machine's idle cores (JAX on CPU), e.g. `--cpu-suite bare in_worker ours scale1 scale2` for (a) and (d).

    python benchmarks/gpu_session.py --out bench_out/gpu                  # a GPU machine with the stack installed
    python benchmarks/gpu_session.py --smoke --out /tmp/gpu_smoke          # CPU, tiny sizes: checks that it runs

A machine that lacks packages (a lent device machine has JAX and CUDA but no Ray) gets them as carried files:
`--site-wheels DIR...` unpacks every *.whl / *.zip in those folders onto PYTHONPATH; `--ours-wheels DIR` holds
the flax / optax / orbax versions this project pins, used when they import cleanly with the machine's JAX.
It writes OUT/gpu_session.json and OUT/gpu_session.md and asserts nothing about time.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MIN_STAGE_S = 10  # a stage given less is skipped: no model even compiles in that

SMOKE_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2)


def unpack(folders, target: str) -> list:
    """Unpack wheels (and zips laid out like one) into `target`, keeping file modes: Ray's binaries must stay executable."""
    os.makedirs(target, exist_ok=True)
    names = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.whl")) + glob.glob(os.path.join(folder, "*.zip"))):
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    written = archive.extract(info, target)
                    mode = (info.external_attr >> 16) & 0o777
                    if mode and not info.is_dir():
                        os.chmod(written, mode)
            names.append(os.path.basename(path))
    return names


def imports_cleanly(env: dict) -> bool:
    probe = ("import jax, flax.nnx, optax, orbax.checkpoint; "
             "print(jax.__version__, flax.__version__, optax.__version__, orbax.checkpoint.__version__)")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    print(f"  import check: rc {done.returncode} {done.stdout.strip()} {done.stderr.strip()[-300:]}", flush=True)
    return done.returncode == 0


def prepare_env(args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [ROOT]
    if args.site_wheels:
        site = "/tmp/gpu_session_site"
        print(f"unpacked {len(unpack(args.site_wheels, site))} carried packages into {site}", flush=True)
        paths.insert(0, site)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if args.ours_wheels:
        ours = "/tmp/gpu_session_ours"
        unpack(args.ours_wheels, ours)
        with_ours = dict(env, PYTHONPATH=os.pathsep.join([ours, env["PYTHONPATH"]]))
        if imports_cleanly(with_ours):
            print("using the carried flax / optax / orbax (this project's pins)", flush=True)
            return with_ours
        print("the carried flax / optax / orbax do not import with this JAX: using the machine's", flush=True)
    return env


def run_stage(name: str, cmd: list, env: dict, limit_s: float, log) -> dict:
    """Run `cmd`, streaming its output prefixed with the stage name; killed (its whole process group) at `limit_s`.

    A reader thread copies the output, so a child that hangs mid-line, or a grandchild left holding the pipe,
    cannot stretch the limit; what it printed before the kill is kept."""
    if limit_s < MIN_STAGE_S:
        print(f"\n=== {name}: skipped, the session's budget is spent", flush=True)
        return {"stage": name, "rc": None, "skipped": True}
    start = time.perf_counter()
    print(f"\n=== {name}: {' '.join(cmd)} (limit {limit_s:.0f} s)", flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)

    lines = []

    def copy_output():
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            lines.append(line)
            print(f"[{name}] {line}", end="" if line.endswith("\n") else "\n", flush=True)
            log.write(f"[{name}] {line}")

    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    try:
        rc, timed_out = proc.wait(timeout=limit_s), False
    except subprocess.TimeoutExpired:
        rc, timed_out = None, True
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # on a timeout the stage; otherwise whatever it left running
    except ProcessLookupError:
        pass
    rc = proc.wait() if rc is None else rc
    reader.join(timeout=5)
    seconds = time.perf_counter() - start
    print(f"=== {name}: rc {rc}{' (timed out)' if timed_out else ''} after {seconds:.0f} s", flush=True)
    return {"stage": name, "rc": rc, "timed_out": timed_out, "seconds": round(seconds, 1), "output": lines}


def stage_status(result: dict) -> str:
    if result.get("skipped"):
        return "skipped: the session's budget was spent"
    return f"rc {result['rc']}" + (", timed out" if result.get("timed_out") else "")


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# The loop at ~1B: TinyLlama-1.1B's shape (with the run's trained 8k vocabulary), batch 8 x 2048, no checkpoint
# or export (the 13 GB train state would time the disk, not the loop).
LOOP_1B_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, max_position_embeddings=2048)
LOOP_1B_TRAINING = dict(batch_size=8, max_sequence_length=2048, total_steps=60, log_steps=10, save_steps=None,
                        save_final_model=False)


def lm_config(args, storage: str, attention: str = "auto", size: str = "125m") -> dict:
    """examples/llama_125m_gpu.yaml, the config a GPU user starts from, with this session's storage and steps
    (and, for --smoke, a tiny CPU model)."""
    import yaml

    with open(os.path.join(ROOT, "examples", "llama_125m_gpu.yaml")) as f:
        config = yaml.safe_load(f)
    config["run"].update(name="gpu-lm", storage_path=storage)
    config["model"]["attention_impl"] = attention
    config["training"].update(total_steps=args.lm_steps, save_steps=args.lm_steps, log_steps=args.lm_log_steps)
    if size == "1b":
        config["run"]["name"] = "gpu-lm-1b"
        config["model"].update(LOOP_1B_MODEL)
        config["training"].update(LOOP_1B_TRAINING)
    if args.smoke:
        config["model"].update(SMOKE_SHAPE, max_position_embeddings=64, dtype="float32")
        config["data"]["max_docs"] = 40
        config["tokenizer"]["vocab_size"] = 300
        config["training"].update(total_steps=12, save_steps=12, batch_size=4, max_sequence_length=32, log_steps=2)
        config["scaling"]["use_gpu"] = False
    return config


def loop_figures(run_dir: str, skip_windows: int = 2) -> dict:
    """Median tokens/s and MFU over the loop's log windows, the first `skip_windows` (compile, warm-up) left out."""
    records = []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return {}
    windows = [r for r in records if "tokens_per_s" in r]
    steady = windows[skip_windows:] or windows
    if not steady:
        return {}
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {
        "windows": len(steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "tokens_per_s_min": min(r["tokens_per_s"] for r in steady),
        "tokens_per_s_max": max(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(mfus) if mfus else None,
        "startup_s": next((r["startup_s"] for r in records if "startup_s" in r), None),
        "first_loss": next((r["loss"] for r in records if "loss" in r), None),
        "last_loss": next((r["loss"] for r in reversed(records) if "loss" in r), None),
        "checkpoints": sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "checkpoint_*"))),
        "final_model": os.path.isfile(os.path.join(run_dir, "final_model", "config.json")),
    }


def report_lines(report: dict) -> list:
    lines = [f"# GPU session: {report['device'] or 'unknown device'}", "", f"{report['versions']}", ""]
    check = report.get("attention_check") or {}
    if check.get("results"):
        impl = check["results"][0].get("implementation", "cudnn")
        lines += [f"Fused attention ({impl}) against the materialised one (relative error vs float32, fused / "
                  "materialised): "
                  + "; ".join(f"{r['case']} " + (f"out {r['out_vs_f32']:.4f} / {r['materialised_out_vs_f32']:.4f}, "
                                                  f"grads {r['grads_vs_f32']:.4f} / {r['materialised_grads_vs_f32']:.4f}"
                                                  if "out" in r else r.get("error", "failed"))
                              + ("" if r.get("ok") else " (NOT OK)") for r in check["results"]), ""]
    else:
        lines += [f"Fused attention check: not measured ({report['stages'].get('attention_check', 'not run')})", ""]
    lines += ["| what | size | batch x seq | attention | tokens/s | MFU |", "| --- | --- | --- | --- | --- | --- |"]
    for key, label in (("bare_125m", "bare step"), ("loop", "built-in loop, JaxTrainer, 1 GPU worker"),
                       ("bare_same_shape", "bare step, the loop's shape"),
                       ("builtin_same_shape", "the loop's own step, bare, its shape"), ("bare_1b", "bare step"),
                       ("bare_1b_b8", "bare step"), ("loop_1b", "built-in loop, ~1B, JaxTrainer, 1 GPU worker")):
        measured = report.get(key) or []
        rows = [r for r in (measured if isinstance(measured, list) else [measured]) if r.get("tokens_per_s")]
        if not rows:
            lines.append(f"| {label} | — | — | — | not measured ({report['stages'].get(key, 'not run')}) | — |")
        for r in rows:
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            size = f"{r['params'] / 1e6:.0f}M" if r.get("params") else r.get("size", "")
            shape = f"{r.get('batch', '')} x {r.get('seq', '')}"
            lines.append(f"| {label} | {size} | {shape} | {r.get('attention', '?')} | {r['tokens_per_s']:,.0f} | {mfu} |")
    ratios = (("loop_over_bare", "built-in loop / bare step"), ("builtin_over_bare", "the loop's step / bare step"),
              ("loop_over_builtin", "built-in loop / its own step, bare"))
    if any(report.get(key) for key, _ in ratios):
        lines += ["", "At the loop's shape: " + "; ".join(f"{label} {report[key]:.3f}" for key, label in ratios
                                                          if report.get(key)) + "."]
    return lines


def cpu_suite(args, env: dict, remaining) -> int:
    """The CPU suite's variants on a machine with many idle cores, written to OUT/cpu_suite."""
    out = os.path.join(args.out, "cpu_suite")
    cmd = [sys.executable, os.path.join(HERE, "suite.py"), "--out", out, "--no-checkpoint", "--rounds",
           str(args.cpu_suite_rounds), "--machine", f"{os.cpu_count()}-core device machine, JAX on CPU"]
    cmd += ["--smoke"] if args.smoke else []
    # A hidden GPU: Ray would otherwise count it, and JAX's CUDA plugin would start beside the CPU client.
    cpu_env = dict(env, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    with open(os.path.join(args.out, "gpu_session.log"), "w", buffering=1) as log:
        result = run_stage("cpu suite", cmd + ["--variants", *args.cpu_suite], cpu_env, remaining(), log)
    return 0 if result.get("rc") == 0 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the script runs")
    parser.add_argument("--site-wheels", nargs="*", default=[], help="folders of wheels to unpack onto PYTHONPATH")
    parser.add_argument("--ours-wheels", nargs="*", default=[], help="folders with this project's flax/optax/orbax")
    parser.add_argument("--budget-s", type=float, default=470, help="all stages together end within this")
    parser.add_argument("--lm-steps", type=int, default=200)
    parser.add_argument("--lm-log-steps", type=int, default=20, help="the ~100M loop's log window, in steps")
    parser.add_argument("--profile-loop", action="store_true",
                        help="only the ~100M loop, 150 steps, with a jax.profiler trace of steps 100-104 in OUT/loop_profile.xplane.pb")
    parser.add_argument("--loops-only", action="store_true",
                        help="the attention check and the two `fit` runs (~100M, ~1B) only: no bare steps")
    parser.add_argument("--cpu-suite", nargs="+", metavar="VARIANT",
                        help="only `suite.py --variants VARIANT...` on this machine's CPUs (JAX_PLATFORMS=cpu): "
                             "(a) and (d) where Ray's own processes have cores to spare, unlike the 2-core CI VM")
    parser.add_argument("--cpu-suite-rounds", type=int, default=3)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    began = time.perf_counter()
    remaining = lambda: args.budget_s - (time.perf_counter() - began)  # noqa: E731
    env = prepare_env(args)
    if args.cpu_suite:
        return cpu_suite(args, env, remaining)
    if args.smoke:
        env.setdefault("JAX_PLATFORMS", "cpu")
    py = sys.executable
    mfu = os.path.join(HERE, "mfu_gpu.py")
    stages, report = {}, {"smoke": args.smoke}
    with open(os.path.join(args.out, "gpu_session.log"), "w", buffering=1) as log:
        probe = ("import jax, flax, optax, orbax.checkpoint as o, ray, pydantic; d = jax.devices()[0]; "
                 "print(d.device_kind, '|', f'jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, "
                 "orbax {o.__version__}, ray {ray.__version__}, pydantic {pydantic.VERSION}, '"
                 "f'{jax.device_count()} device(s)')")
        done = subprocess.run([py, "-c", probe], env=env, capture_output=True, text=True, timeout=180)
        print(done.stdout, done.stderr[-2000:], flush=True)
        device, _, versions = done.stdout.strip().rpartition("\n")[-1].partition(" | ")
        report.update(device=device.strip(), versions=versions.strip())

        # The bare steps run alone on the GPU, so they may have most of it.
        bare_env = dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"))

        def bare(key, name, extra, limit, script=mfu):
            out = os.path.join(args.out, f"{key}.json")
            if os.path.exists(out):  # an earlier session's figures must not pass for this one's
                os.remove(out)
            result = run_stage(name, [py, script, "--out", out] + extra, bare_env, min(limit, remaining()), log)
            stages[key] = stage_status(result)
            measured = read_json(out)
            report[key] = (measured[0] if len(measured) == 1 else measured) if isinstance(measured, list) else measured

        smoke = ["--smoke"] if args.smoke else []
        # The smoke run checks the fused path's plumbing through XLA's implementation (CPU has no cuDNN).
        if not args.profile_loop:
            bare("attention_check", "attention check", ["--implementation", "xla" if args.smoke else "cudnn"], 60,
                 script=os.path.join(HERE, "attention_check.py"))
        checked = (report.get("attention_check") or {}).get("results") or []
        fused_ok = bool(checked) and all(r.get("ok") for r in checked)
        storage = os.path.abspath(os.path.join(args.out, "runs") if args.smoke else "/tmp/gpu_session_runs")

        def fit(key, config, limit):
            """`ray-jax-train fit` of `config`; its log-window figures, and the attention it says it used."""
            path = os.path.join(args.out, f"{key}.config.json")
            with open(path, "w") as f:
                json.dump(config, f, indent=2)
            run_dir = os.path.join(storage, config["run"]["name"])
            shutil.rmtree(run_dir, ignore_errors=True)  # else a rerun resumes the finished run and trains nothing
            result = run_stage(key, [py, "-m", "ray_jax_train.cli", "fit", path], env, min(limit, remaining()), log)
            stages[key] = stage_status(result)
            figures = loop_figures(run_dir, skip_windows=1 if args.smoke else 2)
            if figures:
                said = [m.group(1) for m in map(re.compile(r"Attention: (\w+)").search, result["output"]) if m]
                figures.update(batch=config["training"]["batch_size"], seq=config["training"]["max_sequence_length"],
                               attention=said[0] if said else None)
            report[key] = figures or None
            if not args.smoke and os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
                shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(args.out, f"{key}_metrics.jsonl"))
            return run_dir

        if args.profile_loop:
            # A trace of 5 steady-state steps of the loop, brought back to be read off the device machine
            # (`jax.profiler.ProfileData`): where the ~6% between the loop and its own step goes.
            config = lm_config(args, storage, attention="auto")
            config["training"].update(total_steps=150, save_steps=None, save_final_model=False,
                                      profile_start_step=100, profile_num_steps=5)
            run_dir = fit("loop", config, 170)
            # Flat in OUT: the device tool brings back no file nested deeper than a few folders.
            for found in glob.glob(os.path.join(run_dir, "profile", "**", "*.xplane.pb"), recursive=True):
                if os.path.getsize(found) < 16 << 20:  # the largest file the device tool brings back
                    shutil.copy(found, os.path.join(args.out, "loop_profile.xplane.pb"))
                # Read there too: the trace may be too large to come back.
                summary = run_stage("trace summary", [py, os.path.join(HERE, "trace_summary.py"), "--gpu",
                                                      os.path.dirname(found)], env, min(60, remaining()), log)
                with open(os.path.join(args.out, "loop_profile_summary.txt"), "w") as f:
                    f.writelines(summary.get("output") or [])
            args.loops_only = True
        elif not fused_ok and not args.smoke:
            print("the fused attention check failed or did not run: every stage uses attention_impl=xla", flush=True)
        both = ["--attention", "cudnn", "xla"] if fused_ok and not args.smoke else ["--attention", "xla"]
        attention = "auto" if fused_ok or args.smoke else "xla"
        if not args.loops_only:
            bare("bare_125m", "mfu 125m", smoke + both if smoke else ["--sizes", "125m", "--steps", "20"] + both, 130)

        if not args.profile_loop:
            run_dir = fit("loop", lm_config(args, storage, attention=attention), 220)
        loop = report.get("loop") or {}
        model_config = read_json(os.path.join(run_dir, "final_model", "config.json")) or {}
        loop["vocab_size"] = model_config.get("vocab_size")
        if args.loops_only:
            pass
        elif model_config.get("vocab_size"):
            shape = smoke + ["--vocab", str(model_config["vocab_size"])]
            if args.smoke:
                shape += ["--batch", str(lm_config(args, storage)["training"]["batch_size"])]
            else:
                # As many steps as the loop's windows span: an H200's clock sags under sustained load (session 29:
                # the loop's own step 536k tokens/s over 20 steps, 525k over 200, 523k over 20 right after).
                shape += ["--sizes", "125m", "--batch", "16", "--seq", "1024", "--steps", str(args.lm_steps)]
            bare("builtin_same_shape", "the loop's own step, bare", shape + ["--step", "builtin"], 70)
            bare("bare_same_shape", "bare at the loop's shape", shape + both, 90)
            builtin = report.get("builtin_same_shape") or {}
            same_all = report.get("bare_same_shape") or []
            # Like for like: the plain step with the attention the loop's own step (and the loop) resolved to.
            same = next((r for r in (same_all if isinstance(same_all, list) else [same_all])
                         if r.get("attention") == builtin.get("attention")), {})
            loop["params"] = same.get("params") or builtin.get("params")
            # loop / plain = builtin / plain (what the loop's step computes beyond a minimal one) x loop / builtin
            # (Ray, the data path and the loop around the same step)
            for key, (num, den) in {"loop_over_bare": (loop, same), "builtin_over_bare": (builtin, same),
                                    "loop_over_builtin": (loop, builtin)}.items():
                if num.get("tokens_per_s") and den.get("tokens_per_s"):
                    report[key] = num["tokens_per_s"] / den["tokens_per_s"]
        else:
            stages["bare_same_shape"] = "not run: the loop wrote no final model"

        if not args.smoke and not args.loops_only:
            # Batch 4 as in session 26 (materialised attention: 23,795 tokens/s), then 8, which fused attention's
            # smaller footprint may allow without remat.
            bare("bare_1b", "mfu 1b", ["--sizes", "1b", "--batch", "4", "--steps", "10", "--attention", both[1]], 100)
            bare("bare_1b_b8", "mfu 1b batch 8", ["--sizes", "1b", "--batch", "8", "--steps", "10",
                                                  "--attention", both[1]], 100)
        if not args.smoke and not args.profile_loop:
            fit("loop_1b", lm_config(args, storage, attention=attention, size="1b"), 240)
    report["stages"] = stages
    with open(os.path.join(args.out, "gpu_session.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = report_lines(report)
    with open(os.path.join(args.out, "gpu_session.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines), flush=True)
    return 0 if report.get("loop") else 1


if __name__ == "__main__":
    sys.exit(main())
