"""Hyperparameter search: each Tune trial is one JaxTrainer fit of the config, reported to Tune as it trains.

Train V2 style: the trial function builds the trainer and calls `fit()` with `TuneReportCallback` in its
RunConfig (wrapping a trainer in `Tuner(trainer)` is deprecated). Schedulers measure time in optimizer steps
(the `step` every report carries), so ASHA's `grace_period` / `max_t` are steps and a finished trial is never
cut off before its last checkpoint. The tokenizer is trained once on the driver and shared, so trials differ
only in what the param space changes. The best trial is written to `<storage>/<search name>/best.json`.

    outcome = ray_jax_train.tune.run("examples/tune_tiny_llama.yaml")
    params = outcome.restore_best_params()            # or later: restore_best("runs/tune-tiny-llama")
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any, Dict, Optional, Sequence, Union

from ray_jax_train.run_config import (ConfigError, ExperimentConfig, TuneSection, apply_overrides, build_trainer,
                                      check_cluster_fits, ensure_tokenizer, hf_tokenizer_dir, parse_config, read_file,
                                      search_candidates)
from ray_jax_train.storage import absolute, is_uri, join, local_dir_for, read_text
from ray_jax_train.trainer import env_unless_set

__all__ = ["TuneOutcome", "restore_best", "run", "search_space"]


def search_space(param_space: Dict[str, Any]) -> Dict[str, Any]:
    """`{"training.learning_rate": {"loguniform": [1e-4, 1e-2]}}` -> nested Tune domains."""
    from ray import tune

    makers = {
        "choice": lambda a: tune.choice(a),
        "grid_search": lambda a: tune.grid_search(a),
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
        "quniform": lambda a: tune.quniform(*a),
    }
    nested: Dict[str, Any] = {}
    for key, spec in param_space.items():
        section, name = key.split(".", 1)
        if isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in makers:
            (kind, args), = spec.items()
            spec = makers[kind](args)
        nested.setdefault(section, {})[name] = spec
    return nested


def _merge(base: Dict[str, Any], update: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for section, values in update.items():
        out.setdefault(section, {})
        if out[section] is None:
            out[section] = {}
        out[section].update(values)
    return out


@dataclasses.dataclass
class TuneOutcome:
    """What a search returns: Tune's ResultGrid and the best trial's config, metrics and outputs."""

    results: Any  # ray.tune.ResultGrid
    best_config: ExperimentConfig
    best_metrics: Dict[str, Any]
    best_checkpoint: Optional[str]  # the best trial's last Train checkpoint (None without training.save_steps)
    best_run_dir: str  # the best trial's Train run directory: metrics.jsonl, final_model/
    tokenizer_path: str
    metric: str
    mode: str
    searched: Sequence[str] = ()  # the param-space keys
    experiment_dir: str = ""  # <storage>/<search name>: Tune's state, best.json, the shared tokenizer

    def restore_best_params(self):
        """The best trial's parameters, restored from its checkpoint into this process's local devices."""
        if self.best_checkpoint is None:
            raise FileNotFoundError("The best trial saved no checkpoint; set training.save_steps to keep one "
                                    f"(its final_model/ is in {self.best_run_dir}).")
        from ray_jax_train.lm.state import restore_params
        from ray_jax_train.lm.step import make_optimizer, new_state
        from ray_jax_train.mesh import make_mesh
        from ray_jax_train.text import load_tokenizer

        config = self.best_config
        model_config = config.llama_config(load_tokenizer(self.tokenizer_path))
        args = config.training_arguments()
        optimizer, _ = make_optimizer(args, args.total_steps or 1)
        return restore_params(self.best_checkpoint, model_config, optimizer, make_mesh({"dp": -1}),
                              new_state_fn=lambda params, step: new_state(params, optimizer, step))


def require_param_space(config: ExperimentConfig) -> None:
    """A search needs something to search: said before Ray starts (the CLI checks its config with this)."""
    if config.tune is None or not config.tune.param_space:
        raise ConfigError("tune.param_space is empty: give at least one training.* or model.* key to search, e.g. "
                          "tune: {param_space: {training.learning_rate: {loguniform: [1e-4, 1e-2]}}}")


def _longest_trial(base_steps: int, param_space: Dict[str, Any]) -> int:
    """The most optimizer steps any trial can run: the base's, or the largest searched `training.total_steps`."""
    spec = param_space.get("training.total_steps")
    return base_steps if spec is None else max(int(v) for v in search_candidates(spec))


