"""The config-file schema behind `ray-jax-train`: one YAML/JSON file for model, data, training, scaling, run, tune.

Why a schema of its own: a file that reaches a cluster should fail on the driver, before any worker starts, and
say which key is wrong and what is allowed. Every section forbids unknown keys; `ConfigError` carries messages
that name the dotted key path and, for typos, the closest valid key.

    model:    {type: llama, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1}
              # any LlamaConfig field (heads default to Llama's 32); init_from
    data:     {source: stdlib, max_docs: 200}                              # or .txt/.jsonl/.parquet paths or URIs
    tokenizer: {path: null, vocab_size: 512}                               # null: train one at run time
    training: {total_steps: 20, batch_size: 8, learning_rate: 3e-3, ...}  # TrainingArguments fields
    scaling:  {num_workers: 2, cpu_devices_per_worker: 1, use_gpu: false, mesh: {dp: -1}}   # or use_tpu, topology
    run:      {name: tiny, storage_path: ./runs, max_failures: 0, checkpoints_to_keep: 2}
    tune:     {param_space: {training.learning_rate: {loguniform: [1e-4, 1e-2]}}, num_samples: 4, ...}
"""
from __future__ import annotations

import datetime
import difflib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import tempfile
import typing
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ray_jax_train.backend import gpu_share_problem
from ray_jax_train.config import SUPPORTED_MODEL_TYPES, LlamaConfig, canonical_dtype, refuse_bool_numbers
from ray_jax_train.lm.arguments import TrainingArguments
from ray_jax_train.quiet import quiet_run_settings, quiet_train_loop
from ray_jax_train.storage import absolute, is_uri, join, parent
from ray_jax_train.text.errors import read_error

__all__ = [
    "ConfigError",
    "ExperimentConfig",
    "TUNABLE_SECTIONS",
    "apply_overrides",
    "build_trainer",
    "PreparedData",
    "prepare_data",
    "check_cluster_fits",
    "jax_config_for",
    "load_config",
    "parse_config",
]


class ConfigError(ValueError):
    """A config that cannot run: unknown key, wrong type, missing file, bad override. The CLI exits 2 on it."""


# TrainingArguments fields that the file sets in another section (one place per setting).
MOVED_TRAINING_KEYS = {
    "num_workers": "scaling.num_workers",
    "num_cpu_devices": "scaling.cpu_devices_per_worker",
    "use_gpu": "scaling.use_gpu",
    "mesh": "scaling.mesh",
    "output_dir": "run.storage_path",
    "run_name": "run.name",
    "max_failures": "run.max_failures",
    "save_total_limit": "run.checkpoints_to_keep",
    "gpus_per_worker": "scaling.gpus_per_worker",
    "gpu_memory_fraction": "scaling.gpu_memory_fraction",
    "gpu_memory_preallocate": "scaling.gpu_memory_preallocate",
    "use_tpu": "scaling.use_tpu",
    "topology": "scaling.topology",
    "accelerator_type": "scaling.accelerator_type",
}
# Sections a Tune param space may search over: they change what a trial trains, not where or on what.
TUNABLE_SECTIONS = ("training", "model")
_UNTUNABLE_MODEL_KEYS = ("type", "init_from")


class _Section(BaseModel):
    # inf passed every `ge`/`gt` bound (rope_theta: .inf trained without rope, cpus_per_worker: .inf crashed in Ray).
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)
    _no_bool_numbers = field_validator("*", mode="before")(refuse_bool_numbers)


def _expand_user(value):
    """`~/corpus.txt` as the shell would read it (only storage_path did); URIs and 'stdlib' untouched."""
    if isinstance(value, list):
        return [_expand_user(v) for v in value]
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    return value


def _model_section():
    """`model:` takes every LlamaConfig field (all optional) plus the architecture name and starting weights."""
    fields: Dict[str, Any] = {
        "type": (Literal[tuple(SUPPORTED_MODEL_TYPES)], "llama"),
        "init_from": (Optional[str], None),
        # EasyDeL's model-size index, as RayDistributedTrainer.train(scaling_index=...) takes it: k multiplies the
        # section's widths and head counts (head_dim stays), so a search can vary the model's size in one key.
        "scaling_index": (Optional[int], Field(None, ge=1)),
    }
    for name, info in LlamaConfig.model_fields.items():
        if name != "model_type":
            fields[name] = (Optional[info.annotation], None)
    expand = field_validator("init_from", mode="before")(lambda cls, value: _expand_user(value))
    return create_model("ModelSection", __base__=_Section, __validators__={"_expand": expand}, **fields)


ModelSection = _model_section()
ModelSection.__doc__ = ("The architecture: `type` (llama, mistral, qwen2), any LlamaConfig field, `init_from` "
                        "(a ray_jax_train checkpoint or local HF model directory to start from), and "
                        "`scaling_index` (k multiplies hidden_size, intermediate_size and the head counts).")


class DataSection(_Section):
    """Training text. `stdlib` is the local Python standard library (always there, so examples run offline)."""

    source: Union[str, List[str]] = "stdlib"
    kind: Literal["docstrings", "source"] = "docstrings"
    max_docs: int = Field(200, ge=1)
    eval_source: Optional[Union[str, List[str]]] = None
    eval_fraction: float = Field(0.0, ge=0, lt=1)

    _expand = field_validator("source", "eval_source", mode="before")(lambda cls, value: _expand_user(value))

    @field_validator("source", "eval_source")
    @classmethod
    def _stdlib_alone(cls, value):
        if isinstance(value, list) and "stdlib" in value:  # it was looked for as a file named stdlib
            raise ValueError("'stdlib' (the built-in corpus) cannot be listed with files; give it alone "
                             "(source: stdlib), or list files only")
        return value

    def paths(self, which: str = "source") -> List[str]:
        """The files (or directories, or URIs) of `which`; local glob patterns (`data/*.jsonl`) expanded, sorted."""
        import glob

        value = getattr(self, which)
        if value is None or value == "stdlib":
            return []
        out = []
        for path in [value] if isinstance(value, str) else list(value):
            matches = sorted(glob.glob(path)) if glob.has_magic(path) and not is_uri(path) else []
            out.extend(matches or [path])
        return out


class TokenizerSection(_Section):
    """A local tokenizer directory, or (path null) a byte-level BPE trained on the data at run time."""

    path: Optional[str] = None
    vocab_size: int = Field(512, ge=263)

    _expand = field_validator("path", mode="before")(lambda cls, value: _expand_user(value))


class ScalingSection(_Section):
    """Workers and devices. `gpus_per_worker` < 1 shares GPUs (Tune trials); `use_tpu` with Ray's `topology` and
    `accelerator_type` gives each worker one TPU host of the slice; see docs/cluster.md."""

    num_workers: int = Field(1, ge=1)
    cpu_devices_per_worker: int = Field(1, ge=1)
    use_gpu: bool = False
    use_tpu: bool = False
    topology: Optional[str] = None
    accelerator_type: Optional[str] = None
    cpus_per_worker: Optional[float] = Field(None, ge=0)
    gpus_per_worker: Optional[float] = Field(None, gt=0)
    resources_per_worker: Optional[Dict[str, float]] = None
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    mesh: Optional[Dict[str, int]] = None
    gpu_memory_fraction: Optional[float] = Field(None, gt=0, le=1)
    gpu_memory_preallocate: Optional[bool] = None
    check_resources: bool = True

    @field_validator("resources_per_worker")
    @classmethod
    def _no_negative_amounts(cls, value: Optional[Dict[str, float]]) -> Optional[Dict[str, float]]:
        negative = [f"{k}={v:g}" for k, v in (value or {}).items() if v < 0]
        if negative:  # dropped as if 0, so a worker asked for less than the file said
            raise ValueError(f"{', '.join(negative)}: a resource amount cannot be negative; give 0 or more, or "
                             "leave the resource out")
        return value

    @model_validator(mode="after")
    def _one_place_per_amount(self) -> "ScalingSection":
        given = self.resources_per_worker or {}
        both = [(key, name) for key, name in (("CPU", "cpus_per_worker"), ("GPU", "gpus_per_worker"))
                if key in given and getattr(self, name) is not None]
        if both:  # resources_per_worker won, without a word
            key, name = both[0]
            raise ValueError(f"{name}={getattr(self, name):g} and resources_per_worker {{{key}: {given[key]:g}}} "
                             f"both set a worker's {key}s, and resources_per_worker would win; set it in one of them")
        return self

    def worker_resources(self) -> Dict[str, float]:
        """What one worker asks Ray for (the shape Ray Train will place)."""
        resources = {"CPU": 1.0 if self.cpus_per_worker is None else float(self.cpus_per_worker)}
        if self.use_gpu:
            resources["GPU"] = float(self.gpus_per_worker or 1.0)
        if self.use_tpu:  # Ray's count for a worker that names none: one host's chips of the topology, else 1
            resources["TPU"] = float(self._ray_scaling_config(None).num_tpus_per_worker)
        resources.update({k: float(v) for k, v in (self.resources_per_worker or {}).items()})
        return {k: v for k, v in resources.items() if v > 0}

    def scaling_config(self):
        """Ray's ScalingConfig for these workers. Ray checks TPU settings as it is built (a topology it does not
        know, num_workers not a multiple of the slice's hosts): ValueError."""
        custom = self.cpus_per_worker is not None or self.gpus_per_worker is not None or self.resources_per_worker
        return self._ray_scaling_config(self.worker_resources() if custom else None)

    def _ray_scaling_config(self, resources_per_worker: Optional[Dict[str, float]]):
        from ray.train import ScalingConfig

        # resources_per_worker None: Ray's defaults, and with topology and accelerator_type a TPU host per worker.
        return ScalingConfig(num_workers=self.num_workers, use_gpu=self.use_gpu, use_tpu=self.use_tpu,
                             topology=self.topology, accelerator_type=self.accelerator_type,
                             resources_per_worker=resources_per_worker, placement_strategy=self.placement_strategy)


class RunSection(_Section):
    """Where outputs go and how failures and checkpoints are handled."""

    name: Optional[str] = None
    storage_path: str = "./runs"
    max_failures: int = Field(0, ge=-1)
    checkpoints_to_keep: Optional[int] = Field(None, ge=1)
    tensorboard: bool = False
    address: Optional[str] = None

    @field_validator("name")
    @classmethod
    def _one_directory(cls, value: Optional[str]) -> Optional[str]:
        return _directory_name(value)


def _directory_name(value: Optional[str]) -> Optional[str]:
    """A run or search name is one directory under the storage path: "../x" wrote outside it."""
    if value is not None and (value in ("", ".", "..") or "/" in value or "\\" in value):
        raise ValueError(f"{value!r} must name one directory under the storage path (no '/', not '.' or '..'); "
                         f"put the parent in run.storage_path")
    from ray_jax_train.trainer import run_name_problem

    problem = run_name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


