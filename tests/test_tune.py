"""Tune: 3 short trials (2 at a time) of JaxTrainer fits reported through TuneReportCallback, ASHA stopping the
weak ones early, and the best trial's checkpoint restored into this process; a search interrupted for real and
resumed.

The searches run through `ray-jax-train tune` in a subprocess with its own private Ray (and dashboard): Train's
placement-group cleanup after a trial is stopped needs the state API, which the session cluster does not serve.
"""
import copy
import dataclasses
import glob
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

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

    from ray_jax_train.run_config import trial_lengths
    from ray_jax_train.tune import _scheduler, best_result

    def _longest_trial(base, space):
        return trial_lengths(base, space)[0]

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
    # null: that trial runs by epochs, a length the driver cannot know (it raised a TypeError).
    assert trial_lengths(None, {"training.total_steps": {"choice": [None, 8]}}) == (8, True)
    assert trial_lengths(None, {}) == (0, True)
    from ray_jax_train.run_config import parse_config

    asha = parse_config({"training": {"total_steps": 4},
                         "tune": {"param_space": {"training.total_steps": {"grid_search": [4, 16]}}}}).tune
    assert _scheduler(asha, _longest_trial(4, asha.param_space))._max_t == 17  # one past the last step
    capped = asha.model_copy(update={"scheduler": asha.scheduler.model_copy(update={"max_t": 16})})
    assert _scheduler(capped, 16)._max_t == 17  # at the last step itself, the final checkpoint was never reported


def test_a_trial_stopped_early_wins_only_when_none_trained_to_the_end_and_brings_its_latest_checkpoint(tmp_path):
    """A review: the only complete trial failed, and one ASHA stopped at step 8 of 60 was "best", its checkpoint
    read from its last report only (none: it saved at step 5), with the hint "set training.save_steps" though set."""
    import pandas as pd
    from ray.tune import Result  # what Tune's ResultGrid holds

    from ray_jax_train.run_config import parse_config
    from ray_jax_train.tune import TuneOutcome, best_result, best_warning, latest_checkpoint, trained_to_end

    def result(loss, step, error=None, checkpoints=(), **training):
        reports = [{"step": s, "checkpoint_path": c} for s, c in checkpoints] + [{"step": step}]
        metrics = {"loss": loss, "step": step, "trial_id": f"t{step}", "config": {"training": training}}
        return Result(metrics=metrics, checkpoint=None, error=error, path=str(tmp_path),
                      metrics_dataframe=pd.DataFrame(reports))

    stopped = result(5.7, 8, checkpoints=[(5, "/runs/s-t8/checkpoint_5")])
    failed = result(4.8, 26, error=RuntimeError("WorkerHealthCheckFailedError"))
    assert best_result([failed, stopped], "loss", "min", 60) is stopped  # the fallback, which the caller flags
    assert "no trial trained to the end" in best_warning(stopped, 1, 2, 60) and "--resume-errored" in best_warning(
        stopped, 1, 2, 60)
    # A finished best beside a failed trial (its actor lost, say): that one might have won, and nothing said so.
    assert best_warning(result(5.0, 60), 1, 3, 60).startswith("1 of 3 trials failed, so the best is of the rest")
    # ... and a resume does not mend a trial whose own sampled settings were refused (a CLI review: it advised one).
    assert "settings were refused, see its error above, fails the same way again" in best_warning(
        result(5.0, 60), 1, 3, 60)
    assert best_warning(result(5.0, 60), 0, 3, 60) is None
    assert not trained_to_end(stopped, 60)
    finished, better_but_stopped = result(5.0, 60), result(4.0, 30)
    assert best_result([better_but_stopped, finished, stopped], "loss", "min", 60) is finished
    longer = result(4.5, 40, total_steps=40)  # a searched total_steps is the trial's own end
    assert trained_to_end(longer, 60) and best_result([longer, finished], "loss", "min", 60) is longer
    assert trained_to_end(result(5.0, 8), None)  # by epochs: its length is unknown, so it counts as complete
    assert latest_checkpoint(stopped) == "/runs/s-t8/checkpoint_5"
    assert latest_checkpoint(result(5.0, 60, checkpoints=[(5, "/c5"), (10, "/c10")])) == "/c10"
    assert latest_checkpoint(result(5.0, 3)) is None

    def outcome(step, **training):
        config = parse_config({"training": {"total_steps": 60, **training}})
        return TuneOutcome(results=None, best_config=config, best_metrics={"step": step}, best_checkpoint=None,
                           best_run_dir="/runs/s-t", tokenizer_path="", metric="loss", mode="min")

    assert "save_steps is not set" in outcome(8).no_checkpoint_reason()
    reason = outcome(3, save_steps=5).no_checkpoint_reason()
    assert reason == "it ended at step 3, before its first save at step 5 (training.save_steps)", reason
    with pytest.raises(FileNotFoundError, match=r"ended at step 3, before its first save.*run directory: /runs/s-t"):
        outcome(3, save_steps=5).restore_best_params()
    gone = dataclasses.replace(outcome(60), best_checkpoint=str(tmp_path / "checkpoint_60_deleted"))
    with pytest.raises(FileNotFoundError, match=r"checkpoint_60_deleted no longer exists.*ray-jax-train export "):
        gone.restore_best_params()  # a best.json naming a checkpoint deleted by hand (a deletion review)

    # Tune retries a failed trial for a lost actor; one whose training failed fails again at once, in this search
    # call only (a resume with --resume-errored trains it again).
    from ray_jax_train.tune import record_trial_failure, refuse_a_failed_trial_again

    run_dir = str(tmp_path / "search-t1")
    refuse_a_failed_trial_again(run_dir, "call-1")  # nothing recorded: it trains
    record_trial_failure(run_dir, "call-1", FloatingPointError("loss is nan at step 7"))
    with pytest.raises(RuntimeError, match=r"FloatingPointError: loss is nan at step 7 \(this trial's training failed"):
        refuse_a_failed_trial_again(run_dir, "call-1")
    refuse_a_failed_trial_again(run_dir, "call-2")


