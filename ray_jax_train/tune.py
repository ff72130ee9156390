"""Hyperparameter search: each Tune trial is one JaxTrainer fit of the config, reported to Tune as it trains.

Train V2 style: the trial function builds the trainer and calls `fit()` with `TuneReportCallback` in its
RunConfig (wrapping a trainer in `Tuner(trainer)` is deprecated). Schedulers measure time in optimizer steps
(the `step` every report carries), so ASHA's `grace_period` / `max_t` are steps and a finished trial is never
cut off before its last checkpoint. The tokenizer is trained once on the driver and shared, and the data
tokenised and packed there once (unless the search changes how), so trials differ only in what the param space
changes. The best trial is written to `<storage>/<search name>/best.json`, and its
config, which `ray-jax-train fit` reads, to `best_config.json` beside it.

An interrupted search (Ctrl-C, a killed driver, a lost head node) continues with `run(..., resume=True)`
(`ray-jax-train tune --resume`): Tune's `Tuner.restore` keeps the finished trials, and each unfinished one runs
its Train run again under the same name, which resumes from that run's latest checkpoint.

    outcome = ray_jax_train.tune.run("examples/tune_tiny_llama.yaml")
    params = outcome.restore_best_params()            # or later: restore_best("runs/tune-tiny-llama")
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import shlex
import sys
import uuid
from typing import Any, Dict, Optional, Sequence, Union

from ray_jax_train.run_config import (MOVED_TRAINING_KEYS, TOKENIZER_DIR, ConfigError, ExperimentConfig,
                                      TuneSection, apply_overrides, build_trainer, check_cluster_fits,
                                      ensure_tokenizer, init_tokenizer_dir, parse_config, prepare_data,
                                      read_file, trained_tokenizer_dir, trial_lengths)
from ray_jax_train.quiet import every_worker_line, filter_worker_notices, quiet_data_context, quiet_worker
from ray_jax_train.storage import absolute, etils_reaches, is_uri, jax_can_cache_in, join, local_dir_for, qualified, read_text
from ray_jax_train.text.errors import read_error
from ray_jax_train.trainer import PREEMPTION_WATCHER, env_unless_set, no_node_can_be_drained

__all__ = ["SearchInterrupted", "TuneOutcome", "can_resume", "restore_best", "run", "search_space"]

logger = logging.getLogger(__name__)

# The effective config a search started with, in its directory: a resume must be the same search.
SEARCH_CONFIG = "search_config.json"
# The best trial's effective config without the tune section, beside best.json: a config `fit` reads.
BEST_CONFIG = "best_config.json"


class SearchInterrupted(RuntimeError):
    """The search stopped before all its trials finished (Ctrl-C); its state is saved and `resume=True` continues it."""


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
    best_checkpoint: Optional[str]  # the best trial's latest Train checkpoint (None: see no_checkpoint_reason)
    best_run_dir: str  # the best trial's Train run directory: metrics.jsonl, final_model/
    tokenizer_path: str
    metric: str
    mode: str
    searched: Sequence[str] = ()  # the param-space keys
    experiment_dir: str = ""  # <storage>/<search name>: Tune's state, best.json, the shared tokenizer
    warning: Optional[str] = None  # why the best trial is a weak pick (no trial trained to the end)

    def no_checkpoint_reason(self) -> str:
        """Why the best trial has no checkpoint, from its config and last step (not always a missing save_steps)."""
        save_steps = self.best_config.training_arguments().save_steps
        step = self.best_metrics.get("step")
        if not save_steps:
            return "training.save_steps is not set; set it to keep checkpoints"
        if isinstance(step, int) and step < save_steps:
            return f"it ended at step {step}, before its first save at step {save_steps} (training.save_steps)"
        return f"its reports to Tune named none; look for checkpoint_* in {self.best_run_dir}"

    def restore_best_params(self):
        """The best trial's parameters, restored from its checkpoint onto this process's devices."""
        if self.best_checkpoint is None:
            raise FileNotFoundError(f"The best trial has no checkpoint to restore: {self.no_checkpoint_reason()} "
                                    f"(its run directory: {self.best_run_dir}).")
        from ray_jax_train.lm.state import restore_params
        from ray_jax_train.mesh import make_mesh
        from ray_jax_train.storage import exists
        from ray_jax_train.text import load_tokenizer

        if not exists(self.best_checkpoint):  # deleted by hand, or its storage moved since the search
            raise FileNotFoundError(
                f"The best trial's checkpoint {self.best_checkpoint} no longer exists. Its run directory "
                f"{self.best_run_dir} may hold others: `ray-jax-train export {self.best_run_dir} OUT` exports its "
                "latest as a Hugging Face directory (ray_jax_train.from_pretrained(OUT) loads it); or run the search "
                "again.")

        model_config = self.best_config.llama_config(load_tokenizer(self.tokenizer_path))
        # Over this process's default devices (the GPUs on a GPU machine), as a fresh model would be.
        return restore_params(self.best_checkpoint, model_config, make_mesh({"dp": -1}))


def require_param_space(config: ExperimentConfig) -> None:
    """A search needs something to search: said before Ray starts (the CLI checks its config with this)."""
    if config.tune is None or not config.tune.param_space:
        raise ConfigError("tune.param_space is empty: give at least one training.* or model.* key to search, e.g. "
                          "tune: {param_space: {training.learning_rate: {loguniform: [1e-4, 1e-2]}}}")


def search_config(config: Union[str, ExperimentConfig, Dict[str, Any]], *, overrides: Sequence[str] = (),
                  param_space: Optional[Dict[str, Any]] = None,
                  num_samples: Optional[int] = None) -> ExperimentConfig:
    """The effective, checked config of a search, its local paths absolute (a trial runs in a directory of its own)."""
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
    return base.with_absolute_paths()


def search_name(config: ExperimentConfig) -> str:
    """`tune.name`, else `tune-<run.name>`, else a new timestamped name."""
    # Never a fit's directory: run.name "foo" searched in <storage>/foo, where `fit` with that name writes.
    return config.tune.name or f"tune-{config.run_name()}"


def can_resume(config: ExperimentConfig, *, warn: bool = True) -> bool:
    """Whether the search `config` describes was started before and can continue; said before Ray starts.

    ConfigError when the search has no stable name to find it by, or was started with another config: resuming
    it would add trials of one search to the results of another. `warn`: log the keys that changed and may (the
    CLI checks with warn=False before it starts Ray, and `run` checks again: said once).
    """
    from ray.tune import Tuner

    config = config.with_absolute_paths()
    if config.tune is None or not (config.tune.name or config.run.name):
        raise ConfigError("tune.name: a search resumes by its name, and without tune.name (or run.name) each "
                          "search gets a new timestamped one; set tune.name")
    experiment_dir = join(config.run.storage_path, search_name(config))
    if not Tuner.can_restore(experiment_dir):
        return False
    saved = join(experiment_dir, SEARCH_CONFIG)
    try:
        started = json.loads(read_text(saved))
    except FileNotFoundError:
        logger.warning("%s has no %s (a search started by an older ray_jax_train): resuming it without checking "
                       "that its config is this one.", experiment_dir, SEARCH_CONFIG)
        return True
    changed = _differences(_as_now_read(started), _comparable(config))
    moved = [key for key, _, _ in changed if key.startswith(_MAY_CHANGE_ON_RESUME)]
    if moved and warn:
        logger.warning("Resuming the search in %s with other %s than it started with: the trials still to run use "
                       "the new ones.", experiment_dir, ", ".join(moved))
    changed = [c for c in changed if c[0] not in moved]
    if changed:
        shown = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changed[:6])
        more = f" (and {len(changed) - 6} more)" if len(changed) > 6 else ""
        raise ConfigError(f"tune: the search in {experiment_dir} was started with another config ({shown}{more}), "
                          "and resuming it would mix the two searches' trials. Resume it with the config it started "
                          f"with (saved as {saved}, which `ray-jax-train tune {shlex.quote(saved)} --resume` reads), or give the "
                          "new search another tune.name")
    return True


# Where the trials run and how they survive faults, not what they compute: a resumed search may have another
# cluster (checkpoints restore into any worker count or mesh), and its trials are built from the new config.
_MAY_CHANGE_ON_RESUME = ("scaling.", "run.max_failures", "tune.trial_cpus")


def _comparable(config: ExperimentConfig) -> Dict[str, Any]:
    """What makes two searches the same one, as a plain config: everything but where the cluster is, training
    defaults filled in (a default written out is no change). It reads back as the same search."""
    data = json.loads(json.dumps(config.model_dump(mode="json")))
    args = config.training_arguments().model_dump(mode="json")
    data["training"] = {k: v for k, v in args.items() if k not in MOVED_TRAINING_KEYS}
    data["run"].pop("address", None)
    if data["model"].get("scaling_index") is None:  # unset reads as a search saved before the key existed
        data["model"].pop("scaling_index", None)
    return json.loads(json.dumps(data))


def _as_now_read(started: Dict[str, Any]) -> Dict[str, Any]:
    """A search's saved config as this version reads it: a key added since the search began takes its default, which
    is what the search ran with (an upgrade review: `training.quiet: None -> False` refused every older search, and
    the saved file the refusal pointed to with it). As saved where this version cannot read it."""
    try:
        return _comparable(parse_config(copy.deepcopy(started)))
    except Exception:  # noqa: BLE001 - a key since removed, say: the keys themselves are compared
        return started


def _differences(old: Dict[str, Any], new: Dict[str, Any], prefix: str = ""):
    """[(dotted key, old value, new value)] where two plain configs differ."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