class SchedulerSection(_Section):
    """Early stopping for Tune trials; `grace_period` and `max_t` are optimizer steps. ASHA's `max_t` is set to one
    past the longest trial's total_steps (a given one below it is refused; one at or above it is replaced); set it
    only when trials run by epochs, without total_steps."""

    type: Literal["asha", "fifo", "median"] = "asha"
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2.0, gt=1)
    max_t: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def _used_by_the_type(self) -> "SchedulerSection":
        # Compared with the defaults, not with the keys given: a resumed search reads back a full dump of its config.
        unused = {"fifo": ("grace_period", "reduction_factor", "max_t"), "median": ("reduction_factor", "max_t")}
        ignored = [name for name in unused.get(self.type, ())
                   if getattr(self, name) != type(self).model_fields[name].default]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} set, but the {self.type} scheduler does not use "
                             f"{'it' if len(ignored) == 1 else 'them'} (ASHA does): remove "
                             f"{'it' if len(ignored) == 1 else 'them'}, or use type: asha")
        return self


class TuneSection(_Section):
    """A search over `training.*` / `model.*` keys. Values: a constant, or {choice|grid_search: [..]},
    {uniform|loguniform|randint: [low, high]}, {quniform: [low, high, q]}."""

    param_space: Dict[str, Any] = Field(default_factory=dict)
    num_samples: int = Field(1, ge=1)
    max_concurrent_trials: Optional[int] = Field(None, ge=1)
    metric: str = "loss"
    mode: Literal["min", "max"] = "min"
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    trial_cpus: float = Field(0.1, gt=0)  # the trial function only waits on its Train run
    name: Optional[str] = None
    _one_directory = field_validator("name")(lambda cls, value: _directory_name(value))


SEARCH_SPACES = ("choice", "grid_search", "uniform", "loguniform", "randint", "quniform")


