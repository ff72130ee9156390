"""Tune: 4 short trials (2 at a time) of JaxTrainer fits reported through TuneReportCallback, ASHA stopping the
weak ones early, and the best trial's checkpoint restored into this process.

The search runs through `ray-jax-train tune` in a subprocess with its own private Ray (and dashboard): Train's
placement-group cleanup after a trial is stopped needs the state API, which the session cluster does not serve.
"""
import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ray_jax_train.run_config import ScalingSection, jax_config_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fractional_gpus_turn_off_preallocation():
    """Trials sharing a GPU: no preallocation, each capped below its share (unless set explicitly)."""
    env = jax_config_for(ScalingSection(use_gpu=True, gpus_per_worker=0.25)).worker_env()
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(0.2375)
    explicit = jax_config_for(ScalingSection(use_gpu=True, gpus_per_worker=0.5, gpu_memory_fraction=0.3,
                                             gpu_memory_preallocate=True)).worker_env()
    assert explicit["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3000"
    assert explicit["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    whole = jax_config_for(ScalingSection(use_gpu=True)).worker_env()
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in whole


def test_the_best_trial_is_one_that_finished_and_asha_runs_to_the_longest_searched_trial(tmp_path):
    """Ray's get_best_result ranked failed trials too: a trial stopped by the NaN check after one good report
    won the search. ASHA's max_t came from the base total_steps, and cut the longer searched trials short."""
    from ray.train import Result

    from ray_jax_train.tune import _longest_trial, _scheduler, best_result

    def result(loss, error=None):
        return Result(metrics={"loss": loss, "step": 4}, checkpoint=None, error=error, path=str(tmp_path))

    diverged = result(2.0, error=RuntimeError("NonFiniteLossError: Step 3 gave loss nan"))
    trials = [result(2.5), diverged, result(float("nan")), result(2.7)]
    assert best_result(trials, "loss", "min").metrics["loss"] == 2.5
    assert best_result(trials, "loss", "max").metrics["loss"] == 2.7
    assert best_result([diverged], "loss", "min") is None
    assert best_result([result(1.0)], "eval_loss", "min") is None  # never reported

    assert _longest_trial(4, {"training.total_steps": {"grid_search": [4, 16]}}) == 16
    assert _longest_trial(4, {"training.total_steps": {"randint": [8, 21]}}) == 20
    assert _longest_trial(4, {"training.total_steps": 12, "training.learning_rate": {"choice": [1e-3]}}) == 12
    assert _longest_trial(4, {"training.learning_rate": {"choice": [1e-3]}}) == 4
    from ray_jax_train.run_config import parse_config

    asha = parse_config({"training": {"total_steps": 4},
                         "tune": {"param_space": {"training.total_steps": {"grid_search": [4, 16]}}}}).tune
    assert _scheduler(asha, _longest_trial(4, asha.param_space))._max_t == 17  # one past the last step
    capped = asha.model_copy(update={"scheduler": asha.scheduler.model_copy(update={"max_t": 16})})
    assert _scheduler(capped, 16)._max_t == 17  # at the last step itself, the final checkpoint was never reported
    capped = asha.model_copy(update={"scheduler": asha.scheduler.model_copy(update={"max_t": 8})})
    assert _scheduler(capped, 16)._max_t == 8


def test_search_stops_weak_trials_and_restores_the_best(tmp_path):
    from ray_jax_train.tune import restore_best

    # Without the test session's JAX_COMPILATION_CACHE_DIR: the search's own default cache is under test.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "JAX_COMPILATION_CACHE_DIR")}
    done = subprocess.run(
        [sys.executable, "-m", "ray_jax_train", "tune", os.path.join(REPO, "examples", "tune_tiny_llama.yaml"),
         "--set", f"run.storage_path={tmp_path}", "--set", "data.max_docs=30", "--address", "local"],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "=== ray-jax-train: search done ===" in done.stdout and "trials:      4 (0 failed" in done.stdout

    experiment = tmp_path / "tune-tiny-llama"
    last_steps, cache_hits = {}, []
    for result in glob.glob(str(experiment / "trial_*" / "result.json")):
        lines = [json.loads(line) for line in open(result) if line.strip()]
        last_steps[lines[-1]["config"]["training"]["learning_rate"]] = lines[-1]["step"]
        cache_hits.append(lines[0]["compilation_cache_hits"])  # the first record carries the start-up facts
    assert len(last_steps) == 4
    # The trials share one compilation cache in the search's directory, and a learning rate changes no program:
    # the two trials that start after the first pair load the state's init programs and the train step (5) instead
    # of compiling them.
    assert any((experiment / "compilation_cache").iterdir())
    assert sorted(cache_hits)[-2] >= 5, cache_hits
    assert max(last_steps.values()) == 4, last_steps  # the best trained to the end ...
    assert min(last_steps.values()) < 4, last_steps  # ... and ASHA stopped at least one trial early

    best = json.loads((experiment / "best.json").read_text())
    assert best["config"]["training"]["learning_rate"] in (3e-3, 1e-3), last_steps
    assert best["checkpoint"] and os.path.isdir(best["checkpoint"])
    assert os.path.isfile(os.path.join(best["run_dir"], "metrics.jsonl"))
    params = restore_best(str(experiment))
    leaves = jax.tree.leaves(params)
    assert any(x.ndim == 2 and 32 in x.shape for x in leaves)
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