def _exits_are_not_errors(unraisable) -> None:
    """A stopped trial's actor gets SIGTERM, and Ray's handler raises SystemExit wherever Python is, often inside a
    garbage-collection callback, which prints it as an error ("Exception ignored in ...") though the stop was meant."""
    if not isinstance(unraisable.exc_value, SystemExit):
        sys.__unraisablehook__(unraisable)


# Searched keys that change what a trial's data tokenises to (run_config.data_key): no dataset to share.
_DATA_KEYS = ("data.", "tokenizer.", "training.max_sequence_length", "training.text_column",
              "training.messages_column", "scaling.num_workers", "model.vocab_size", "model.max_position_embeddings",
              "model.scaling_index", "model.init_from")


def _searches_data(param_space: Dict[str, Any]) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for key in param_space for k in _DATA_KEYS)


def _let_go_of_parameters(trainable) -> None:
    """Unpin what `tune.with_parameters` put in the object store: its registry stays reachable from a Ray init hook
    for the rest of the process, so each search from one notebook kept its tokenised data there (measured: the
    reference count of the put object stays 1 after the trainable is gone, 0 once the registry is emptied)."""
    for cell in getattr(trainable, "__closure__", None) or ():
        try:
            registry = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(getattr(registry, "references", None), dict) and hasattr(registry, "to_flush"):
            registry.references.clear()


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