class ExperimentConfig(_Section):
    """The whole file. Build the training pieces with `training_arguments()` and `llama_config(...)`."""

    model: ModelSection = Field(default_factory=ModelSection)  # type: ignore[valid-type]
    data: DataSection = Field(default_factory=DataSection)
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    training: Dict[str, Any] = Field(default_factory=dict)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    run: RunSection = Field(default_factory=RunSection)
    tune: Optional[TuneSection] = None

    @field_validator("training", mode="before")
    @classmethod
    def _training(cls, value):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"must be a mapping of TrainingArguments fields, got {type(value).__name__}")
        moved = [k for k in value if k in MOVED_TRAINING_KEYS]
        if moved:
            raise ValueError("; ".join(f"{k} does not belong here, set {MOVED_TRAINING_KEYS[k]}" for k in moved))
        return value

    def check(self) -> "ExperimentConfig":
        """Checks across sections and against the filesystem (ConfigError); `parse_config` runs them."""
        scaling_config = self._check_scaling()
        # TrainingArguments' and LlamaConfig's own validation, with errors re-rooted under training./model.
        args = self.training_arguments()
        model = self.llama_config()
        # Also here, not only when `fit` builds the trainer: `config validate` and a Tune search's base config get
        # them too (a search otherwise failed every trial the same way, after Ray was up).
        devices = args.num_devices(self.scaling.gpus_per_worker, scaling_config)
        if devices is not None:
            try:
                args.check_devices(devices)
            except ValueError as exc:
                raise ConfigError(f"training/scaling: {exc}") from None
            try:  # the vocabulary may still change (a tokenizer trained at run time): fit checks again then
                args.check_model_on_mesh(model, devices)
            except ValueError as exc:
                raise ConfigError(f"model/scaling: {exc}") from None
        if args.max_sequence_length > model.max_position_embeddings:
            raise ConfigError(f"training.max_sequence_length={args.max_sequence_length} exceeds "
                              f"model.max_position_embeddings={model.max_position_embeddings}: lower "
                              f"training.max_sequence_length to {model.max_position_embeddings} or less, or raise "
                              "model.max_position_embeddings (a pretrained model was trained up to its own value)")
        s = self.scaling
        gpu_only = [k for k in ("gpus_per_worker", "gpu_memory_fraction", "gpu_memory_preallocate")
                    if getattr(s, k) is not None]
        if not s.use_gpu and gpu_only:
            raise ConfigError(f"scaling.{' / '.join(gpu_only)} set but scaling.use_gpu is false, so the run would "
                              "use CPUs; set scaling.use_gpu: true, or remove them")
        try:
            model.check_cudnn_attention(use_gpu=s.use_gpu, seq_len=args.max_sequence_length)
        except ValueError as exc:
            raise ConfigError(f"model.{exc}") from None
        problem = gpu_share_problem(s.num_workers, float(s.gpus_per_worker or 1)) if s.use_gpu else None
        if problem:
            raise ConfigError(f"scaling.gpus_per_worker: {problem}")
        if self.data.source == [] or self.data.eval_source == []:
            raise ConfigError("data.source / data.eval_source: an empty list; give files, or 'stdlib' for the "
                              "built-in corpus")
        self._check_data_settings_apply()
        problem = model.hf_export_problem() if args.save_final_model else None
        if problem:
            raise ConfigError(f"model: {problem}. The run ends by exporting a Hugging Face model, which this config "
                              "cannot be; fix the model section")
        if self.tune is not None:
            self._check_tune_metric()
            # Before anything reads the searched values (trial_lengths): a malformed entry was a traceback there.
            for key, spec in self.tune.param_space.items():
                if key in TUNABLE_SECTIONS and isinstance(spec, dict):  # the nested form of a config section
                    dotted = ", ".join(f"{key}.{name}" for name in list(spec)[:3])
                    raise ConfigError(f"tune.param_space: {key!r} is a section; name each searched setting by its "
                                      f"dotted key ({dotted}: {{...}}), not nested under {key}:")
                try:
                    check_tunable(key)
                    _check_search_space(key, spec)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            _, by_epochs = trial_lengths(args.total_steps, self.tune.param_space)
            if by_epochs and self.tune.scheduler.type == "asha" and self.tune.scheduler.max_t is None:
                raise ConfigError("tune.scheduler.max_t: set it (in optimizer steps) when training.total_steps is "
                                  "not set (or searched with null); ASHA needs to know how long a trial runs")
        if not self.scaling.worker_resources():
            raise ConfigError("scaling: each worker asks Ray for no resources at all (cpus_per_worker: 0, no GPU, no "
                              "resources_per_worker), which Ray cannot place; give cpus_per_worker > 0 or a resource")
        local_uris = [(f"data.{w}", p) for w in ("source", "eval_source") for p in self.data.paths(w)]
        for key, path in local_uris + [("run.storage_path", self.run.storage_path)]:
            if path.startswith("file://"):  # parsed here (no network, unlike a bucket's): it failed a step later
                from ray_jax_train.storage import exists, filesystem

                import glob

                try:
                    filesystem(path)
                    missing = key != "run.storage_path" and not glob.has_magic(path) and not exists(path)
                except (ValueError, OSError) as exc:
                    raise ConfigError(f"{key}: {exc}") from None
                if missing:
                    raise ConfigError(f"{key}: {path!r}: file does not exist")
        for which in ("source", "eval_source"):
            for path in self.data.paths(which):
                if not is_uri(path) and not os.path.exists(path):  # a URI is looked up when the data is read
                    import glob

                    what = "the pattern matches no file" if glob.has_magic(path) else "file does not exist"
                    raise ConfigError(f"data.{which}: {path!r}: {what} (relative paths are read from "
                                     f"{os.getcwd()}); use 'stdlib' for the built-in offline corpus")

        if self.tokenizer.path is not None and not is_uri(self.tokenizer.path):
            self._check_tokenizer_dir(self.tokenizer.path)
        if self.model.init_from is not None and "://" not in self.model.init_from:
            from ray_jax_train.lm.state import weights_dir_kind

            try:
                weights_dir_kind(os.path.abspath(self.model.init_from))
            except FileNotFoundError as exc:
                raise ConfigError(f"model.init_from: {exc}") from None
            # Said once, when the run is built; the vocabulary (the tokenizer's) is known only then.
            check_hf_init_dir(self, model, warn=False)
            check_hf_init_tokenizer(self)
        if self.tune is not None:
            shuffled = self.training.get("shuffle_buffer_size") or "training.shuffle_buffer_size" in self.tune.param_space
            if "training.seed" in self.tune.param_space and not shuffled:
                raise ConfigError("tune.param_space: training.seed seeds only the shuffle buffer, which is off "
                                  "(training.shuffle_buffer_size is not set), so every trial would be the same run. "
                                  "Search model.seed to vary the initial weights, or set "
                                  "training.shuffle_buffer_size to vary the data order")
            self._check_trial_values()
            self._check_max_t(args)
        return self

    def _check_data_settings_apply(self) -> None:
        """Data settings the run would ignore, refused (they were ignored without a word). The defaults are not
        refused: a resumed search reads back a full dump of its config."""
        d = self.data
        if d.eval_source is not None and d.eval_fraction > 0:
            raise ConfigError(f"data.eval_fraction={d.eval_fraction} and data.eval_source are both set: the eval set "
                              "is data.eval_source's, and no fraction of data.source would be held out. Remove "
                              "data.eval_fraction to evaluate on data.eval_source, or data.eval_source to hold out "
                              "that fraction of data.source")
        if d.paths() and d.kind != type(d).model_fields["kind"].default:
            raise ConfigError(f"data.kind={d.kind!r} chooses what the built-in stdlib corpus yields (docstrings or "
                              "whole source files), but data.source names files, which are read as they are; remove "
                              "data.kind, or set data.source: stdlib")

    def _check_scaling(self):
        """The TPU settings, and Ray's ScalingConfig built as `fit` builds it: Ray's own refusals (a TPU topology it
        does not know, num_workers not a multiple of the slice's hosts) and workers that split a TPU host came only
        once Ray was up, or once the slice was reserved. Returns the ScalingConfig."""
        s = self.scaling
        if s.use_tpu and s.use_gpu:
            raise ConfigError("scaling.use_tpu and scaling.use_gpu are both true: a worker runs JAX on one platform, "
                              "and Ray refuses both; set one of them to false")
        gpu_only = [k for k in ("gpus_per_worker", "gpu_memory_fraction", "gpu_memory_preallocate")
                    if getattr(s, k) is not None]
        if s.use_tpu and gpu_only:
            raise ConfigError(f"scaling.{' / '.join(gpu_only)} set with scaling.use_tpu: true, but they are GPU "
                              "settings and the run uses TPUs; remove them")
        if s.topology is not None and not s.use_tpu:  # Ray ignores it then: the run would use CPUs or GPUs
            raise ConfigError(f"scaling.topology={s.topology!r} set but scaling.use_tpu is false; set "
                              "scaling.use_tpu: true for TPU workers, or remove scaling.topology")
        if s.accelerator_type is not None and not (s.use_gpu or s.use_tpu):
            # Ray would keep the CPU workers to nodes of that accelerator, and on a cluster without one it failed
            # once Ray was up, blaming scaling.num_workers (a CLI review).
            raise ConfigError(f"scaling.accelerator_type={s.accelerator_type!r} set but the workers use neither GPUs "
                              "nor TPUs; set scaling.use_gpu: true (or use_tpu) for workers on that accelerator, or "
                              "remove scaling.accelerator_type")
        try:
            scaling_config = s.scaling_config()
        except ValueError as exc:
            tpu = (" TPU workers need scaling.topology and scaling.accelerator_type (e.g. '4x4' and 'TPU-V6E': "
                   "one worker per host of the slice) and scaling.num_workers a multiple of the slice's hosts"
                   if s.use_tpu else "")
            raise ConfigError(f"scaling: Ray's ScalingConfig refuses it: {str(exc).rstrip('.')}.{tpu}") from None
        if s.use_tpu and not s.topology and "TPU" not in (s.resources_per_worker or {}):
            logging.getLogger(__name__).warning(
                "scaling.use_tpu without scaling.topology: each worker gets Ray's default of 1 TPU chip. For a whole "
                "host give scaling.topology and scaling.accelerator_type (e.g. '2x4' and 'TPU-V6E'), or "
                "scaling.resources_per_worker: {TPU: <the host's chips>}.")
        if s.use_tpu:
            from ray_jax_train.tpu import host_share_problem

            problem = host_share_problem(scaling_config, distributed=True)
            if problem:
                raise ConfigError(f"scaling.resources_per_worker: {problem}")
        return scaling_config

    def _check_max_t(self, args: TrainingArguments) -> None:
        """ASHA stops every trial at `max_t` steps, however long its `total_steps`: such a trial ends mid-schedule,
        without its final checkpoint (at max_t == its total_steps, at the log report just before it), and Tune
        counts it as finished, so it could win the search. (max_t at or above the longest trial is replaced by one
        past it.)"""
        s = self.tune.scheduler
        longest, by_epochs = trial_lengths(args.total_steps, self.tune.param_space)  # by epochs: unknown here
        if s.type == "asha" and s.max_t is not None and longest and s.max_t < longest:
            raise ConfigError(
                f"tune.scheduler.max_t={s.max_t} is below the longest trial's training.total_steps ({longest}): ASHA "
                f"would stop those trials at step {s.max_t}, mid-schedule and without their final checkpoint, and "
                "count them as finished. Leave max_t out (ASHA then runs a trial to its end; grace_period and "
                f"reduction_factor still stop weak trials early), or search training.total_steps only up to {s.max_t}")
        if s.type in ("asha", "median") and longest > 1 and not by_epochs and s.grace_period >= longest:
            raise ConfigError(
                f"tune.scheduler.grace_period={s.grace_period} is not below the longest trial's training.total_steps "
                f"({longest}): the {s.type} scheduler only stops trials after grace_period steps, so it would stop "
                f"none and every trial would run to its end. Set grace_period below {longest} (e.g. "
                f"{max(1, longest // 10)}), or scheduler.type: fifo to run every trial out on purpose")

    @staticmethod
    def _check_tokenizer_dir(path: str) -> None:
        """A local tokenizer.path must hold a saved tokenizer: transformers' own error for a directory without one
        named no key and advised installing sentencepiece."""
        fix = ("set it to a directory saved with tokenizer.save_pretrained(dir) (tokenizer.json or "
               "tokenizer_config.json), or null to train one at run time")
        if os.path.isfile(path):
            raise ConfigError(f"tokenizer.path: {path!r} is a file, not a tokenizer directory; {fix}")
        if not os.path.isdir(path):
            raise ConfigError(f"tokenizer.path: directory {path!r} does not exist; {fix}")
        if not any(os.path.isfile(os.path.join(path, name)) for name in
                   ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
            raise ConfigError(f"tokenizer.path: {path!r} holds no tokenizer; {fix}")

    def _check_trial_values(self, max_combinations: int = 256) -> None:
        """Every listed value and range end of the search must make a valid config with some choice of the other
        searched values (constants applied): a bad one is then a config error before any trial starts, not a
        search whose every trial fails. Searches with more combinations than `max_combinations` are not checked."""
        data = self.model_dump(mode="json")
        data["tune"] = None
        space = self.tune.param_space
        candidates = {key: search_candidates(spec) for key, spec in space.items()}
        if math.prod(len(v) for v in candidates.values()) > max_combinations:
            return
        keys = list(candidates)
        grid_keys = [k for k in keys if isinstance(space[k], dict) and "grid_search" in space[k]]
        failures: Dict[Tuple[str, int], str] = {}
        passed = set()
        grid_failures: Dict[Tuple[int, ...], str] = {}
        grid_passed = set()
        for combination in itertools.product(*(range(len(candidates[k])) for k in keys)):
            trial = _with_values(data, {key: candidates[key][index] for key, index in zip(keys, combination)})
            grid_point = tuple(index for key, index in zip(keys, combination) if key in grid_keys)
            try:
                parse_config(trial).training_arguments()
                passed.update(zip(keys, combination))
                grid_passed.add(grid_point)
            except ValueError as exc:  # ConfigError included
                for item in zip(keys, combination):
                    failures.setdefault(item, str(exc))
                grid_failures.setdefault(grid_point, str(exc))
        # Where no combination passes, every key's values failed: blame first a key the error itself names.
        for (key, index), error in sorted(failures.items(), key=lambda item: item[0][0] not in item[1]):
            if (key, index) not in passed:
                value = candidates[key][index]
                hint = ("\n  A list is one value here; search its items with {grid_search: [...]} (each one) or "
                        "{choice: [...]} (sampled)." if isinstance(value, list) else "")
                raise ConfigError(f"tune.param_space.{key}: trials given {value!r} would fail: {error}{hint}")
        # A float range's ends may be whole numbers that an integer setting takes; the values Tune samples are not.
        # Values from inside each range, beside ends that passed (kept out of the product: a few values per range).
        passing = next((c for c in itertools.product(*(range(len(candidates[k])) for k in keys))
                        if all(item in passed for item in zip(keys, c))), None)
        for key, spec in space.items():
            for value in search_candidates(spec, interior=True)[2:] if passing is not None else []:
                trial = _with_values(data, {other: value if other == key else candidates[other][index]
                                            for other, index in zip(keys, passing)})
                try:
                    parse_config(trial).training_arguments()
                except ValueError as exc:
                    raise ConfigError(f"tune.param_space.{key}: trials given {value!r} would fail: {exc}"
                                      f"{_whole_number_hint(spec, value)}") from None
        # Every combination of grid values runs (random keys are drawn per trial), so each must work.
        for grid_point, error in grid_failures.items():
            if grid_point not in grid_passed:
                named = ", ".join(f"{k}={candidates[k][i]!r}" for k, i in zip(grid_keys, grid_point))
                raise ConfigError(f"tune.param_space: the grid runs every combination of its values, and the trial "
                                  f"given {named} would fail: {error}\n  Drop one of those values, or search the valid "
                                  "combinations in separate runs.")

    # -- what the trainer needs ---------------------------------------------------------------------------

    def training_arguments(self, **overrides) -> TrainingArguments:
        s, r = self.scaling, self.run
        values = dict(self.training, num_workers=s.num_workers, num_cpu_devices=s.cpu_devices_per_worker,
                      use_gpu=s.use_gpu, use_tpu=s.use_tpu, topology=s.topology, accelerator_type=s.accelerator_type,
                      mesh=s.mesh, output_dir=absolute(r.storage_path), run_name=r.name,
                      max_failures=r.max_failures, save_total_limit=r.checkpoints_to_keep)
        values.update(overrides)
        try:
            return TrainingArguments.model_validate(values)
        except ValidationError as exc:
            message = format_validation_error(exc, prefix=("training",), model=TrainingArguments)
            # Settings that other sections pass in are named where the file sets them (scaling.mesh, not training.mesh).
            moved = "|".join(re.escape(k) for k in MOVED_TRAINING_KEYS)
            message = re.sub(rf"^(\s*)training\.({moved})\b", lambda m: m[1] + MOVED_TRAINING_KEYS[m[2]], message,
                             flags=re.M)
            raise ConfigError(message) from None

    def model_fields_set_values(self) -> Dict[str, Any]:
        return {k: v for k, v in self.model.model_dump().items()
                if k not in ("type", "init_from", "scaling_index") and v is not None}

    def hf_init_dir(self) -> Optional[str]:
        """`model.init_from` when it is a local Hugging Face model directory."""
        from ray_jax_train.lm.state import is_hf_model_dir

        path = self.model.init_from
        if path is None or "://" in path or not os.path.isdir(path) or not is_hf_model_dir(path):
            return None
        return os.path.abspath(path)

    def llama_config(self, tokenizer=None, *, warn: bool = False) -> LlamaConfig:
        """The model config; vocab size and special token ids come from the tokenizer unless set. Starting from a
        Hugging Face directory, fields the model section leaves out come from its config.json: that model is
        what is fine-tuned (LlamaConfig's defaults would be another model, 4096 wide, its weights refused).
        `training.dtype` / `training.param_dtype` apply, and bf16 weights loaded from such a directory train as
        float32 master weights unless a param_dtype is given (`warn` says so in the log)."""
        values = self.model_fields_set_values()
        model_type = self.model.type
        hf_dir = self.hf_init_dir()
        if hf_dir is not None:
            from ray_jax_train.models import load_hf_config

            try:
                hf = load_hf_config(hf_dir).model_dump()
            except ValueError as exc:  # an architecture we have no model for: a config problem, not a crash
                raise ConfigError(f"model.init_from: {exc}") from None
            if "type" not in self.model.model_fields_set:
                model_type = hf["model_type"]
            elif model_type != hf["model_type"]:
                raise ConfigError(
                    f"model.type: {model_type!r} contradicts model.init_from's config.json ({hf_dir}), whose model_type "
                    f"is {hf['model_type']!r}: its weights are that architecture. Leave model.type out (it is taken "
                    "from config.json).")
            values = {**{k: v for k, v in hf.items() if v is not None and k != "model_type"}, **values}
        index = self.model.scaling_index
        if index not in (None, 1):
            if hf_dir is not None:
                raise ConfigError(f"model.scaling_index={index}: it multiplies the sizes of a model trained from "
                                  "scratch, and model.init_from's weights have their own; leave one of them out")
            from ray_jax_train.config import DEFAULT_SCALING_VARIABLES

            for name in DEFAULT_SCALING_VARIABLES:
                base = values.get(name, LlamaConfig.model_fields[name].default)
                if base is not None:
                    values[name] = base * index
        values.setdefault("vocab_size", len(tokenizer) if tokenizer is not None else self.tokenizer.vocab_size)
        if tokenizer is not None:  # said as a vocabulary too small, not as the tokenizer's ids outside the model's
            from ray_jax_train.lm.data import check_tokenizer_fits

            try:
                check_tokenizer_fits(tokenizer, int(values["vocab_size"]))
            except ValueError as exc:
                raise ConfigError(f"model.vocab_size: {exc}") from None
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if tokenizer is not None and getattr(tokenizer, name, None) is not None:
                values.setdefault(name, getattr(tokenizer, name))
        values.setdefault("max_position_embeddings", max(2048, int(self.training.get("max_sequence_length", 512))))
        try:
            config = LlamaConfig(model_type=model_type, **values)
            precision = {k: canonical_dtype(self.training[k], f"training.{k}") for k in ("dtype", "param_dtype")
                         if self.training.get(k) is not None}
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix=("model",), model=LlamaConfig)) from None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        from ray_jax_train.lm.distributed_trainer import training_precision

        loaded = hf_dir is not None and "param_dtype" not in self.model_fields_set_values()
        if warn:
            self._say_what_is_overridden(config, precision)
        return training_precision(config, precision.get("dtype"), precision.get("param_dtype"),
                                  loaded_weights=loaded, warn=warn)

    def _say_what_is_overridden(self, config: LlamaConfig, precision: Dict[str, str]) -> None:
        """A precision the model section sets and the training section overrides, said once when the run is built
        (it was taken silently)."""
        log = logging.getLogger(__name__)
        for key, value in precision.items():
            written = self.model_fields_set_values().get(key)
            if written is not None and canonical_dtype(written, f"model.{key}") != value:
                log.warning("training.%s=%s overrides model.%s=%s for this run.", key, value, key, written)

    def has_eval_data(self) -> bool:
        """Whether `_datasets` gives an eval set: eval_source, or (stdlib) a fraction that holds a document."""
        if self.data.eval_source is not None:
            return True
        if self.data.paths():  # the files' rows are counted when they are read
            return self.data.eval_fraction > 0
        return int(self.data.max_docs * self.data.eval_fraction) >= 1

    def _check_tune_metric(self) -> None:
        """Tune stops the whole search at the first report without its metric: a typo, or eval_* without eval
        data, would fail only once Ray is up, a tokenizer trained and a trial compiled."""
        from ray_jax_train.lm.loop import REPORTED_KEYS, STARTUP_KEYS

        metric = self.tune.metric
        # Start-up facts are in an attempt's first record only, and step/epoch only count: a trial's last result
        # would never rank by them, and the search would end in "no trial reported" after running every trial.
        rankable = [k for k in REPORTED_KEYS if k not in STARTUP_KEYS + ("step", "epoch")]
        if metric not in rankable:
            close = difflib.get_close_matches(metric, rankable, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"tune.metric: {metric!r} is not a metric a search can rank trials by. {hint}"
                              f"Use one of: {', '.join(rankable)}")
        better = {"loss": "min", "perplexity": "min", "eval_loss": "min", "eval_perplexity": "min",
                  "step_time_s": "min", "tokens_per_s": "max", "mfu": "max"}.get(metric)
        if better is not None and self.tune.mode != better:
            raise ConfigError(f"tune.mode: {self.tune.mode!r} would pick the trial with the "
                              f"{'highest' if better == 'min' else 'lowest'} {metric}, the worst one; set tune.mode: "
                              f"{better}")
        if metric.startswith("eval_") and not self.has_eval_data():
            raise ConfigError(f"tune.metric: {metric!r} needs eval data; set data.eval_source (or, for the stdlib "
                              "corpus, data.eval_fraction > 0), or tune on 'loss'")

    def with_absolute_paths(self) -> "ExperimentConfig":
        """A copy whose local paths are absolute (URIs as given): for code that runs in another working directory,
        such as a Tune trial, which Ray moves into a directory of its own."""
        def fix(value):
            if value is None or value == "stdlib":
                return value
            return [absolute(v) for v in value] if isinstance(value, list) else absolute(value)

        return self.model_copy(update={
            "data": self.data.model_copy(update={"source": fix(self.data.source),
                                                 "eval_source": fix(self.data.eval_source)}),
            "tokenizer": self.tokenizer.model_copy(update={"path": fix(self.tokenizer.path)}),
            "model": self.model.model_copy(update={"init_from": fix(self.model.init_from)}),
            "run": self.run.model_copy(update={"storage_path": absolute(self.run.storage_path)}),
        })

    def run_name(self) -> str:
        import time

        return self.run.name or f"{self.model.type}-{time.strftime('%Y%m%d-%H%M%S')}"