def test_trials_that_together_hold_the_cpus_their_workers_need_are_refused(monkeypatch):
    """A review: 2 trials at once, each holding 0.1 CPU, left 3.8 of 4 CPUs for a 3.85-CPU worker, and the search hung
    silently for ever; only one trial's process was counted."""
    import ray

    from ray_jax_train.run_config import ConfigError, ScalingSection, check_cluster_fits

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0}}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    big = ScalingSection(num_workers=1, cpus_per_worker=3.85)
    check_cluster_fits(big, trial_cpus=0.1, concurrent_trials=1)
    with pytest.raises(ConfigError, match=r"the search would hang.*Set tune.max_concurrent_trials to 1, or "
                                          r"lower scaling.cpus_per_worker"):
        check_cluster_fits(big, trial_cpus=0.1, concurrent_trials=2)
    # 40 trials without max_concurrent_trials: 30 processes leave a 1-CPU worker its CPU, 31 do not.
    with pytest.raises(ConfigError, match=r"max_concurrent_trials to 30 or less"):
        check_cluster_fits(ScalingSection(num_workers=1), trial_cpus=0.1, concurrent_trials=40)
    check_cluster_fits(ScalingSection(num_workers=1), trial_cpus=0.1, concurrent_trials=30)
    # More trial processes than fit at all: the rest wait for a CPU, not on each other.
    check_cluster_fits(ScalingSection(num_workers=1, cpus_per_worker=1), trial_cpus=1.5, concurrent_trials=4)
    with pytest.raises(ConfigError, match=r"scaling.num_workers=2 can never be placed"):  # as before: one trial
        check_cluster_fits(ScalingSection(num_workers=2, cpus_per_worker=2), trial_cpus=0.1, concurrent_trials=3)


def test_a_worker_already_dead_at_shutdown_is_no_traceback(monkeypatch, caplog):
    """A review: Ctrl-C on `tune` printed 24 lines of ActorDiedError from on_shutdown's jax.distributed shutdown,
    of workers that had died with their owner."""
    import ray
    from ray.exceptions import ActorDiedError

    from ray_jax_train.backend import JaxConfig, _JaxBackend

    class Group:
        def execute_async(self, fn):
            return fn.__name__

    def get(what, timeout=None):
        if what == "_shutdown_worker":
            raise ActorDiedError()
        return None

    monkeypatch.setattr(ray, "get", get)
    with caplog.at_level(logging.DEBUG, logger="ray_jax_train.backend"):
        _JaxBackend().on_shutdown(Group(), JaxConfig(shutdown_timeout_s=1))
    assert "a worker is gone" in caplog.text