def _check_searched_vocab_sizes(base: ExperimentConfig, tokenizer_path: str) -> None:
    """Searched `model.vocab_size` values against the tokenizer, known now (trained or loaded on the driver): a value
    below it failed in its trial only, and the search still ended with exit 0."""
    spec = base.tune.param_space.get("model.vocab_size")
    if spec is None:
        return
    from ray_jax_train.lm.data import check_tokenizer_fits
    from ray_jax_train.run_config import search_candidates
    from ray_jax_train.text import ensure_pad_token, load_tokenizer

    tokenizer = ensure_pad_token(load_tokenizer(tokenizer_path))
    for value in search_candidates(spec):
        if value is None:
            continue
        try:
            check_tokenizer_fits(tokenizer, int(value))
        except ValueError as exc:
            raise ConfigError(f"tune.param_space.model.vocab_size: trials given {value!r} would fail: {exc}") from None


def run(config: Union[str, ExperimentConfig, Dict[str, Any]], *, overrides: Sequence[str] = (),
        param_space: Optional[Dict[str, Any]] = None, num_samples: Optional[int] = None,
        quiet: bool = True, resume: bool = False, resume_errored: bool = False) -> TuneOutcome:
    """Run the search described by the config's `tune:` section (or `param_space` / `num_samples` here).

    Starts Ray as `JaxTrainer.fit()` does where it is not running (a private local Ray, or the cluster
    `RAY_ADDRESS` names); `quiet` leaves the workers' start-up notices out of this process's output, as the
    CLI does. Trials run `max_concurrent_trials` at a time; with
    `scaling.gpus_per_worker` < 1 several trials share a GPU and JAX is told not to preallocate it.
    `resume`: continue the search saved under this name if there is one (else start it): finished trials are
    kept, unfinished ones resume from their latest checkpoints, and errored ones stay failed unless
    `resume_errored`. The config must be the one the search started with (ConfigError otherwise).
    """
    import ray

    base = search_config(config, overrides=overrides, param_space=param_space, num_samples=num_samples)
    resuming = (resume or resume_errored) and can_resume(base)  # a changed config is refused before Ray starts
    if not ray.is_initialized():  # as the CLI starts it: room for the workers, quiet workers on a private Ray
        from ray_jax_train.quiet import QUIET_ENV
        from ray_jax_train.trainer import init_ray

        need = base.scaling.num_workers * (base.scaling.cpus_per_worker or 1)
        private = not os.environ.get("RAY_ADDRESS")
        init_ray(num_cpus=max(4, os.cpu_count() or 1, int(need) + 1),
                 **({"runtime_env": {"env_vars": dict(QUIET_ENV)}} if quiet and private else {}))
    undo_filter = filter_worker_notices() if quiet else None
    undo_dedup = every_worker_line()
    try:
        return _run(base, quiet=quiet, resume=resume, resume_errored=resume_errored, resuming=resuming)
    finally:
        undo_dedup()
        if undo_filter is not None:
            undo_filter()


