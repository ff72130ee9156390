"""Session 37's device A/B: the built-in step before/after the float32 embedding-gradient change (the old
package was unpacked into ab_tmp/old/ beside it for the call; kept here as the record of how the figures were made)."""
import json, os, subprocess, sys, time, types
sys.path.insert(0, "benchmarks")
import gpu_session as G

smoke = bool(os.environ.get("SMOKE"))
env = G.prepare_env(types.SimpleNamespace(site_wheels=[] if smoke else [".whl", ".whl_ray"],
                                          ours_wheels=[] if smoke else [".whl_ours"]))
root, out = G.ROOT, os.environ["OUT"]
old_path = os.path.join(root, "ab_tmp", "old")
jobs = []
for i in (1, 2):
    for v in ("old", "new") if i == 1 else ("new", "old"):
        jobs.append((f"{v}_125m_{i}", v, ["--sizes", "125m", "--steps", "30", "--warmup", "5"]))
for v in ("old", "new"):
    jobs.append((f"{v}_1b", v, ["--sizes", "1b", "--batch", "4", "--steps", "10", "--warmup", "3"]))
for name, variant, extra in jobs:
    if smoke:
        extra = ["--smoke"]
    pp = env["PYTHONPATH"] if variant == "new" else env["PYTHONPATH"].replace(root, old_path)
    cmd = [sys.executable, "benchmarks/mfu_gpu.py", *extra, "--step", "builtin", "--attention",
           "cudnn" if not smoke else "xla", "--out", os.path.join(out, name + ".json")]
    t = time.time()
    probe = subprocess.run([sys.executable, "-c", "import ray_jax_train.models.llama as L, inspect; "
                            "print('float32 view' in inspect.getsource(L._embed_lookup), L.__file__)"],
                           env=dict(env, PYTHONPATH=pp), capture_output=True, text=True)
    print(name, "probe:", probe.stdout.strip(), probe.stderr.strip()[-200:], flush=True)
    try:
        done = subprocess.run(cmd, env=dict(env, PYTHONPATH=pp), capture_output=True, text=True, timeout=150)
        tail = (done.stdout + done.stderr)[-600:]
    except subprocess.TimeoutExpired:
        tail = "TIMEOUT"
    print(f"== {name} {time.time() - t:.0f}s\n{tail}", flush=True)
    try:
        r = json.load(open(os.path.join(out, name + ".json")))[0]
        print(f"RESULT {name} tokens/s {r['tokens_per_s']:.0f} mfu {r.get('mfu') or 0:.4f} step {r['step_s_median']:.4f} "
              f"loss {r['final_loss']:.4f} peak_bytes {r['peak_bytes_in_use']}", flush=True)
    except Exception as exc:
        print("no result", exc, flush=True)