def test_a_changed_resume_is_refused_before_ray_starts_and_a_moved_one_warned_once(tmp_path, monkeypatch, capsys,
                                                                                   caplog):
    """A review: in Python, `tune.run(..., resume=True)` with a changed config started Ray (8 s, log lines) before it
    refused; and `tune --resume` printed the "other scaling.* than it started with" warning twice."""
    import ray
    import yaml

    import ray_jax_train.cli
    import ray_jax_train.trainer
    from ray_jax_train import tune
    from ray_jax_train.run_config import ConfigError, parse_config

    tiny = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    tiny["run"] = {"storage_path": str(tmp_path)}
    search_dir = tmp_path / tiny["tune"]["name"]
    search_dir.mkdir()
    (search_dir / "tuner.pkl").write_bytes(b"")  # what Tuner.can_restore looks for
    (search_dir / tune.SEARCH_CONFIG).write_text(json.dumps(tune._comparable(parse_config(tiny).with_absolute_paths())))

    class RayStarted(Exception):
        pass

    def init_ray(**_):
        raise RayStarted

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_jax_train.trainer, "init_ray", init_ray)
    with pytest.raises(ConfigError, match=r"started with another config \(training.weight_decay"):
        tune.run(tiny, overrides=["training.weight_decay=0.5"], resume=True)

    moved = tmp_path / "moved.yaml"
    moved.write_text(yaml.safe_dump({**tiny, "scaling": {"num_workers": 2}}))
    monkeypatch.setattr(ray_jax_train.cli, "_connect", lambda *a, **k: None)
    with caplog.at_level(logging.WARNING, logger="ray_jax_train.tune"):
        assert ray_jax_train.cli.main(["tune", str(moved), "--resume"]) != 0  # stopped where Ray would start
    assert caplog.text.count("with other scaling.num_workers than it started with") == 1, caplog.text


def test_asha_max_t_below_the_longest_trial_is_refused_before_ray_starts(tmp_path, capsys):
    """ASHA stopped every trial at max_t: with total_steps searched over [4, 8] and max_t 4, both trials ended at
    their step-4 log report, before any checkpoint, and the half-trained 8-step trial won the search ("checkpoint:
    none (set training.save_steps)" with save_steps set)."""
    import yaml

    from ray_jax_train.cli import main
    from ray_jax_train.run_config import ConfigError, parse_config

    tiny = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))

    def search(max_t, total_steps):
        return {"model": tiny["model"], "training": {**tiny["training"], "total_steps": 4},
                "tune": {"param_space": {"training.total_steps": total_steps},
                         "scheduler": {"type": "asha", "max_t": max_t}}}

    for max_t, total_steps in [(4, {"grid_search": [4, 8]}), (30, {"grid_search": [20, 40]}),
                               (19, {"randint": [8, 21]}), (3, 4)]:
        with pytest.raises(ConfigError, match=r"tune.scheduler.max_t=.* below the longest trial's "
                                              r"training.total_steps .*Leave max_t out"):
            parse_config(search(max_t, total_steps))
    parse_config(search(40, {"grid_search": [20, 40]}))  # raised to one past the longest trial
    # A trial by epochs (null total_steps) needs max_t for ASHA; other schedulers take it as it is.
    by_epochs = search(None, {"choice": [None, 8]})
    with pytest.raises(ConfigError, match=r"tune.scheduler.max_t: set it .*searched with null"):
        parse_config(by_epochs)
    by_epochs["training"]["num_epochs"] = 1
    by_epochs["tune"]["scheduler"] = {"type": "fifo"}
    parse_config(by_epochs)
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(search(30, {"grid_search": [20, 40]})))
    assert main(["config", "validate", str(path)]) == 2
    assert "max_t=30 is below the longest trial's training.total_steps (40)" in capsys.readouterr().err