def _run(base: ExperimentConfig, *, quiet: bool, resume: bool, resume_errored: bool, resuming: bool) -> TuneOutcome:
    import ray.exceptions
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    tune_cfg = base.tune
    total_steps = base.training_arguments().total_steps  # ExperimentConfig.check refused ASHA without it or max_t
    expected = tune_cfg.num_samples * math.prod(len(spec["grid_search"]) for spec in tune_cfg.param_space.values()
                                                if isinstance(spec, dict) and "grid_search" in spec)
    # Without max_concurrent_trials, Tune may start every trial's process at once.
    check_cluster_fits(base.scaling, trial_cpus=tune_cfg.trial_cpus,
                       concurrent_trials=min(tune_cfg.max_concurrent_trials or expected, expected))
    random = [k for k, v in tune_cfg.param_space.items() if isinstance(v, dict) and "grid_search" not in v]
    if tune_cfg.num_samples > 1 and not random:
        logger.warning("tune.num_samples=%d repeats every grid point, but nothing in the search is random, so the "
                       "repeats train the same run again. To measure the spread over initial weights, search "
                       "model.seed instead (e.g. {grid_search: [0, 1, 2]}) with num_samples: 1.",
                       tune_cfg.num_samples)
    name, storage = search_name(base), base.run.storage_path
    experiment_dir = join(storage, name)
    if resuming:
        logger.warning("Resuming the search in %s: finished trials are kept, unfinished ones continue from their "
                       "latest checkpoints%s.", experiment_dir, ", errored ones too" if resume_errored else "")
    elif resume or resume_errored:
        # Not an error: a job that may be retried runs the same command, --resume included, every time.
        logger.warning("No earlier search in %s to resume: starting it.", experiment_dir)
    earlier_search = not resuming and tune.Tuner.can_restore(experiment_dir)
    tokenizer_path = (base.tokenizer.path or init_tokenizer_dir(base)
                      or trained_tokenizer_dir(base, join(experiment_dir, TOKENIZER_DIR)))
    if base.tokenizer.path is None and tokenizer_path != init_tokenizer_dir(base):
        # Reused when the search runs again under its name: its earlier trials' checkpoints (and best.json) were
        # trained with these ids, and a tokenizer trained again on changed data has other ids at the same size.
        ensure_tokenizer(base, tokenizer_path, reuse=True)
    _check_searched_vocab_sizes(base, tokenizer_path)
    base_data = base.model_dump(mode="json")
    base_data["tokenizer"] = {"path": tokenizer_path, "vocab_size": base.tokenizer.vocab_size}
    base_data["tune"] = None

    # One compilation cache for all trials (the driver's JAX_COMPILATION_CACHE_DIR, or one in the search's
    # directory), not one per trial run: trials of one model share every program the searched values do not
    # shape (the state's init, the eval step, and the train step: optimizer numbers are state, not constants).
    # Absolute: a trial runs in its own working directory. Storage behind a URI gets none unless the driver names
    # one, but gs:// for GPU and TPU trials, which JAX writes through gcsfs (backend.place_compilation_cache).
    in_bucket = jax_can_cache_in(storage) and (base.scaling.use_gpu or base.scaling.use_tpu) and etils_reaches("gs")
    shared_cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or (
        f"{storage.rstrip('/')}/{name}/compilation_cache" if in_bucket
        else None if is_uri(storage) else os.path.join(storage, name, "compilation_cache"))
    shared_cache = absolute(shared_cache) if shared_cache else None

    attempt = uuid.uuid4().hex  # this call's: a resume (`--resume-errored`) runs failed trials again on purpose
    from ray_jax_train.retries import RETRIES_WITHOUT_PROGRESS, retries_without_progress_limit

    without_progress = str(retries_without_progress_limit())  # this process's setting, checked here

    # Tokenised once here, not again in every trial (each started 8-12 Ray Data processes for the same rows); a
    # trial whose searched values give other data settings tokenises its own (build_trainer compares).
    tokenised = None
    if not _searches_data(tune_cfg.param_space):
        undo_quiet = quiet_data_context() if quiet else (lambda: None)
        try:
            tokenised = prepare_data(parse_config(base_data))
        except ConfigError:
            raise
        # Data the driver can read is wrong (a bad row, no loss tokens): a config problem, said once (`fit` says it
        # so too), where before every trial failed with it after its actor started.
        except (ValueError, OSError, ray.exceptions.RayTaskError) as exc:
            raise ConfigError(f"{read_error(exc)} (the search's data, tokenised on the driver for every trial)") from None
        finally:
            undo_quiet()

    undrained = no_node_can_be_drained()  # asked here: a trial actor joined the cluster, it did not start it

    def trial(trial_space: Dict[str, Any], prepared=None) -> None:
        # Runs in a Tune trial actor: one Train run per trial, named after it, reporting to Tune.
        if undrained:
            os.environ.setdefault(PREEMPTION_WATCHER, "0")  # as the driver's own fit() would (trainer.py)
        if shared_cache:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = shared_cache  # a trial actor has the cluster's environment
        os.environ[RETRIES_WITHOUT_PROGRESS] = without_progress  # the trial's fit() reads it, as the driver's would
        if quiet:
            quiet_worker()
            quiet_data_context()
            sys.unraisablehook = _exits_are_not_errors
        context = tune.get_context()
        run_name = f"{name}-{context.get_trial_id()}"
        refuse_a_failed_trial_again(join(storage, run_name), attempt)
        trial_config = parse_config(_merge(base_data, trial_space))
        trainer, _ = build_trainer(trial_config, run_name=run_name, callbacks=[TuneReportCallback()], quiet=quiet,
                                   progress_label=f"trial {context.get_trial_id()}", prepared=prepared)
        try:
            trainer.fit()
        except Exception as exc:
            record_trial_failure(join(storage, run_name), attempt, exc)
            raise

    # Through the object store (the datasets hold references to their blocks, which the trials borrow).
    trainable = tune.with_resources(tune.with_parameters(trial, prepared=tokenised), {"cpu": tune_cfg.trial_cpus})
    if resuming:
        # Search space and scheduler come from the saved search (tuner.pkl), trials and the search algorithm's
        # place from its last saved state. A resumed trial keeps its id, so its Train run, named after it, finds
        # its own checkpoints in storage and the loop resumes from the latest (Tune holds no trial checkpoints).
        tuner = tune.Tuner.restore(experiment_dir, trainable=trainable, resume_unfinished=True,
                                   resume_errored=resume_errored)
    else:
        if earlier_search:  # set aside only now, when nothing before the search's start can fail any more
            aside = set_aside_search_state(experiment_dir)
            logger.warning("%s holds an earlier search under this name; this one starts again with new trials. The "
                           "earlier one's state is now in %s: to continue that search instead, move its files back "
                           "and run with resume=True (`tune --resume`).", experiment_dir, aside)
        with local_dir_for(experiment_dir) as local:  # a URI too: written locally, copied up
            with open(os.path.join(local, SEARCH_CONFIG), "w") as f:
                json.dump(_comparable(base), f, indent=2)
        tuner = tune.Tuner(
            trainable,
            param_space=search_space(tune_cfg.param_space),
            tune_config=tune.TuneConfig(metric=tune_cfg.metric, mode=tune_cfg.mode, num_samples=tune_cfg.num_samples,
                                        max_concurrent_trials=tune_cfg.max_concurrent_trials,
                                        scheduler=_scheduler(tune_cfg, trial_lengths(total_steps,
                                                                                    tune_cfg.param_space)[0])),
            # A trial whose actor is lost (its node, say) runs again and its Train run resumes from its checkpoint;
            # one whose training failed is not run again (`refuse_a_failed_trial_again`).
            run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=trial_retries(base))),
        )
    # Not every report carries every metric (eval_* on eval steps only, tokens_per_s from the second log step
    # on), and Tune's strict check would stop the whole search at the first report without its metric; its
    # schedulers skip such reports anyway. The metric's name was checked on the driver (parse_config).
    try:
        with env_unless_set("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1"):
            results = tuner.fit()
    finally:
        _let_go_of_parameters(trainable)
        del tokenised
    unfinished = _unfinished_trials(experiment_dir, expected)
    if unfinished:
        # Tune catches Ctrl-C itself and returns what it has: the best of half-trained trials is no result.
        raise SearchInterrupted(f"The search in {experiment_dir} was interrupted with {unfinished} of {expected} "
                                "trials unfinished; its state is saved, and resume=True (`ray-jax-train tune CONFIG "
                                "--resume`) continues it.")
    errors = [r.error for r in results if r.error is not None]
    best = best_result(results, tune_cfg.metric, tune_cfg.mode, total_steps)
    if best is None:
        detail = f" First error: {errors[0]}" if errors else ""
        raise RuntimeError(f"No trial finished with a finite {tune_cfg.metric!r}; {len(errors)} of {len(results)} "
                           f"failed.{detail}")
    warning = best_warning(best, len(errors), len(results), total_steps)
    if warning:
        logger.warning("The search in %s: %s.", experiment_dir, warning)
    best_config = parse_config(_merge(base_data, best.config))
    trial_name = f"{name}-{best.metrics.get('trial_id')}"
    checkpoint = latest_checkpoint(best)  # within the storage filesystem: no scheme on a URI storage
    outcome = TuneOutcome(results=results, best_config=best_config, best_metrics=dict(best.metrics),
                          best_checkpoint=checkpoint and qualified(checkpoint, storage),
                          best_run_dir=join(storage, trial_name), tokenizer_path=tokenizer_path,
                          metric=tune_cfg.metric, mode=tune_cfg.mode, searched=list(tune_cfg.param_space),
                          experiment_dir=experiment_dir, warning=warning)
    summary = {"config": best_config.model_dump(mode="json"), "metrics": _plain(best.metrics),
               "checkpoint": outcome.best_checkpoint, "run_dir": outcome.best_run_dir,
               "tokenizer": tokenizer_path, "metric": outcome.metric, "mode": outcome.mode,
               "searched": outcome.searched, "warning": warning}
    with local_dir_for(experiment_dir) as local:  # a URI too: written locally, copied up
        with open(os.path.join(local, "best.json"), "w") as f:
            json.dump(summary, f, indent=2)
        # The winner as a config of its own: `ray-jax-train fit best_config.json` trains it again (or longer).
        with open(os.path.join(local, BEST_CONFIG), "w") as f:
            json.dump({k: v for k, v in summary["config"].items() if k != "tune"}, f, indent=2)
    return outcome


