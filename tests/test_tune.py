"""Tune: 4 short trials (2 at a time) of JaxTrainer fits reported through TuneReportCallback, ASHA stopping the
weak ones early, and the best trial's checkpoint restored into this process. One search, on the session cluster."""
import os

import jax
import numpy as np
import pytest

from ray_jax_train.run_config import ScalingSection, jax_config_for, read_file

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


def test_search_stops_weak_trials_and_restores_the_best(ray_cluster, tmp_path):
    from ray_jax_train import tune

    data = read_file(os.path.join(REPO, "examples", "tune_tiny_llama.yaml"))
    data["run"]["storage_path"] = str(tmp_path)
    data["data"]["max_docs"] = 30
    outcome = tune.run(data)

    results = list(outcome.results)
    assert len(results) == 4 and not [r.error for r in results if r.error]
    iterations = sorted(r.metrics["training_iteration"] for r in results)
    assert iterations[-1] == 4  # the best ran all its 4 reports ...
    assert iterations[0] < 4, iterations  # ... and ASHA stopped at least one trial early
    lrs = {r.metrics["trial_id"]: r.config["training"]["learning_rate"] for r in results}
    assert outcome.best_config.training["learning_rate"] in (3e-3, 1e-3), lrs
    assert outcome.best_metrics["loss"] == min(r.metrics["loss"] for r in results)

    # The best trial's own Train run: metrics, final model, and a checkpoint that restores here.
    assert os.path.isfile(os.path.join(outcome.best_run_dir, "metrics.jsonl"))
    assert outcome.best_checkpoint and os.path.isdir(outcome.best_checkpoint)
    params = outcome.restore_best_params()
    embedding = [x for x in jax.tree.leaves(params) if x.ndim == 2 and x.shape[1] == 32]
    assert embedding and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