def _scheduler(tune_cfg: TuneSection, total_steps: int):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    s = tune_cfg.scheduler
    if s.type == "fifo":
        return FIFOScheduler()
    if s.type == "median":
        return MedianStoppingRule(time_attr="step", grace_period=s.grace_period)
    # One past the last step: a trial that trained to the end still reports its final checkpoint. A max_t of the
    # last step itself stopped every trial at its last log report, and the search kept no checkpoint.
    max_t = total_steps + 1 if s.max_t is None or (total_steps and s.max_t >= total_steps) else s.max_t
    return ASHAScheduler(time_attr="step", max_t=max(max_t, s.grace_period + 1), grace_period=s.grace_period,
                         reduction_factor=s.reduction_factor)


def run(config: Union[str, ExperimentConfig, Dict[str, Any]], *, overrides: Sequence[str] = (),
        param_space: Optional[Dict[str, Any]] = None, num_samples: Optional[int] = None,
        quiet: bool = True) -> TuneOutcome:
    """Run the search described by the config's `tune:` section (or `param_space` / `num_samples` here).

    Ray must be initialised (the CLI does it). Trials run `max_concurrent_trials` at a time; with
    `scaling.gpus_per_worker` < 1 several trials share a GPU and JAX is told not to preallocate it.
    """
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    if isinstance(config, str):
        data = apply_overrides(read_file(config), overrides)
    elif isinstance(config, ExperimentConfig):
        data = apply_overrides(config.model_dump(mode="json", exclude_none=False), overrides)
    else:
        data = apply_overrides(config, overrides)
    data.setdefault("tune", {})
    if data["tune"] is None:
        data["tune"] = {}
    if param_space is not None:
        data["tune"]["param_space"] = param_space
    if num_samples is not None:
        data["tune"]["num_samples"] = num_samples
    base = parse_config(data)
    require_param_space(base)
    tune_cfg = base.tune
    check_cluster_fits(base.scaling)

    # Never a fit's directory: run.name "foo" searched in <storage>/foo, where `fit` with that name writes.
    name = tune_cfg.name or f"tune-{base.run_name()}"
    # Absolute: Ray runs each trial in a working directory of its own, where relative paths would miss.
    base = base.with_absolute_paths()
    storage = base.run.storage_path
    tokenizer_path = base.tokenizer.path or hf_tokenizer_dir(base) or os.path.join(storage, name, "tokenizer")
    if base.tokenizer.path is None and tokenizer_path != hf_tokenizer_dir(base):
        # Reused when the search runs again under its name: its earlier trials' checkpoints (and best.json) were
        # trained with these ids, and a tokenizer trained again on changed data has other ids at the same size.
        ensure_tokenizer(base, tokenizer_path, reuse=True)
    base_data = base.model_dump(mode="json")
    base_data["tokenizer"] = {"path": tokenizer_path, "vocab_size": base.tokenizer.vocab_size}
    base_data["tune"] = None

    # One compilation cache for all trials (the driver's JAX_COMPILATION_CACHE_DIR, or one in the search's
    # directory), not one per trial run: trials of one model share every program the searched values do not
    # shape (the state's init, the eval step, and the train step: optimizer numbers are state, not constants).
    # Absolute: a trial runs in its own working directory. JAX's cache needs a filesystem path, so storage behind
    # a URI gets none unless the driver names one.
    shared_cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or (
        None if is_uri(storage) else os.path.join(storage, name, "compilation_cache"))
    shared_cache = absolute(shared_cache) if shared_cache else None

    def trial(trial_space: Dict[str, Any]) -> None:
        # Runs in a Tune trial actor: one Train run per trial, named after it, reporting to Tune.
        if shared_cache:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = shared_cache  # a trial actor has the cluster's environment
        context = tune.get_context()
        trial_config = parse_config(_merge(base_data, trial_space))
        trainer, _ = build_trainer(trial_config, run_name=f"{name}-{context.get_trial_id()}",
                                   callbacks=[TuneReportCallback()], quiet=quiet)
        trainer.fit()

    args = base.training_arguments()  # ExperimentConfig.check has refused ASHA without max_t or total_steps
    tuner = tune.Tuner(
        tune.with_resources(trial, {"cpu": tune_cfg.trial_cpus}),
        param_space=search_space(tune_cfg.param_space),
        tune_config=tune.TuneConfig(metric=tune_cfg.metric, mode=tune_cfg.mode, num_samples=tune_cfg.num_samples,
                                    max_concurrent_trials=tune_cfg.max_concurrent_trials,
                                    scheduler=_scheduler(tune_cfg, _longest_trial(args.total_steps or 0,
                                                                                  tune_cfg.param_space))),
        run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0),
    )
    # Not every report carries every metric (eval_* on eval steps only, tokens_per_s from the second log step
    # on), and Tune's strict check would stop the whole search at the first report without its metric; its
    # schedulers skip such reports anyway. The metric's name was checked on the driver (parse_config).
    with env_unless_set("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1"):
        results = tuner.fit()
    errors = [r.error for r in results if r.error is not None]
    best = best_result(results, tune_cfg.metric, tune_cfg.mode)
    if best is None:
        detail = f" First error: {errors[0]}" if errors else ""
        raise RuntimeError(f"No trial finished with a finite {tune_cfg.metric!r}; {len(errors)} of {len(results)} "
                           f"failed.{detail}")
    best_config = parse_config(_merge(base_data, best.config))
    trial_name = f"{name}-{best.metrics.get('trial_id')}"
    outcome = TuneOutcome(results=results, best_config=best_config, best_metrics=dict(best.metrics),
                          best_checkpoint=best.metrics.get("checkpoint_path"),
                          best_run_dir=os.path.join(storage, trial_name), tokenizer_path=tokenizer_path,
                          metric=tune_cfg.metric, mode=tune_cfg.mode, searched=list(tune_cfg.param_space),
                          experiment_dir=os.path.join(storage, name))
    summary = {"config": best_config.model_dump(mode="json"), "metrics": _plain(best.metrics),
               "checkpoint": outcome.best_checkpoint, "run_dir": outcome.best_run_dir,
               "tokenizer": tokenizer_path, "metric": outcome.metric, "mode": outcome.mode,
               "searched": outcome.searched}
    with local_dir_for(os.path.join(storage, name)) as experiment_dir:  # a URI too: written locally, copied up
        with open(os.path.join(experiment_dir, "best.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return outcome


def best_result(results, metric: str, mode: str):
    """The best trial's result by its last `metric`, among trials that did not fail; None if there is none.

    Ray's `ResultGrid.get_best_result` ranks failed trials too: one whose loss went NaN after a good early report
    (stopped by the loop's NaN check) was the search's winner, with no checkpoint worth having.
    """
    finished = [r for r in results if r.error is None and r.metrics and _finite(r.metrics.get(metric))]
    if not finished:
        return None
    pick = min if mode == "min" else max
    return pick(finished, key=lambda r: r.metrics[metric])


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _plain(metrics: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) or v is None}


def restore_best(experiment_dir: str):
    """The best trial's parameters from a finished search directory (its best.json), in this process."""
    path = join(experiment_dir, "best.json")
    try:
        best = json.loads(read_text(path))  # a local path or the storage URI
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: give the search directory <storage_path>/<tune name>") from None
    outcome = TuneOutcome(results=None, best_config=parse_config(best["config"]), best_metrics=best["metrics"],
                          best_checkpoint=best["checkpoint"], best_run_dir=best["run_dir"],
                          tokenizer_path=best["tokenizer"], metric=best["metric"], mode=best["mode"],
                          searched=best["searched"])
    return outcome.restore_best_params()