# What makes a directory a search that Tune restores and `restore_best` reads, as opposed to its trials' outputs.
_SEARCH_STATE = ("tuner.pkl", "experiment_state-*", "basic-variant-state-*", "searcher-state-*",
                 "search_gen_state-*", SEARCH_CONFIG, "best.json", BEST_CONFIG)


TRIAL_FAILURE = "trial_failure.json"


def trial_retries(config: ExperimentConfig) -> int:
    """How often Tune runs a trial again whose actor was lost: `run.max_failures`, as Train restarts lost workers;
    its "for ever" (-1) is 10 here, since a trial that fails each time must end (each retry of one is quick)."""
    return 10 if config.run.max_failures < 0 else config.run.max_failures


def record_trial_failure(run_dir: str, attempt: str, exc: BaseException) -> None:
    """Note in the trial's run directory that its training failed in this search call (Train's own retries, if
    any, are spent by then), so that Tune's retry, meant for a lost trial actor, does not train it again."""
    try:
        with local_dir_for(run_dir) as local:
            with open(os.path.join(local, TRIAL_FAILURE), "w") as f:
                json.dump({"attempt": attempt, "error": f"{type(exc).__name__}: {exc}"[:2000]}, f)
    except Exception:  # noqa: BLE001 - unrecorded, a retry trains again: slower, never wrong
        logger.warning("Could not record the trial's failure in %s; a retry will train it again.", run_dir)