# -- loading, overrides, errors ----------------------------------------------------------------------------


def read_file(path: str) -> Dict[str, Any]:
    """A YAML or JSON mapping from `path` (ConfigError when missing, unparsable or not a mapping)."""
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory; give the YAML or JSON file in it (e.g. "
                          "examples/tiny_llama.yaml)")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith(".json"):
            data = json.loads(text, object_pairs_hook=_no_duplicate_pairs)
        else:
            data = yaml.load(text, Loader=_NoDuplicatesLoader)  # noqa: S506 (a SafeLoader)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: key {exc} is given twice; the second would silently replace the first. Merge "
                          "them into one") from None
    except _MisreadNumber as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if data is None or data == {}:
        raise ConfigError(f"{path}: the file {'is empty' if data is None else 'sets nothing'}; start from "
                          "examples/tiny_llama.yaml (an empty config would "
                          "mean Llama's default sizes, 4096 wide and 32 layers)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections "
                          f"({', '.join(ExperimentConfig.model_fields)}), got {type(data).__name__}")
    return data


class _DuplicateKey(Exception):
    pass


class _MisreadNumber(Exception):
    pass


def _no_duplicate_pairs(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(repr(key))
        seen[key] = value
    return seen


class _NoDuplicatesLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error, not last-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys it brings may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"{key!r} (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)  # merges `<<` keys, those given here winning

    def construct_yaml_int(self, node):
        # YAML 1.1 reads 012 as octal 10: total_steps: 012 trained 10 steps.
        text = self.construct_scalar(node).replace("_", "")
        _refuse_base_60(node, text)
        value = super().construct_yaml_int(node)
        if re.fullmatch(r"[-+]?0[0-7]+", text) and value != int(text, 10):  # 00 and 07 mean what they say
            raise _MisreadNumber(f"{text}{_line(node)} reads as the octal number {value} in YAML; write it without "
                                 f"the leading 0 (or quoted, '{text}', for text)")
        return value

    def construct_yaml_float(self, node):
        _refuse_base_60(node, self.construct_scalar(node))
        return super().construct_yaml_float(node)


def _line(node) -> str:
    return f" (line {node.start_mark.line + 1})" if node.start_mark.line else ""


def _refuse_base_60(node, text: str) -> None:
    """YAML 1.1 reads 1:30 as 90 (base 60): total_steps: 1:30 trained 90 steps."""
    if ":" in text:
        value = yaml.SafeLoader.construct_yaml_float(yaml.SafeLoader(""), node)
        raise _MisreadNumber(f"{text}{_line(node)} reads as the base-60 number {value:g} in YAML; write the number "
                             f"itself (or quoted, '{text}', for text)")


_NoDuplicatesLoader.add_constructor("tag:yaml.org,2002:int", _NoDuplicatesLoader.construct_yaml_int)
_NoDuplicatesLoader.add_constructor("tag:yaml.org,2002:float", _NoDuplicatesLoader.construct_yaml_float)
# YAML 1.1 reads a plain `1e-4` (no dot) as a string; everyone means the number. Plain scalars only: a quoted
# "1e3" (a run name) stays text.
_NoDuplicatesLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                          re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                          list("-+0123456789."))