def test_search_stops_weak_trials_and_restores_the_best(tmp_path):
    import yaml

    from ray_jax_train.tune import restore_best

    # The example's search with 3 of its 4 learning rates (a trial fewer for the suite's time; 2 at a time still,
    # so the third starts after the first pair and reads their compilation cache).
    config = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    rates = config["tune"]["param_space"]["training.learning_rate"]["grid_search"]
    assert rates[:2] == [3e-3, 1e-3] and config["tune"]["max_concurrent_trials"] == 2, rates
    config["tune"]["param_space"]["training.learning_rate"]["grid_search"] = [3e-3, 1e-5, 1e-6]
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(config))
    # Without the test session's JAX_COMPILATION_CACHE_DIR: the search's own default cache is under test.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "JAX_COMPILATION_CACHE_DIR")}
    done = subprocess.run(
        [sys.executable, "-m", "ray_jax_train", "tune", str(path),
         "--set", f"run.storage_path={tmp_path}", "--set", "data.max_docs=30", "--address", "local"],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "=== ray-jax-train: search done ===" in done.stdout and "trials:      3 (0 failed" in done.stdout
    # Short output: trials build their datasets in their own processes, with Ray Data's progress bars off there too.
    assert "row/s" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
    # But each trial's progress shows as it trains, a line per log step (an ops review: nothing until the end),
    # named by trial, every trial's (Ray's deduplication showed one trial's lines and folded the others').
    shown = done.stdout + done.stderr
    trials_shown = set(re.findall(r"\[train trial (\w+)\] step 1/\d+, loss ", shown))
    assert len(trials_shown) == 3, shown[-3000:]

    experiment = tmp_path / "tune-tiny-llama"
    last_steps, cache_hits = {}, []
    for result in glob.glob(str(experiment / "trial_*" / "result.json")):
        lines = [json.loads(line) for line in open(result) if line.strip()]
        last_steps[lines[-1]["config"]["training"]["learning_rate"]] = lines[-1]["step"]
        cache_hits.append(lines[0]["compilation_cache_hits"])  # the first record carries the start-up facts
    assert len(last_steps) == 3
    # The trials share one compilation cache in the search's directory, and a learning rate changes no program:
    # the trial that starts after the first pair loads the state's init programs and the train step (5) instead
    # of compiling them.
    assert any((experiment / "compilation_cache").iterdir())
    assert max(cache_hits) >= 5, cache_hits
    assert max(last_steps.values()) == 4, last_steps  # the best trained to the end ...
    assert min(last_steps.values()) < 4, last_steps  # ... and ASHA stopped at least one trial early
    # The summary gives every trial's outcome: finished or stopped early, with its value, the best marked, and its
    # id, which names its Train run beside the search's directory.
    trial_lines = [line for line in done.stdout.splitlines() if re.match(r"  \w+_\d{5}  learning_rate=", line)]
    assert len(trial_lines) == 3, done.stdout[-3000:]
    assert all((tmp_path / f"tune-tiny-llama-{line.split()[0]}" / "metrics.jsonl").is_file() for line in trial_lines)
    assert f"trial runs:  {experiment}-<trial id>" in done.stdout, done.stdout[-3000:]
    stopped = sum(1 for v in last_steps.values() if v < 4)
    assert sum("stopped early by the scheduler" in line for line in trial_lines) == stopped, trial_lines
    assert sum(line.endswith("<- best") for line in trial_lines) == 1 and "step 4/4, finished" in "".join(
        line for line in trial_lines if line.endswith("<- best")), trial_lines
    # A stopped trial's workers end quietly: no traceback from Train's actors dying under the loop.
    assert "Error in training function" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]

    best = json.loads((experiment / "best.json").read_text())
    assert best["config"]["training"]["learning_rate"] == 3e-3, last_steps
    assert best["checkpoint"] and os.path.isdir(best["checkpoint"])
    assert os.path.isfile(os.path.join(best["run_dir"], "metrics.jsonl")) and best["warning"] is None
    # The winner as a config `fit` reads: the best trial's values, without the search.
    from ray_jax_train.run_config import load_config

    again = load_config(str(experiment / "best_config.json"))
    assert again.tune is None and again.training["learning_rate"] == best["config"]["training"]["learning_rate"]
    params = restore_best(str(experiment))
    leaves = jax.tree.leaves(params)
    assert any(x.ndim == 2 and 32 in x.shape for x in leaves)
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves)