def refuse_a_failed_trial_again(run_dir: str, attempt: str) -> None:
    """Raise at once where this trial's training already failed in this search call: Tune retries every failed
    trial, and a training failure (a NaN, a bug, Train's retries spent) would only fail again, after training."""
    try:
        failure = json.loads(read_text(join(run_dir, TRIAL_FAILURE)))
    except (FileNotFoundError, ValueError):
        return
    if failure.get("attempt") == attempt:
        raise RuntimeError(f"{failure.get('error')} (this trial's training failed earlier in this search, so it is "
                           "not run again; Tune retries trials for lost trial actors. `tune --resume-errored` runs it "
                           "again from its latest checkpoint.)")


def best_warning(best, failed: int, trials: int, total_steps: Optional[int]) -> Optional[str]:
    """What makes the best trial a doubtful winner, with what to do about it; None when nothing does."""
    if not trained_to_end(best, total_steps):
        warning = (f"no trial trained to the end; this is the best of those the scheduler stopped early (at step "
                   f"{best.metrics.get('step')} of {_trial_total_steps(best, total_steps)})")
        if failed:
            warning += (f", and {failed} failed: `tune --resume-errored` (resume_errored=True) runs them again "
                        "from their latest checkpoints")
        return warning
    if failed:  # the best is of the others: a failed trial (its trial actor lost, say) might have beaten it
        return (f"{failed} of {trials} trials failed, so the best is of the rest; `tune --resume-errored` "
                "(resume_errored=True) runs them again from their latest checkpoints (a trial whose sampled "
                "settings were refused, see its error above, fails the same way again)")
    return None


