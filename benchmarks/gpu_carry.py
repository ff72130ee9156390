"""Build the package folders that a lent GPU machine needs to run `benchmarks/gpu_session.py`.

That machine's image has JAX for CUDA, flax, optax, orbax, transformers and tokenizers, but not Ray, pydantic or
datasets, and it cannot reach a package index. This downloads (here, where pip works) Linux x86-64 CPython wheels
at the versions this interpreter has installed:
  .whl/       Ray's Python dependencies the image lacks, pydantic, datasets
  .whl_ray/   Ray itself, as ray-pruned.zip: its wheel (79 MB) is over the 64 MiB a call may carry, so the Java
              jars and the rllib / serve / llm / cpp packages (unused by Ray Train) are left out, about 43 MB
  .whl_ours/  this project's flax / optax / orbax pins, used there when they import with the image's JAX
Each folder is git-ignored through .git/info/exclude. Then, on the device machine:

    python3 benchmarks/gpu_session.py --site-wheels .whl .whl_ray --ours-wheels .whl_ours --out $OUT

with `carry: [".whl", ".whl_ray", ".whl_ours"]`.

    python benchmarks/gpu_carry.py [--python-version 3.12]
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a `ray-jax-train fit` imports, driver and workers, that the image (its package list, 2026-11) lacks.
MISSING_FROM_IMAGE = (
    "aiohttp-cors", "annotated-types", "colorful", "datasets", "dill", "google-api-core", "google-auth",
    "googleapis-common-protos", "httpcore2", "httpx2", "jsonpointer", "jsonschema", "jsonschema-specifications",
    "multiprocess", "opencensus", "opencensus-context", "opentelemetry-api", "opentelemetry-exporter-prometheus",
    "opentelemetry-proto", "opentelemetry-sdk", "opentelemetry-semantic-conventions", "pydantic", "pydantic_core",
    "referencing", "rfc3339-validator", "rpds-py", "smart_open", "tensorboardX", "truststore", "typing-inspection",
)
OURS = ("flax", "optax", "orbax-checkpoint")
RAY_LEFT_OUT = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/cpp/")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")


def download(names, folder: str, python_version: str) -> None:
    pins = [f"{name}=={metadata.version(name)}" for name in names]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "-d", folder, "-q"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)


def prune_ray(wheel: str, out: str) -> None:
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if not info.filename.startswith(RAY_LEFT_OUT):
                dst.writestr(info, src.read(info.filename))  # the ZipInfo keeps each file's mode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the device machine's Python (default 3.12)")
    args = parser.parse_args(argv)
    folders = {name: os.path.join(ROOT, name) for name in (".whl", ".whl_ray", ".whl_ours")}
    for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    exclude = os.path.join(ROOT, ".git", "info", "exclude")
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    listed = open(exclude).read().split() if os.path.exists(exclude) else []
    with open(exclude, "a") as f:
        f.writelines(f"/{name}/\n" for name in folders if f"/{name}/" not in listed)
    download(MISSING_FROM_IMAGE, folders[".whl"], args.python_version)
    download(OURS, folders[".whl_ours"], args.python_version)
    with tempfile.TemporaryDirectory() as tmp:
        download(["ray"], tmp, args.python_version)
        prune_ray(glob.glob(os.path.join(tmp, "ray-*.whl"))[0], os.path.join(folders[".whl_ray"], "ray-pruned.zip"))
    for name, folder in folders.items():
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        print(f"{name}: {len(os.listdir(folder))} file(s), {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