def test_trials_train_on_the_datasets_the_search_tokenised_once_unless_their_data_settings_differ(ray_cluster, tmp_path):
    """Each trial tokenised and packed the search's documents again in its own actor (8-12 Ray Data processes
    each). Now the driver does it once; a trial uses those datasets only where its own settings make the same."""
    import yaml

    from ray_jax_train.run_config import build_trainer, ensure_tokenizer, parse_config, prepare_data
    from ray_jax_train.tune import _searches_data, search_config

    config = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    config["data"]["max_docs"] = 12
    config["run"]["storage_path"] = str(tmp_path)
    config["training"]["eval_steps"] = 2
    config["data"]["eval_fraction"] = 0.25
    base = search_config(config)
    ensure_tokenizer(base, str(tmp_path / "tokenizer"), reuse=True)
    data = base.model_dump(mode="json")
    data["tokenizer"], data["tune"] = {"path": str(tmp_path / "tokenizer"), "vocab_size": 300}, None
    prepared = prepare_data(parse_config(data))
    assert set(prepared.datasets) == {"train", "eval"}

    def trainer_for(**training):
        trial = copy.deepcopy(data)
        trial["training"].update(training)
        return build_trainer(parse_config(trial), run_name="trial", prepared=prepared)

    # Settings the data does not depend on: the search's datasets, and the trial's own step count.
    trainer, info = trainer_for(learning_rate=1e-5, total_steps=6)
    assert trainer.datasets["train"] is prepared.datasets["train"] and info["total_steps"] == 6
    assert trainer.datasets["eval"] is prepared.datasets["eval"]
    # The same rows a trial tokenising on its own gets.
    alone, _ = build_trainer(parse_config(data), run_name="alone")
    assert alone.datasets["train"] is not prepared.datasets["train"]
    assert ([r["input_ids"].tolist() for r in alone.datasets["train"].take_all()]
            == [r["input_ids"].tolist() for r in prepared.datasets["train"].take_all()])
    # Other packing: its own datasets, rows of its own length.
    other, _ = trainer_for(max_sequence_length=16)
    assert other.datasets["train"] is not prepared.datasets["train"]
    assert len(other.datasets["train"].take(1)[0]["input_ids"]) == 16
    # A step count the shared rows cannot feed is still refused, trial by trial.
    with pytest.raises(ValueError, match=r"fewer than one global batch \(batch_size=4096\)"):
        trainer_for(batch_size=4096)
    # A search lets go of them when it ends: with_parameters' registry kept them pinned for the process's life.
    import gc

    import ray
    from ray import tune

    from ray_jax_train.tune import _let_go_of_parameters

    counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts
    before = set(counts())
    trainable = tune.with_parameters(lambda config, prepared=None: None, prepared=prepared)
    put = set(counts()) - before
    assert put
    _let_go_of_parameters(trainable)
    del trainable  # without the line above, the put object stays (its count 1 for the rest of the process)
    gc.collect()
    assert not put & set(counts())
    # The driver skips the work where the search itself changes the data.
    assert not _searches_data({"training.learning_rate": {}, "model.seed": {}, "training.total_steps": {}})
    assert _searches_data({"data.max_docs": {}}) and _searches_data({"training.max_sequence_length": {}})
    assert _searches_data({"model.vocab_size": {}}) and not _searches_data({"model.vocab_size_x": {}})


def test_a_bad_row_in_the_search_s_data_is_said_once_on_the_driver(ray_cluster, tmp_path):
    """A row no trial could tokenise failed every trial the same way, each after its actor started, and the search
    ended in "No trial finished"; the driver, which tokenises for all of them now, says it once, naming the row."""
    import yaml

    from ray_jax_train import tune
    from ray_jax_train.run_config import ConfigError

    rows = [json.dumps({"text": f"document {i} " * 5}) for i in range(40)]
    rows[33] = json.dumps({"text": 33})  # past the rows the driver reads first: met by a Ray Data task
    (tmp_path / "docs.jsonl").write_text("\n".join(rows) + "\n")
    config = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    config["data"] = {"source": str(tmp_path / "docs.jsonl"), "max_docs": 20}
    config["run"]["storage_path"] = str(tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"(?s)holds an int \(33\).*docs\.jsonl, line 34.*tokenised on the driver"):
        tune.run(config)
    assert not list((tmp_path / "runs").glob("tune-tiny-llama-*"))  # no trial started


