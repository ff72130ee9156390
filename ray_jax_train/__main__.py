"""`python -m ray_jax_train ...` is the `ray-jax-train` command."""
from ray_jax_train.cli import run_main

run_main()