def set_aside_search_state(experiment_dir: str) -> str:
    """Move an earlier search's state into `<experiment_dir>/earlier_search_<time>/`; returns that directory.

    A new search under an old name must not leave the old one restorable beside it: Tune resumes from the newest
    `experiment_state-*` file, which until the new search saves its first one is the old search's, so a new
    search stopped early then resumed would continue the old one's trials under the new config. The old trials'
    own directories stay where they are (trial ids are new in every search).
    """
    import fnmatch
    import time
    import uuid

    import pyarrow.fs as pafs

    from ray_jax_train.storage import filesystem

    fs, path = filesystem(experiment_dir)
    aside = f"earlier_search_{time.strftime('%Y%m%d-%H%M%S')}_{uuid.uuid4().hex[:6]}"
    fs.create_dir(f"{path}/{aside}", recursive=True)
    for info in fs.get_file_info(pafs.FileSelector(path)):
        if info.type == pafs.FileType.File and any(fnmatch.fnmatch(info.base_name, p) for p in _SEARCH_STATE):
            fs.move(info.path, f"{path}/{aside}/{info.base_name}")
    return join(experiment_dir, aside)


def _unfinished_trials(experiment_dir: str, expected: int) -> int:
    """Trials a resume would still run, by the search's saved state: after Ctrl-C, the ResultGrid Tune returns
    shows the trials it stopped as terminated, and lacks those it never started."""
    from ray.tune import ExperimentAnalysis

    trials = ExperimentAnalysis(experiment_dir).trials
    return sum(t.status not in ("TERMINATED", "ERROR") for t in trials) + max(0, expected - len(trials))