def test_a_resume_may_move_to_another_cluster_but_not_change_the_search(tmp_path, caplog):
    """Scaling, fault tolerance and trial CPUs may differ on resume (a search outlives its cluster; checkpoints
    restore into any worker count); what the trials compute may not."""
    import yaml

    from ray_jax_train.run_config import ConfigError, parse_config
    from ray_jax_train.tune import SEARCH_CONFIG, _comparable, can_resume

    tiny = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    tiny["run"] = {**(tiny.get("run") or {}), "storage_path": str(tmp_path)}
    tiny["tune"]["name"] = "moved"
    started = parse_config(tiny).with_absolute_paths()
    search_dir = tmp_path / "moved"
    search_dir.mkdir()
    (search_dir / "tuner.pkl").write_bytes(b"")  # what Tuner.can_restore looks for
    (search_dir / SEARCH_CONFIG).write_text(json.dumps(_comparable(started)))
    assert can_resume(started)

    moved = copy.deepcopy(tiny)
    moved["scaling"] = {**(moved.get("scaling") or {}), "num_workers": 2}
    moved["run"]["max_failures"] = 3
    with caplog.at_level(logging.WARNING, logger="ray_jax_train.tune"):
        assert can_resume(parse_config(moved))
    assert "scaling.num_workers" in caplog.text and "run.max_failures" in caplog.text

    changed = copy.deepcopy(tiny)
    changed["training"]["weight_decay"] = 0.5
    with pytest.raises(ConfigError, match=r"started with another config \(training.weight_decay: "):
        can_resume(parse_config(changed))
    # Saved by an older version, before keys with defaults were added: those keys are no change (an upgrade
    # review: every older search was refused, and so was the saved config the refusal pointed to).
    older = _comparable(started)
    del older["training"]["quiet"], older["run"]["tensorboard"]
    (search_dir / SEARCH_CONFIG).write_text(json.dumps(older))
    assert can_resume(started)
    older["training"]["weight_decay"] = 0.5
    (search_dir / SEARCH_CONFIG).write_text(json.dumps(older))
    with pytest.raises(ConfigError, match=r"started with another config \(training.weight_decay: 0.5 -> "):
        can_resume(started)


def test_a_new_search_under_an_old_name_sets_the_old_one_aside(tmp_path):
    """Until a new search saves its first state, Tune would resume the old search's newest experiment_state file
    under the new config; the old state is moved aside instead, and the old trials' outputs stay."""
    from ray.tune import Tuner

    from ray_jax_train.tune import set_aside_search_state

    search = tmp_path / "search"
    trial = search / "trial_e1faf_00000_0_lr=0.1_2026-11-25_12-43-59"
    trial.mkdir(parents=True)
    (trial / "result.json").write_text("{}")
    (search / "tokenizer").mkdir()
    state = ["tuner.pkl", "experiment_state-2026-11-25_12-43-59.json", "basic-variant-state-2026-11-25_12-43-59.json",
             "search_config.json", "best.json"]
    for name in state:
        (search / name).write_text(name)
    assert Tuner.can_restore(str(search))

    aside = set_aside_search_state(str(search))
    assert not Tuner.can_restore(str(search))
    assert sorted(os.listdir(aside)) == sorted(state)
    assert (trial / "result.json").exists() and (search / "tokenizer").is_dir()