def load_config(path: str, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read, apply `--set` overrides, validate. Raises ConfigError with the key path named."""
    return parse_config(apply_overrides(read_file(path), overrides))


def parse_config(data: Dict[str, Any]) -> ExperimentConfig:
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model=ExperimentConfig)) from None
    return config.check()


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """`a.b.c=value` -> data["a"]["b"]["c"] = YAML-parsed value; the path must exist in the schema."""
    data = json.loads(json.dumps(data))  # a deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set training.learning_rate=1e-3")
        key, raw = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if parts[:2] == ["tune", "param_space"] and len(parts) > 2:
            # A searched key is itself dotted: tune.param_space.training.learning_rate names one entry.
            parts = parts[:2] + [".".join(parts[2:])]
        if not key or not all(parts):
            raise ConfigError(f"--set {item!r}: {key!r} is not a dotted key path like training.batch_size")
        resolve_path(parts, what="--set")
        try:
            value = yaml.load(raw, Loader=_NoDuplicatesLoader) if raw.strip() else None  # noqa: S506 (safe)
        except yaml.YAMLError:
            value = raw
        except _DuplicateKey as exc:  # a string setting would take the whole text as its value
            raise ConfigError(f"--set {item!r}: key {exc} is given twice") from None
        except _MisreadNumber as exc:
            raise ConfigError(f"--set {item!r}: {exc}") from None
        if isinstance(value, dict) and any(v is None and re.fullmatch(r"[^:\s]+:\S+", str(k)) for k, v in value.items()):
            # YAML reads {dp:1} as the key "dp:1" with no value; the schema's error named that key only
            spaced = raw.replace(":", ": ").replace(",", ", ").replace(":  ", ": ").replace(",  ", ", ")
            raise ConfigError(f"--set {item!r}: YAML needs a space after each colon in a mapping: "
                              f"--set '{key}={spaced}'")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return data


def _section_fields(cls) -> Optional[Dict[str, Any]]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return dict(cls.model_fields)
    return None


def _unwrap(annotation):
    """The BaseModel class or `dict` marker inside Optional[...]/Union[...] annotations, else None."""
    origin = typing.get_origin(annotation)
    if origin is Union:
        for arg in typing.get_args(annotation):
            found = _unwrap(arg)
            if found is not None:
                return found
        return None
    if origin in (dict, Dict) or annotation is dict:
        return dict
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def resolve_path(parts: Sequence[str], what: str = "") -> str:
    """Check that a dotted path names a setting; returns its kind ("leaf" or "free" below a mapping)."""
    cls: Any = ExperimentConfig
    for i, part in enumerate(parts):
        here = ".".join(parts[:i + 1])
        if cls is dict:
            return "free"
        if i == 1 and parts[0] == "training":
            cls = TrainingArguments
            if part in MOVED_TRAINING_KEYS:
                raise ConfigError(f"{what + ' ' if what else ''}{here}: set it as {MOVED_TRAINING_KEYS[part]}")
        fields = _section_fields(cls)
        if fields is None:
            raise ConfigError(f"{what + ' ' if what else ''}{here}: {'.'.join(parts[:i])} is a single value, it has no sub-keys")
        if part not in fields:
            raise ConfigError((f"{what} " if what else "") + _unknown_key(here, part, fields, exclude=MOVED_TRAINING_KEYS
                                                         if cls is TrainingArguments else ()))
        annotation = fields[part].annotation
        if parts[:i + 1] == ["training"]:
            cls = TrainingArguments
        else:
            cls = _unwrap(annotation)
    return "leaf"


def check_tunable(key: str) -> None:
    """A param-space key must be an existing `training.*` or `model.*` setting that changes the trial."""
    parts = key.split(".")
    if parts[0] not in TUNABLE_SECTIONS or len(parts) != 2 or parts[1] in _UNTUNABLE_MODEL_KEYS:
        resolve_path(parts, what="tune.param_space:")
        raise ValueError(f"tune.param_space: {key!r} is not tunable; a search may vary training.* and model.* "
                         f"settings (e.g. training.learning_rate, model.hidden_size), not where or on what it runs")
    resolve_path(parts, what="tune.param_space:")


def _check_search_space(key: str, spec: Any) -> None:
    if isinstance(spec, dict):
        if len(spec) != 1 or next(iter(spec)) not in SEARCH_SPACES:
            raise ValueError(f"tune.param_space.{key}: {spec!r} is not a search space; use one of "
                             + ", ".join(f"{{{name}: [...]}}" for name in SEARCH_SPACES) + " or a constant")
        (name, args), = spec.items()
        if not isinstance(args, list) or not args:
            raise ValueError(f"tune.param_space.{key}.{name}: expected a non-empty list, got {args!r}")
        if name in ("uniform", "loguniform", "randint") and len(args) != 2:
            raise ValueError(f"tune.param_space.{key}.{name}: expected [low, high], got {args!r}")
        if name == "quniform" and len(args) != 3:
            raise ValueError(f"tune.param_space.{key}.{name}: expected [low, high, q] (values rounded to a "
                             f"multiple of q), got {args!r}")
        if name in ("uniform", "loguniform", "randint", "quniform"):
            # Tune itself would only say so once a search had started (Ray up, a tokenizer trained).
            low, high = args[0], args[1]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in args):
                raise ValueError(f"tune.param_space.{key}.{name}: bounds must be finite numbers, got {args!r}")
            if low >= high:
                raise ValueError(f"tune.param_space.{key}.{name}: low {low} must be below high {high}")
            if name == "loguniform" and low <= 0:
                raise ValueError(f"tune.param_space.{key}.loguniform: low {low} must be > 0 (a log scale)")
            if name == "quniform" and args[2] <= 0:
                raise ValueError(f"tune.param_space.{key}.quniform: q {args[2]} must be > 0")


def _unknown_key(path: str, key: str, fields, exclude=()) -> str:
    from ray_jax_train.lm.arguments import KEY_ALIASES, TrainingArguments

    valid = [k for k in fields if k not in exclude]
    named = KEY_ALIASES.get(key, key)
    here = path.split(".", 1)[0] if "." in path else None
    sections = {"training": TrainingArguments.model_fields, "model": ModelSection.model_fields}
    elsewhere = [f"{section}.{named}" for section, names in sections.items() if section != here and named in names]
    if named in valid:
        close = [named]
    else:  # a near-exact spelling here, else the same setting in another section, else a looser spelling here
        close = (difflib.get_close_matches(key, valid, n=1, cutoff=0.85) or elsewhere[:1]
                 or difflib.get_close_matches(key, valid, n=1, cutoff=0.6))
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{path}: unknown key. {hint}Valid keys here: {', '.join(valid)}"


def _model_at(model, loc: Sequence[Any]):
    cls = model
    for part in loc:
        if isinstance(part, int):
            continue
        if cls is ExperimentConfig and part == "training":
            cls = TrainingArguments
            continue
        fields = _section_fields(cls)
        if fields is None or part not in fields:
            return None
        cls = _unwrap(fields[part].annotation)
    return cls


def format_validation_error(exc: ValidationError, *, prefix: Tuple[str, ...] = (), model=ExperimentConfig) -> str:
    """One line per problem: `key.path: what is wrong (what is allowed)`."""
    lines = []
    for error in exc.errors():
        loc = tuple(str(p) for p in error.get("loc", ()) if not isinstance(p, int))
        # Union members show up as loc parts like "str" / "list[str]": drop them.
        loc = tuple(p for p in loc if "[" not in p and p not in ("str", "int", "float", "bool"))
        path = ".".join(prefix + loc) or "(top level)"
        kind = error.get("type", "")
        if kind == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            fields = _section_fields(parent) or {}
            lines.append(_unknown_key(path, loc[-1], fields,
                                      exclude=MOVED_TRAINING_KEYS if parent is TrainingArguments else ()))
            continue
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        given = error.get("input")
        if kind in ("literal_error", "enum"):
            lines.append(f"{path}: {message} (got {given!r})")
        elif kind == "string_type" and isinstance(given, (bool, int, float, datetime.date)):
            # YAML read the text as a number, a boolean (yes, on) or a date: a name like 2024 needs quotes.
            read = ("a boolean (from yes, no, on, off, true or false)" if isinstance(given, bool) else
                    f"the date {given}" if isinstance(given, datetime.date) else f"the number {given!r}")
            text = "on" if isinstance(given, bool) else given
            lines.append(f"{path}: wrong type: {message}, and YAML read {read}; quote it to keep it as text, e.g. "
                         f"{loc[-1] if loc else 'key'}: \"{text}\"")
        elif kind.endswith("_type") or kind.endswith("_parsing"):
            lines.append(f"{path}: wrong type: {message} (got {given!r})")
        else:
            lines.append(f"{path}: {message}")
    seen, out = set(), []
    for line in lines:
        if line not in seen:
            seen.add(line)
            out.append(line)
    return "invalid config:\n  " + "\n  ".join(out)


def dump(config: ExperimentConfig) -> str:
    """The effective config as YAML (defaults filled in), as `config show` prints it.

    Model fields the tokenizer decides at run time (vocab_size and the special token ids, unless set) stay null;
    everything else is the value the run will use, so the output reads back as the same run."""
    data = config.model_dump(mode="json")
    args = config.training_arguments().model_dump(mode="json")
    data["training"] = {k: v for k, v in args.items() if k not in MOVED_TRAINING_KEYS}
    from_tokenizer = {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}
    if config.hf_init_dir() is None:
        from_tokenizer -= set(config.model_fields_set_values())
    else:
        from_tokenizer = set()  # the directory's config.json holds them
    searched = list((config.tune.param_space or {}) if config.tune is not None else {})
    if any(key.startswith("model.") for key in searched):
        # A search over model sizes derives each trial's head_dim and scaling from its own values: the model
        # section stays as given, since values derived from the base config (or scaled by its scaling_index) would
        # read back as another search (a config review).
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    model = config.llama_config().model_dump(mode="json")
    data["model"] = {"type": model.pop("model_type"), "init_from": config.model.init_from,
                     **{k: (None if k in from_tokenizer else v) for k, v in model.items()}}
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


# -- building the run --------------------------------------------------------------------------------------


def check_data_columns(config: ExperimentConfig) -> None:
    """The text or messages column, and a chat template for conversations, checked in the first rows of local data
    files without Ray: `config validate` says what `fit` would only find once Ray and its reads are up (~20 s), and
    `fit` / `tune` say it before Ray starts. Data this cannot read cheaply (URIs, .json arrays) is checked when read."""
    from ray_jax_train.text import check_chat_template, load_tokenizer
    from ray_jax_train.text.errors import TextDataError
    from ray_jax_train.text.sources import peek_columns_each, plan_reads, resolve_column

    text_column = config.training.get("text_column", "text")
    messages_column = config.training.get("messages_column", "messages")
    if config.data.source == "stdlib" and text_column != "text":  # found 30 s in, once Ray had read the corpus
        raise ConfigError(f"training.text_column={text_column!r}, but data.source is the built-in stdlib corpus, "
                          "whose rows hold their text in 'text'; leave training.text_column out, or set data.source "
                          "to your own files")
    for which in ("source", "eval_source"):
        paths = config.data.paths(which)
        if paths and not any(is_uri(p) for p in paths):
            try:  # empty files, a directory of no data format: a listing, no read
                plan_reads(paths)
            except (TextDataError, OSError) as exc:
                raise ConfigError(f"data.{which}: {exc}") from None
        try:
            peeked = peek_columns_each(config.data.paths(which))
        except TextDataError as exc:
            raise ConfigError(f"data.{which}: {exc}") from None
        if not peeked:
            continue
        first, columns = peeked[0]
        try:
            kind, _ = resolve_column(columns, text_column, messages_column)
        except TextDataError as exc:
            raise ConfigError(f"data.{which} ({first}): {exc}") from None
        for file, columns in peeked[1:]:  # one shard under another column name: its rows read as null text
            try:
                other, _ = resolve_column(columns, text_column, messages_column)
            except TextDataError as exc:
                raise ConfigError(f"data.{which}: {file} differs from {first}: {exc} Every file must hold the same "
                                  "column: rename it in that file, or leave the file out.") from None
            if other == "messages" and kind != "messages":  # text files and chat files: the chats need a template
                first, kind = file, other
        tokenizer_dir = config.tokenizer.path or init_tokenizer_dir(config)
        if kind != "messages" or tokenizer_dir is None or is_uri(tokenizer_dir):
            continue  # a tokenizer trained at run time gets a chat template that marks assistant turns
        try:
            check_chat_template(load_tokenizer(tokenizer_dir))
        except TextDataError as exc:
            raise ConfigError(f"data.{which} ({first}) holds conversations in {messages_column!r}, and the tokenizer "
                              f"in {tokenizer_dir} cannot train on them: {exc}") from None
    _check_model_vocab_fits_tokenizer(config)


def _check_model_vocab_fits_tokenizer(config: ExperimentConfig) -> None:
    """A model.vocab_size below a local tokenizer's size, said before Ray starts (it was, 30 s in)."""
    vocab_size = config.model_fields_set_values().get("vocab_size")
    if vocab_size is None or (config.tune is not None and "model.vocab_size" in config.tune.param_space):
        return  # searched values are checked against the tokenizer once the driver has it
    tokenizer_dir = config.tokenizer.path or init_tokenizer_dir(config)
    if tokenizer_dir is None and int(vocab_size) < config.tokenizer.vocab_size:
        # Trained at run time, up to tokenizer.vocab_size tokens: on any corpus of some size it reaches that, and
        # the run failed 20-30 s in, once Ray was up and the tokenizer trained (a CLI review).
        raise ConfigError(
            f"model.vocab_size={vocab_size} is below tokenizer.vocab_size={config.tokenizer.vocab_size}: the "
            f"tokenizer trained at run time gives ids up to {config.tokenizer.vocab_size - 1}, and each needs a row "
            "in the model's embedding. Leave model.vocab_size out (it follows the tokenizer), or set "
            f"tokenizer.vocab_size to at most {vocab_size}.")
    if tokenizer_dir is None or is_uri(tokenizer_dir):
        return
    from ray_jax_train.lm.data import check_tokenizer_fits
    from ray_jax_train.text import ensure_pad_token, load_tokenizer

    try:
        check_tokenizer_fits(ensure_pad_token(load_tokenizer(tokenizer_dir)), int(vocab_size))
    except ValueError as exc:
        raise ConfigError(f"model.vocab_size: {exc}") from None


def corpus_texts(config: ExperimentConfig, limit: Optional[int] = None) -> List[str]:
    """Texts to train a tokenizer on: the stdlib corpus, or the first `data.max_docs` rows of the data files: their
    text column, or their conversations' message contents (a messages column wins, as in training)."""
    from ray_jax_train.text import load_text_dataset, local_corpus
    from ray_jax_train.text.errors import TextDataError
    from ray_jax_train.text.sources import resolve_column

    limit = limit or config.data.max_docs
    if not config.data.paths():
        return list(local_corpus(kind=config.data.kind, max_docs=limit))
    text_column = config.training.get("text_column", "text")
    messages_column = config.training.get("messages_column", "messages")
    try:
        rows = load_text_dataset(config.data.paths()).take(limit)
    except Exception as exc:
        paths = config.data.paths()
        raise ConfigError(f"data.source ({', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}) could not be "
                          f"read: {read_error(exc)}") from None
    if not rows:
        raise ConfigError("data.source has no rows, so there is nothing to train a tokenizer on")
    columns = sorted({name for row in rows for name in row})
    try:
        kind, column = resolve_column(columns, text_column, messages_column) or ("text", text_column)
    except TextDataError:  # neither column: said below, with the keys to set
        kind, column = "text", text_column
    texts = []
    for row in rows:
        value = row.get(column)
        if kind == "messages" and value is not None:
            value = "\n".join(m.get("content") for m in list(value)
                              if isinstance(m, Mapping) and isinstance(m.get("content"), str))
        if isinstance(value, str) and value:
            texts.append(value)
    if not texts:
        found = (f"has no column {column!r} (its columns are {columns})" if column not in columns else
                 f"has no non-empty {column!r} {'conversation' if kind == 'messages' else 'text'} in its first "
                 f"{len(rows)} rows")
        raise ConfigError(f"data.source {found}, so there is nothing to train a tokenizer on. Set "
                          "training.text_column (or training.messages_column, for conversations) to the column that "
                          "holds the data, or tokenizer.path to a tokenizer directory (then none is trained)")
    return texts


# What the train state's shapes depend on: a resume with any of these (or the params' dtype) changed cannot restore
# the checkpoint.
_STATE_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias")


def check_resumed_model(run_dir: str, model_config: LlamaConfig) -> Optional[str]:
    """A run that will resume from its latest checkpoint must build the model that checkpoint holds: said here, on
    the driver, from the model config the checkpoint records, instead of by the workers once the state is built.
    Returns that checkpoint (None for a new run), so the driver can say the run resumes."""
    from ray_jax_train.lm.export import _checkpoint_hf_config, _resolve
    from ray_jax_train.storage import exists

    export_log = logging.getLogger("ray_jax_train.lm.export")
    level = export_log.level
    export_log.setLevel(logging.ERROR)  # its "Exporting ..." notice is about an export, not this resume
    try:
        if exists(join(run_dir, "best.json")):
            return None  # a Tune search's directory under this name: no run resumes from it
        checkpoint, _ = _resolve(run_dir)
        saved = None if model_config.hf_export_problem() else _checkpoint_hf_config(checkpoint)
    except Exception as exc:  # noqa: BLE001 - a new run, or nothing readable to resume from: the workers decide
        logging.getLogger(__name__).debug("No resume check against %s: %s", run_dir, exc)
        return None
    finally:
        export_log.setLevel(level)
    if not isinstance(saved, dict):
        return checkpoint  # a checkpoint from before configs were recorded: the restore still compares the arrays
    now = model_config.to_hf_dict()
    changed = [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in _STATE_SHAPE_KEYS
               if k in saved and saved.get(k) != now.get(k)]
    if "dtype" in saved and saved["dtype"] != now.get("dtype"):  # the params' dtype: the restore refused it, later
        changed.append(f"param_dtype {saved['dtype']!r} -> {now.get('dtype')!r}")
    if changed:
        raise ConfigError(
            f"model: this run resumes from {checkpoint}, whose model differs from the one the config builds now "
            f"({'; '.join(changed)}), so the checkpoint cannot be restored. Resume with the model (and tokenizer) "
            "settings the run started with, or start a fresh run under another name (--set run.name=...; in "
            "Python, RunConfig(name=...)), optionally from that checkpoint as model.init_from.")
    from ray_jax_train.lm.state import function_differences

    try:
        before = LlamaConfig.from_hf(saved)
    except ValueError:
        return checkpoint
    moved = [f"{k} {old!r} -> {new!r}" for k, old, new in function_differences(before, model_config)]
    if moved:  # the shapes fit, so it resumes; a change of what the weights compute is worth a line
        logging.getLogger(__name__).warning(
            "This run resumes from %s with other rope or norm settings than it trained with (%s): the weights will "
            "compute other logits from here on. If that is not meant, resume with the settings the run started with "
            "(its config.yaml).", checkpoint, "; ".join(moved))
    return checkpoint


def checkpoint_step(checkpoint: Optional[str]) -> Optional[int]:
    """The step in a checkpoint directory's name, or None (imported late: the checkpoint module loads orbax)."""
    from ray_jax_train.checkpoint.core import checkpoint_step as step_in_name

    return step_in_name(checkpoint)


def check_hf_init_dir(config: ExperimentConfig, model_config: LlamaConfig, *, warn: bool = True) -> None:
    """Starting weights (a Hugging Face directory, or a local checkpoint that records its model) must fit the model
    the config builds: their shapes, and their rope and norm settings unless the model section sets them (then
    `warn` says so)."""
    from ray_jax_train.lm.state import check_checkpoint_fits, check_hf_dir_fits, weights_dir_kind

    hf_dir = config.hf_init_dir()
    if hf_dir is None:
        path = config.model.init_from
        if path is None or is_uri(path) or weights_dir_kind(os.path.abspath(path)) != "checkpoint":
            return
        try:
            check_checkpoint_fits(os.path.abspath(path), model_config, "Set the model section's sizes to those the "
                                  "checkpoint's run trained (its config.yaml or model/config.json has them); the vocabulary is the "
                                  "tokenizer's: tokenizer.path must name the one that run used.",
                                  chosen=set(config.model_fields_set_values()),
                                  chosen_how="set them in the model section: {wanted}", warn=warn,
                                  vocabulary_known=warn)
        except ValueError as exc:
            raise ConfigError(f"model.init_from: {exc}") from None
        return
    try:
        # Fields the model section sets differ from config.json's on purpose (the rest are taken from there).
        check_hf_dir_fits(hf_dir, model_config, "Set the model section's sizes to those in its config.json, or "
                                                "leave them out: they are then taken from there.",
                          chosen=set(config.model_fields_set_values()),
                          chosen_how="leave them out of the model section", warn=warn)
    except ValueError as exc:
        raise ConfigError(f"model.init_from: {exc}") from None


def check_hf_init_tokenizer(config: ExperimentConfig) -> Optional[str]:
    """Starting weights need the tokenizer they were trained with: one trained at run time has the same size but
    other ids (the fine-tune would start from scrambled embeddings, and no shape check can see it). Returns that
    tokenizer's directory (None without `model.init_from`, or with a `tokenizer.path`)."""
    if config.tokenizer.path is not None or config.model.init_from is None:
        return None
    found = init_tokenizer_dir(config)
    if found is not None:
        return found
    hf_dir = config.hf_init_dir()
    if hf_dir is not None:
        raise ConfigError(
            f"model.init_from: {hf_dir} has model weights but no tokenizer (tokenizer.json or tokenizer_config.json), "
            "and a tokenizer trained now would give its token ids other meanings. Set tokenizer.path to the "
            "directory of the tokenizer the model was trained with, or save that tokenizer into the model directory "
            "(tokenizer.save_pretrained(dir)).")
    raise ConfigError(
        f"model.init_from: the run of checkpoint {config.model.init_from} kept no tokenizer beside it (<run>/model/ "
        "or <run>/tokenizer/), and a tokenizer trained now would give its token ids other meanings. Set "
        "tokenizer.path to the directory of the tokenizer that run used.")


def init_tokenizer_dir(config: ExperimentConfig) -> Optional[str]:
    """The tokenizer the starting weights (`model.init_from`) were trained with: a Hugging Face directory's own, or
    the one a checkpoint's run kept (`<run>/model/`, else the `<run>/tokenizer/` it trained), at a local path or a
    URI. None when there is none."""
    from ray_jax_train.storage import exists

    hf_dir = config.hf_init_dir()
    if hf_dir is not None:
        found = any(os.path.isfile(os.path.join(hf_dir, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
        return hf_dir if found else None
    path = config.model.init_from
    if path is None or not exists(join(path, "_CHECKPOINT_METADATA")):
        return None
    from ray_jax_train.lm.export import MODEL_FILES

    run_dir = parent(path)
    for name in (MODEL_FILES, TOKENIZER_DIR):
        if exists(join(run_dir, name, "tokenizer.json")):
            return join(run_dir, name)
    return None


def _with_values(data: Dict[str, Any], values: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of config `data` with dotted keys (`training.learning_rate`) set to `values`: one trial's config."""
    trial = json.loads(json.dumps(data))
    for key, value in values.items():
        section, name = key.split(".", 1)
        trial[section] = {**(trial.get(section) or {}), name: value}
    return trial


# A randint range of at most this many values has each one checked (a check parses a trial's config, ~0.1 s).
_RANDINT_CHECK_ALL = 16


def search_candidates(spec: Any, *, interior: bool = False) -> List[Any]:
    """The values a search space entry can give, ranges as their two ends (randint's high end is exclusive).

    `interior` adds values Tune could sample from inside a range: for a float range one value (the ends of
    `uniform: [0, 10]` are whole numbers that an integer setting takes, the 3.7 that Tune samples is not), for
    quniform a multiple of q that is not whole if there is one, and for randint every value of a small range (33
    in [32, 37) is not divisible by 2 heads), else some of both parities near each end and in the middle."""
    kind, values = next(iter(spec.items())) if isinstance(spec, dict) else ("constant", [spec])
    if kind == "randint":
        low, last = int(values[0]), int(math.ceil(values[1])) - 1
        ends = [low, last]
        if interior and last - low + 1 <= _RANDINT_CHECK_ALL:
            ends += list(range(low + 1, last))
        elif interior:
            mid = (low + last) // 2
            ends += [v for v in dict.fromkeys((low + 1, low + 2, mid, mid + 1, last - 2, last - 1)) if low < v < last]
        return ends
    if kind in ("uniform", "loguniform", "quniform"):
        ends = list(values[:2])
        if interior and kind == "quniform":
            low, high, q = values
            steps = [k * q for k in range(math.floor(low / q) + 1, math.ceil(high / q))][:64]
            fractional = [v for v in steps if not float(v).is_integer()]
            ends += (fractional or steps)[:1]
        elif interior and ends[0] != ends[1]:
            low, high = float(ends[0]), float(ends[1])
            inside = low * (high / low) ** 0.37 if kind == "loguniform" else low + 0.37 * (high - low)
            ends.append(inside + 0.5 if inside.is_integer() and high - inside > 0.5 else inside)
        return ends
    return list(values)


def _whole_number_hint(spec: Any, value: Any) -> str:
    """For a float range over what may be an integer setting: the range Tune would sample whole numbers from."""
    kind, values = next(iter(spec.items()))
    if kind not in ("uniform", "loguniform", "quniform") or float(value).is_integer():
        return ""
    low, high = values[0], values[1]
    if kind == "quniform":
        return (f'\n  Tune samples multiples of q={values[2]} from {{"quniform": {list(values)}}}, such as {value!r}; '
                f'for whole numbers use {{"randint": [{math.ceil(low)}, {math.floor(high) + 1}]}} (its high end is '
                'exclusive) or a whole q.')
    if kind == "uniform" and float(low).is_integer() and float(high).is_integer():
        return (f'\n  Tune samples floats from {{"{kind}": {list(values)}}}; for whole numbers use {{"randint": '
                f'[{int(low)}, {int(high) + 1}]}} (its high end is exclusive).')
    return f'\n  Tune samples floats from {{"{kind}": {list(values)}}}; for whole numbers use randint or choice.'


def trial_lengths(base_steps: Optional[int], param_space: Dict[str, Any]) -> Tuple[int, bool]:
    """(the most optimizer steps a trial can be set to run, 0 if none is; whether some trial runs by epochs,
    for a length the driver cannot know): from the base's `training.total_steps` or the searched values."""
    spec = param_space.get("training.total_steps")
    values = [base_steps] if spec is None else search_candidates(spec)
    # Values that are no number of steps (a string, a list) are not lengths: the trial-values check names them.
    steps = [int(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return max(steps, default=0), None in values


TOKENIZER_REQUEST = "ray_jax_train_request.json"  # beside a trained tokenizer: the settings it was trained for
TOKENIZER_DIR = "tokenizer"  # in the run directory: the tokenizer trained for the run


def _tokenizer_request(config: ExperimentConfig) -> Dict[str, Any]:
    """What decides a trained tokenizer's ids: its size and the texts it learned from."""
    return {"vocab_size": config.tokenizer.vocab_size, "source": config.data.paths() or "stdlib",
            "kind": config.data.kind, "max_docs": config.data.max_docs,
            "text_column": config.training.get("text_column", "text")}


def _recorded_request(directory: str) -> Optional[Dict[str, Any]]:
    """The request a tokenizer in `directory` was trained for; None if there is none, or it predates the record."""
    from ray_jax_train.storage import exists, filesystem

    if not exists(join(directory, TOKENIZER_REQUEST)):
        return None
    fs, path = filesystem(join(directory, TOKENIZER_REQUEST))
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode("utf-8"))


def trained_tokenizer_dir(config: ExperimentConfig, directory: str) -> str:
    """`directory`, unless it holds a tokenizer trained for other settings: then a sibling named after these.

    A new Tune search under an old name starts new trials, so it needs no old ids, and it must not silently keep
    a tokenizer of another `tokenizer.vocab_size` or data; the old one stays for the earlier search's best.json."""
    from ray_jax_train.storage import exists

    recorded = _recorded_request(directory) if exists(join(directory, "tokenizer.json")) else None
    if recorded is None or recorded == json.loads(json.dumps(_tokenizer_request(config))):
        return directory
    digest = hashlib.sha256(json.dumps(_tokenizer_request(config), sort_keys=True).encode()).hexdigest()[:8]
    where, mark, query = directory.partition("?")  # a URI keeps its query (an S3 endpoint) at the end
    return f"{where.rstrip('/')}-{digest}{mark}{query}"


def ensure_tokenizer(config: ExperimentConfig, directory: str, reuse: bool = False):
    """The configured tokenizer, or one trained now on the data and saved in `directory` (offline).

    `reuse`: a tokenizer already in `directory` is loaded instead. A resumed run must keep the one its checkpoint
    was trained with: one trained again on changed data has the same size but other ids, so the weights would
    restore without complaint and train on scrambled tokens. One trained for another `tokenizer.vocab_size` is
    refused: the config would be silently ignored.
    """
    from ray_jax_train.storage import exists, local_dir_for
    from ray_jax_train.text import ensure_pad_token, load_tokenizer, train_tokenizer

    if config.tokenizer.path is not None:
        return _ready_tokenizer(config, config.tokenizer.path, "tokenizer.path")
    init_dir = check_hf_init_tokenizer(config)  # parsing checked a local model.init_from; a URI is looked up here
    if init_dir is not None:  # the weights' own ids: a tokenizer trained now has others
        return _ready_tokenizer(config, init_dir, "model.init_from's tokenizer")
    if reuse and exists(join(directory, "tokenizer.json")):
        recorded = _recorded_request(directory) or {}
        wanted = config.tokenizer.vocab_size
        if recorded.get("vocab_size", wanted) != wanted:
            raise ConfigError(
                f"tokenizer.vocab_size is {wanted}, but this run's tokenizer ({directory}) was trained with "
                f"vocab_size {recorded['vocab_size']}, and the run's checkpoints use its ids. Set tokenizer.vocab_size "
                f"back to {recorded['vocab_size']} to resume, or start a new run under another name "
                "(--set run.name=...; RunConfig(name=...) in Python)")
        logging.getLogger(__name__).warning(
            "Reusing the tokenizer trained earlier under this name, %s: its checkpoints were trained with its ids "
            "(a new run.name or tune.name trains a new one).",
            directory)
        return ensure_pad_token(load_tokenizer(directory))
    if reuse:
        from ray_jax_train.lm.export import MODEL_FILES

        # A run trained with a tokenizer it did not train (a Tune trial's: its search trained it) kept that one in
        # <run>/model/ only; continued under its name, a new one was trained over it, the ids given other meanings.
        kept = join(parent(directory), MODEL_FILES)
        if exists(join(kept, "tokenizer.json")):
            logging.getLogger(__name__).warning(
                "Reusing the tokenizer this run's checkpoints were trained with, %s (a new run.name trains a new one).",
                kept)
            return _ready_tokenizer(config, kept, "this run's tokenizer")

    with local_dir_for(directory) as local:  # run storage may be a URI: written locally, then copied there
        # Saved beside, then moved in with tokenizer.json last: a process killed mid-save left a tokenizer.json cut
        # short, which every later run under the name reused (the chaos review).
        staging = tempfile.mkdtemp(dir=local, prefix=".tokenizer-partial-")
        try:
            tokenizer = train_tokenizer(corpus_texts(config), vocab_size=config.tokenizer.vocab_size,
                                        save_dir=staging)
            with open(os.path.join(staging, TOKENIZER_REQUEST), "w") as f:
                json.dump(_tokenizer_request(config), f, indent=2)
            for name in sorted(os.listdir(staging), key=lambda name: name == "tokenizer.json"):
                os.replace(os.path.join(staging, name), os.path.join(local, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return ensure_pad_token(tokenizer)


def _ready_tokenizer(config: ExperimentConfig, directory: str, what: str):
    """A saved tokenizer; a `tokenizer.vocab_size` the config sets beside it is said to be ignored (it sizes only a
    tokenizer trained at run time, and was dropped without a word)."""
    from ray_jax_train.text import ensure_pad_token, load_tokenizer

    tokenizer = ensure_pad_token(load_tokenizer(directory))
    wanted = config.tokenizer.vocab_size
    if "vocab_size" in config.tokenizer.model_fields_set and wanted != len(tokenizer):
        logging.getLogger(__name__).warning(
            "tokenizer.vocab_size=%d is ignored: %s (%s) is a ready tokenizer of %d tokens, and vocab_size only sizes "
            "one trained at run time (tokenizer.path: null). Remove tokenizer.vocab_size.",
            wanted, what, directory, len(tokenizer))
    return tokenizer


def _datasets(config: ExperimentConfig):
    """Train (and eval) sources as prepare_lm_datasets takes them: row dicts for stdlib, paths for files."""
    from ray_jax_train.text import local_corpus

    if config.data.paths():
        if config.data.eval_source is None and config.data.eval_fraction > 0:
            return _split_files(config.data.paths(), config.data.eval_fraction)
        return config.data.paths(), config.data.paths("eval_source") or None
    texts = list(local_corpus(kind=config.data.kind, max_docs=config.data.max_docs))
    n_eval = int(len(texts) * config.data.eval_fraction)
    rows = [{"text": t} for t in texts]
    if config.data.eval_source is not None:
        return rows, config.data.paths("eval_source") or [{"text": t} for t in texts[: max(1, len(texts) // 20)]]
    return rows[n_eval:], (rows[:n_eval] or None)


def _split_files(paths: List[str], fraction: float):
    """(train, eval) Ray datasets: the files' first `fraction` of rows held out, as for the stdlib corpus. Read in
    file order and kept in the object store, so every start (a resume, each Tune trial) holds out the same rows."""
    import ray.data

    from ray_jax_train.text import load_text_dataset

    options = ray.data.DataContext.get_current().execution_options
    keep, options.preserve_order = options.preserve_order, True
    try:
        rows = load_text_dataset(paths).materialize()
    finally:
        options.preserve_order = keep
    n_eval = int(rows.count() * fraction)
    if n_eval < 1:
        logging.getLogger(__name__).warning(
            "data.eval_fraction=%s of the %d rows of data.source holds out no row: no eval runs. Raise it, or give "
            "data.eval_source.", fraction, rows.count())
        return rows, None
    evaluation, train = rows.split_at_indices([n_eval])
    return train, evaluation


def jax_config_for(scaling: ScalingSection):
    """JaxConfig for the workers. Fractional GPUs (Tune trials sharing one) turn JAX's preallocation off and
    cap each process at its share, or the first trial would take 75% of the GPU and the next ones fail."""
    from ray_jax_train.backend import JaxConfig, share_gpu_memory

    s = scaling
    config = JaxConfig(num_cpu_devices=s.cpu_devices_per_worker, gpu_memory_fraction=s.gpu_memory_fraction,
                       gpu_memory_preallocate=s.gpu_memory_preallocate)
    return share_gpu_memory(config, float(s.gpus_per_worker or 1)) if s.use_gpu else config


class PreparedData(typing.NamedTuple):
    """A config's tokenised, packed datasets, made once (a Tune search's driver) for every run whose data settings
    give the same: `key` is `data_key` of the config they were made for."""

    key: str
    datasets: Dict[str, Any]
    columns: List[str]


def data_key(config: ExperimentConfig, args: TrainingArguments, model_config: LlamaConfig) -> str:
    """What the tokenised datasets of a run depend on (see lm.data.tokenize_lm_datasets), as one string: the data
    and tokenizer sections, the model's vocabulary and positions, and the data settings of its training."""
    return json.dumps({"data": config.data.model_dump(mode="json"),
                       "tokenizer": config.tokenizer.model_dump(mode="json"),
                       "max_sequence_length": args.max_sequence_length, "text_column": args.text_column,
                       "messages_column": args.messages_column, "num_workers": args.num_workers,
                       "vocab_size": model_config.vocab_size,
                       "max_position_embeddings": model_config.max_position_embeddings}, sort_keys=True)


def prepare_data(config: ExperimentConfig) -> PreparedData:
    """The datasets `build_trainer` would tokenise for `config`, made now (driver side; Ray must be up), for runs
    that share them: a Tune search tokenised the same documents again in every trial. `tokenizer.path` must be set
    (a search settles its tokenizer first)."""
    from ray_jax_train.lm.data import tokenize_lm_datasets

    assert config.tokenizer.path is not None, "prepare_data needs a settled tokenizer.path"
    args = config.training_arguments()
    tokenizer = ensure_tokenizer(config, config.tokenizer.path)
    model_config = config.llama_config(tokenizer)
    train_source, eval_source = _datasets(config)
    datasets, columns = tokenize_lm_datasets(
        train_source, eval_source, tokenizer, args, materialize=True, names=("data.source", "data.eval_source"),
        max_position_embeddings=model_config.max_position_embeddings, vocab_size=model_config.vocab_size)
    return PreparedData(data_key(config, args, model_config), datasets, columns)


def build_trainer(config: ExperimentConfig, *, run_name: Optional[str] = None, callbacks: Sequence[Any] = (),
                  tokenizer_path: Optional[str] = None, quiet: bool = False, progress_label: Optional[str] = None,
                  prepared: Optional[PreparedData] = None):
    """A ready `JaxTrainer` running the built-in LM loop for `config` (driver side; Ray must be up).

    Returns (trainer, info) where info has the run name, run directory and total steps. Tokenisation runs
    here in Ray Data and is materialised, so training workers never wait on Data tasks for CPUs. `quiet`
    keeps worker logs to warnings and the progress bar (the CLI's default; --verbose turns it off).
    `prepared`: datasets `prepare_data` made already, used where they were made for this config's data settings.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.data import in_order_split, prepare_lm_datasets
    from ray_jax_train.lm.loop import loop_config, train_loop_per_worker
    from ray_jax_train.lm.profiling import with_trace_flags
    from ray_jax_train.trainer import JaxTrainer

    name = run_name or config.run_name()
    storage = absolute(config.run.storage_path)
    run_dir = join(storage, name)
    if tokenizer_path is not None:
        config = config.model_copy(update={"tokenizer": TokenizerSection(path=tokenizer_path)})
    args = config.training_arguments(run_name=name)
    tokenizer = ensure_tokenizer(config, join(run_dir, TOKENIZER_DIR), reuse=args.resume_if_possible)
    model_config = config.llama_config(tokenizer, warn=True)
    if args.mesh is None:
        args.mesh = {"dp": -1}
    # The mesh/device and sequence-length checks ran in parse_config (ExperimentConfig.check); the model is only
    # now complete (its vocabulary is the tokenizer's), so it meets the mesh and its starting weights here.
    scaling_config = config.scaling.scaling_config()  # checked in parse_config (ExperimentConfig.check)
    devices = args.num_devices(config.scaling.gpus_per_worker, scaling_config)
    if devices is not None:
        try:
            args.check_model_on_mesh(model_config, devices)
        except ValueError as exc:
            raise ConfigError(f"model/scaling: {exc}") from None
    init = state_lib.init_spec(checkpoint_path=config.model.init_from)
    check_hf_init_dir(config, model_config)
    resumes_from = check_resumed_model(run_dir, model_config) if args.resume_if_possible else None

    if prepared is not None and prepared.key == data_key(config, args, model_config):
        train_source = eval_source = None  # tokenised already
        shared: Optional[Tuple[Dict[str, Any], List[str]]] = (prepared.datasets, prepared.columns)
    else:
        train_source, eval_source = _datasets(config)
        shared = None
    datasets, columns, total_steps = prepare_lm_datasets(
        train_source, eval_source, tokenizer, args, materialize=True, names=("data.source", "data.eval_source"),
        max_position_embeddings=model_config.max_position_embeddings, vocab_size=model_config.vocab_size,
        prepared=shared)

    jax_config = with_trace_flags(jax_config_for(config.scaling), args)
    callbacks = list(callbacks)
    if config.run.tensorboard:
        from ray_jax_train.plot import TensorBoardCallback

        callbacks.append(TensorBoardCallback(join(run_dir, "tensorboard")))
    trainer = JaxTrainer(
        quiet_train_loop if quiet else train_loop_per_worker,
        train_loop_config=loop_config(args, model_config, total_steps, init, columns, "eval" in datasets,
                                      tokenizer=tokenizer, progress_label=progress_label),
        scaling_config=scaling_config,
        jax_config=jax_config,
        run_config=RunConfig(name=name, storage_path=storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=config.run.checkpoints_to_keep),
                             failure_config=FailureConfig(max_failures=config.run.max_failures),
                             callbacks=callbacks or None,
                             **(quiet_run_settings() if quiet else {})),
        datasets=datasets,
        dataset_config=in_order_split(),
    )
    info = {"name": name, "storage_path": storage, "run_dir": run_dir, "total_steps": total_steps,
            "tokenizer": tokenizer, "resumes_from": resumes_from, "resumes_at": checkpoint_step(resumes_from)}
    return trainer, info


def check_cluster_fits(scaling: ScalingSection, trial_cpus: Optional[float] = None,
                       concurrent_trials: int = 1) -> None:
    """Fail now, not after minutes of 'pending' scheduling, when the cluster can never place the workers.

    Counts how many workers each alive node can hold (all resources of one worker on one node, as Ray
    places them) against `num_workers`. A Tune trial (`trial_cpus`) also holds CPUs of one node for its own
    process, beside its workers: without counting them, a trial that fitted `fit` waited for ever. Tune starts up
    to `concurrent_trials` trial processes before any trial's workers are placed, and each holds its CPUs while it
    waits: when together they leave no room for one trial's workers, every trial waits on the others for ever. An
    autoscaling cluster grows later: set scaling.check_resources false.
    """
    import ray

    if not scaling.check_resources:
        return
    need = scaling.worker_resources()
    if scaling.accelerator_type:  # Ray adds it to each worker's request: only nodes of that type (which have 1) fit
        from ray.air.config import RESOURCE_CONSTRAINT_PREFIX

        need.setdefault(f"{RESOURCE_CONSTRAINT_PREFIX}{scaling.accelerator_type}", 0.001)
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]

    def units(amount: float) -> int:  # Ray counts resources in exact 1/10000ths: 3 // 0.1 is 29 in floats
        return int(round(amount * 10000))

    def placeable(nodes) -> int:
        slots = [min((units(have.get(k, 0.0)) // units(v) for k, v in need.items() if units(v) > 0), default=0)
                 for have in nodes]
        if scaling.placement_strategy == "STRICT_SPREAD":
            return sum(min(n, 1) for n in slots)
        if scaling.placement_strategy == "STRICT_PACK":
            return max(slots, default=0)
        return sum(slots)

    def holding(nodes, home: int):  # the nodes once a trial's process holds its CPUs on node `home`
        return [{**have, "CPU": (units(have.get("CPU", 0.0)) - units(trial_cpus)) / 10000} if i == home else have
                for i, have in enumerate(nodes)]

    room, started = placeable(nodes), 0
    if trial_cpus is not None:  # each trial's process goes to whichever node leaves the most room
        held = nodes
        while started < max(concurrent_trials, 1):
            homes = [i for i, have in enumerate(held) if units(have.get("CPU", 0.0)) >= units(trial_cpus)]
            if not homes:  # the other trials wait for a trial to end, not on each other
                break
            held = max((holding(held, home) for home in homes), key=placeable)
            started += 1
            room = placeable(held)
            if room < scaling.num_workers:
                break
        if started == 0:
            raise ConfigError(f"tune.trial_cpus={trial_cpus:g} can never be placed: no node of this cluster has "
                              f"{trial_cpus:g} CPUs. Lower tune.trial_cpus (the trial's process only waits on its "
                              "workers; the default is 0.1).")
    if room < scaling.num_workers and started > 1:
        raise ConfigError(
            f"tune.max_concurrent_trials: {concurrent_trials} trials may start at once (tune.max_concurrent_trials, "
            "or every trial of the search without it), and each trial's own process holds "
            f"tune.trial_cpus={trial_cpus:g} CPU while it waits for its workers; with {started} of them started, no "
            f"trial's {scaling.num_workers} worker(s) ({', '.join(f'{k}={v:g}' for k, v in need.items())} each) fit "
            "any more, and the search would hang, every trial waiting for CPUs the others hold. Set "
            f"tune.max_concurrent_trials to {started - 1}{' or less' if started > 2 else ''}, or lower "
            "scaling.cpus_per_worker (or tune.trial_cpus).")
    if room < scaling.num_workers:
        total = ray.cluster_resources()
        have = ", ".join(f"{k}={total.get(k, 0):g}" for k in need)
        trial = (f", beside each Tune trial's own process (tune.trial_cpus={trial_cpus:g} CPU)"
                 if trial_cpus is not None else "")
        raise ConfigError(
            f"scaling.num_workers={scaling.num_workers} can never be placed: each worker needs "
            f"{', '.join(f'{k}={v:g}' for k, v in need.items())} ({scaling.placement_strategy}){trial}, and this "
            f"cluster has {len(nodes)} node(s) with {have} in all, room for {room} worker(s). Lower "
            "scaling.num_workers or the per-worker resources, or add nodes (autoscaling clusters: "
            "scaling.check_resources=false).")