def best_result(results, metric: str, mode: str, total_steps: Optional[int] = None):
    """The best trial's result by its last `metric`, among trials that did not fail and trained to the end (those
    the scheduler stopped early only when none did: check `trained_to_end` on it); None if there is none.

    Ray's `ResultGrid.get_best_result` ranks failed trials too: one whose loss went NaN after a good early report
    (stopped by the loop's NaN check) was the search's winner, with no checkpoint worth having. And a stopped trial
    is no error: when the only complete trial failed, one stopped untrained at step 8 of 60 was the winner.
    """
    finished = [r for r in results if r.error is None and r.metrics and _finite(r.metrics.get(metric))]
    finished = [r for r in finished if trained_to_end(r, total_steps)] or finished
    if not finished:
        return None
    pick = min if mode == "min" else max
    return pick(finished, key=lambda r: r.metrics[metric])


def _trial_total_steps(result, total_steps: Optional[int]) -> Optional[int]:
    """The trial's training.total_steps: its searched value, else the search's (None: by epochs)."""
    config = (result.metrics or {}).get("config") or {}  # Tune's Result.config (Train V2's Result refuses it)
    return (config.get("training") or {}).get("total_steps", total_steps)


def trained_to_end(result, total_steps: Optional[int]) -> bool:
    """Whether the trial's last report is of its last step: not one a scheduler stopped early (a trial by epochs,
    of a length the driver cannot know, counts as trained to the end)."""
    total, step = _trial_total_steps(result, total_steps), (result.metrics or {}).get("step")
    return not total or step is None or step >= total


def latest_checkpoint(result) -> Optional[str]:
    """The path of the trial's latest Train checkpoint, or None.

    Tune registers none (`result.checkpoint` is None): TuneReportCallback puts each one's path in the report of
    its step, so the last report of a trial that was stopped, or logged after its last save, names none.
    """
    frame = result.metrics_dataframe
    if frame is not None and "checkpoint_path" in frame:
        paths = frame["checkpoint_path"].dropna()
        if len(paths):
            return str(paths.iloc[-1])
    return (result.metrics or {}).get("checkpoint_path")


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
                          searched=best["searched"], warning=best.get("warning"))
    return outcome.restore_best_params()