def test_an_interrupted_search_resumes_keeping_its_finished_trials(tmp_path, capsys):
    """Ctrl-C during the second of 2 trials (1 at a time), then `tune --resume`. Before, Ctrl-C printed "search
    done" with the half-trained trial as the best, and running the search again started all its trials anew."""
    import yaml

    from ray_jax_train.cli import main
    from ray_jax_train.run_config import parse_config
    from ray_jax_train.tune import can_resume

    config = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    config["data"]["max_docs"] = 30
    config["training"].update(log_steps=2, save_steps=4)
    config["run"].update(storage_path=str(tmp_path), max_failures=1)  # a lost trial actor is retried once
    # The long second trial is interrupted after its first checkpoint. (A third, not started by then, ran on resume
    # too: Tune's own part, cut for the suite's time.)
    config["tune"] = {"name": "resumable", "param_space": {"training.total_steps": {"grid_search": [4, 40]}},
                      "max_concurrent_trials": 1, "scheduler": {"type": "fifo"}}
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(config))
    experiment = tmp_path / "resumable"
    command = [sys.executable, "-m", "ray_jax_train", "tune", str(path), "--address", "local"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def run_dirs(total_steps):  # the Train run of each trial given total_steps, named after its trial id
        return [tmp_path / f"resumable-{d.name.split('_')[1]}_{d.name.split('_')[2]}"
                for d in experiment.glob(f"trial_*_total_steps={total_steps}_*")]

    started = time.time()
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        search = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            while not any(glob.glob(str(d / "checkpoint_*")) for d in run_dirs(40)):
                assert search.poll() is None, log.read_text()[-5000:]
                assert time.time() - started < 300, log.read_text()[-5000:]
                time.sleep(0.2)
            search.send_signal(signal.SIGINT)
            assert search.wait(timeout=120) == 130, log.read_text()[-5000:]
        finally:
            if search.poll() is None:
                search.kill()
    first = log.read_text()
    assert "SIGTERM received" not in first, first[-3000:]  # Ray ending the trials' workers is no preemption
    assert "interrupted with 1 of 2 trials unfinished" in first and f"tune {path} --resume" in first, first[-3000:]
    assert "search done" not in first and not (experiment / "best.json").exists()
    (short,), (long,) = run_dirs(4), run_dirs(40)
    short_records = (short / "metrics.jsonl").read_text()
    short_results = next(experiment.glob("trial_*_total_steps=4_*/result.json")).read_text()
    assert json.loads(short_records.splitlines()[-1])["step"] == 4

    # A changed config is refused before Ray starts, naming what changed; the saved one resumes the same search.
    assert main(["tune", str(path), "--resume", "--set", "training.learning_rate=0.01"]) == 2
    err = capsys.readouterr().err
    assert "training.learning_rate: 0.0003 -> 0.01" in err and "search_config.json" in err, err
    assert can_resume(parse_config(json.loads((experiment / "search_config.json").read_text())))

    # The resume, with the long trial's actor SIGKILLed once it trains again (its node lost, say): Tune runs the
    # trial again and its Train run resumes from its latest checkpoint. Before, the trial failed for good.
    def step_lines():  # not the line each attempt starts with: the kill waits for training
        return sum('"step"' in line for line in (long / "metrics.jsonl").read_text().splitlines())

    lines_before = step_lines()
    started = time.time()  # each phase its own bound against a hang: a loaded 2-core machine took 500 s for both
    resumed_log = tmp_path / "resumed.log"
    with open(resumed_log, "w") as out:
        search = subprocess.Popen(command + ["--resume"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            killed = []
            while not killed:
                assert search.poll() is None, resumed_log.read_text()[-5000:]
                assert time.time() - started < 400, resumed_log.read_text()[-5000:]
                if step_lines() > lines_before:
                    for pid in _trial_actors_of(search.pid):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                time.sleep(0.1)
            assert search.wait(timeout=400) == 0, resumed_log.read_text()[-5000:]
        finally:
            if search.poll() is None:
                search.kill()
    resumed = resumed_log.read_text()
    assert "trials:      2 (0 failed" in resumed and "Resuming the search" in resumed, resumed[-3000:]
    assert re.search(r"trials:      2 \(0 failed; \d+s since the resume\)", resumed), resumed[-3000:]
    # The summary says which trial rode over failures: the long one resumed twice (the search, then its lost actor).
    assert re.search(r"total_steps=40: .*finished, resumed 2 times \(from step \d+, \d+\)", resumed), resumed[-3000:]
    assert not re.search(r"total_steps=4: .*resumed", resumed), resumed[-3000:]
    # The finished trial was not run again, and no trial got a new id (a new Train run).
    assert (short / "metrics.jsonl").read_text() == short_records
    assert next(experiment.glob("trial_*_total_steps=4_*/result.json")).read_text() == short_results
    assert len(list(experiment.glob("trial_*"))) == 2 and len(list(tmp_path.glob("resumable-*"))) == 2
    # The interrupted trial resumed from its checkpoint: step 2 (before the first checkpoint) was trained once.
    lines = [json.loads(line) for line in (long / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "step" in r]
    steps = [r["step"] for r in records]
    assert steps.count(2) == 1 and steps[-1] == 40 and sorted(set(steps)) == list(range(2, 41, 2)), steps
    # Three attempts of the long trial's run, each from the checkpoint the one before saved last.
    starts = [r["start_step"] for r in records if "start_step" in r]
    assert len(starts) == 3 and starts[0] == 0 and 0 < starts[1] <= starts[2] and starts[2] % 4 == 0, starts
    assert [line["attempt"]["start_step"] for line in lines if "attempt" in line] == starts
    best = json.loads((experiment / "best.json").read_text())
    assert best["config"]["training"]["total_steps"] == 40 and os.path.isdir(best["checkpoint"])


def _trial_actors_of(driver_pid):
    """Tune's trial actor processes of the Ray that the process `driver_pid` started (its raylet's workers)."""
    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::ImplicitFunc") and parent(parent(int(entry))) == driver_pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def cache_dir_loop(config):
    from ray_jax_train.backend import worker_config

    with open(config["out"], "w") as f:
        f.write(worker_config().compilation_cache_dir)


def own_tune_trial(config):
    import ray.train

    import ray_jax_train as rjt

    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test session's shared cache: the default is under test
    rjt.JaxTrainer(cache_dir_loop, train_loop_config=config,
                   run_config=ray.train.RunConfig(name="inner", storage_path=config["storage"])).fit()


def test_a_users_own_tune_search_gives_its_trials_one_compilation_cache(ray_cluster, tmp_path):
    """JaxTrainer.fit() in a trial of the user's own Tuner kept its cache in its own run directory, so every trial
    compiled the programs the one before it had compiled (a review: 25 programs, 0 loaded, in two alike trials)."""
    from ray import tune

    out = tmp_path / "cache_dir.txt"
    tuner = tune.Tuner(own_tune_trial, param_space={"out": str(out), "storage": str(tmp_path / "runs")},
                       run_config=tune.RunConfig(name="search", storage_path=str(tmp_path / "tune")))
    assert not tuner.fit().errors
    assert out.read_text() == str(tmp_path / "tune" / "search" / "compilation_cache")


def test_a_searched_vocab_size_below_the_tokenizer_is_refused_before_trials(tmp_path):
    """Known once the driver has the tokenizer (before any trial): a grid value below it failed in its trial only,
    and the search ended with exit 0."""
    import yaml

    from ray_jax_train.run_config import ConfigError, parse_config
    from ray_jax_train.text import train_tokenizer
    from ray_jax_train.tune import _check_searched_vocab_sizes

    tokenizer = train_tokenizer(["a few words to learn from, again and again"] * 30, vocab_size=300,
                                save_dir=str(tmp_path / "tok"))
    tiny = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    base = parse_config({**tiny, "tune": {"param_space": {"model.vocab_size": {"grid_search": [512, 100]}}}})
    with pytest.raises(ConfigError, match=r"tune.param_space.model.vocab_size: trials given 100 would fail: The "
                                          rf"tokenizer gives ids up to {len(tokenizer) - 1}"):
        _check_searched_vocab_sizes(base, str(tmp_path / "tok"))
    _check_searched_vocab_sizes(parse_config({**tiny, "tune": {"param_space": {"model.vocab_size": {
        "grid_search": [512, 1024]}}}}), str(tmp_path / "tok"))


def test_a_search_shows_every_trial_s_progress_lines_by_name():
    """Ray folds lines that differ only in numbers: of trials logging the same steps, one trial's progress showed,
    the others' read "[repeated 3x across cluster]", and no line said which trial it was (a review)."""
    from ray._private import ray_logging

    from ray_jax_train.lm.metrics import Progress
    from ray_jax_train.quiet import every_worker_line

    lines = [Progress(8, label=f"trial 1a2b3_0000{i}").line({"loss": 5.0}) for i in range(2)]
    assert lines[0].startswith("[train trial 1a2b3_00000] step 0/8, loss 5")
    batch = {"ip": "1.2.3.4", "pid": 1, "lines": [lines[0]]}
    deduplicator = ray_logging.LogDeduplicator(agg_window_s=60, allow_re=None, skip_re=None, _timesource=lambda: 0)
    deduplicator.deduplicate(batch)
    assert deduplicator.deduplicate({**batch, "pid": 2, "lines": [lines[1]]})[0]["lines"] == []  # folded
    undo = every_worker_line()
    try:
        assert deduplicator.deduplicate({**batch, "pid": 3, "lines": [lines[1]]})[0]["lines"] == [lines[1]]
    finally:
        undo()
    assert ray_logging.RAY_DEDUP_LOGS is True
