"""RayDistributedTrainer: EasyDeL's scaled-model trainer API, running the built-in loop on Ray Train workers.

The driver does everything that can fail early (config, tokenizer, data columns, batch/mesh sizes, the
starting weights' shapes), then hands one `JaxTrainer` the packed datasets and `loop.train_loop_per_worker`.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import time
from typing import Any, Dict, Optional

from ray_jax_train.config import SUPPORTED_MODEL_TYPES, LlamaConfig, ModelScaling, canonical_dtype
from ray_jax_train.errors import UsageValueError
from ray_jax_train.lm.arguments import TrainingArguments
from ray_jax_train.lm.profiling import with_trace_flags
from ray_jax_train.storage import absolute

logger = logging.getLogger(__name__)

CAUSAL_LM_TASKS = ("causal-language-model", "causal_lm", "causal-lm", "causallm", "causal_language_model")
# ModelScaling's own fields (same at every scale); anything else in config_variables is a LlamaConfig field.
_SCALING_FIELDS = ("dtype", "param_dtype", "seed", "max_position_embeddings", "initializer_range", "mesh",
                   "sharding_axis_names", "sharding_axis_dims")
# EasyDeL settings that choose kernels or layouts this implementation does not have: accepted and ignored.
# (EasyDeL's `platform` is its kernel family, "jax", "triton" or "pallas"; the device is its `backend`.)
_IGNORED_EASYDEL = ("attn_mechanism", "attn_dtype", "attn_softmax_dtype", "precision", "partition_axis",
                    "sharding_dcn_axis_dims", "moe_intermediate_size", "platform")
# EasyDeL's `backend` values that name a device of ours: train() takes them as TrainingArguments' use_gpu/use_tpu.
_BACKENDS = ("cpu", "gpu", "tpu")


def _backend_name(backend: Any) -> Optional[str]:
    return None if backend is None else str(getattr(backend, "value", backend)).strip().lower()


def _task_name(task: Any) -> str:
    name = str(getattr(task, "value", task)).strip().lower()
    if name.replace("-", "_") not in {t.replace("-", "_") for t in CAUSAL_LM_TASKS} and name != "causallanguagemodel":
        raise ValueError(f"model_task={task!r} is not supported; ray_jax_train trains causal language models "
                         f"(model_task='causal-language-model').")
    return "causal-language-model"


def _json_safe(variables: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for key, value in variables.items():
        if key in ("dtype", "param_dtype"):
            value = canonical_dtype(value, key)
        elif isinstance(value, enum.Enum):  # EasyDeL's gradient_checkpointing enums
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        elif hasattr(value, "model_dump"):
            value = value.model_dump(mode="json")
        out[key] = value
    return out


def training_precision(config: LlamaConfig, dtype: Optional[str], param_dtype: Optional[str], *,
                       loaded_weights: bool, warn: bool = True) -> LlamaConfig:
    """`config` with the run's precision: TrainingArguments' dtype/param_dtype where given, and float32 master
    weights for loaded low-precision weights that no one asked to train as they are."""
    overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v is not None}
    if loaded_weights and param_dtype is None and config.param_dtype != "float32":
        # A bf16 HF checkpoint loads with bf16 weights: stored so, AdamW's updates below half a bf16 ulp are
        # rounded away (85% of the weights never moved at lr 1e-5). Train float32 master weights instead.
        if warn:
            logger.warning("The model's weights are %s; training keeps float32 master weights (compute stays %s). "
                           "Set param_dtype=%r in the training arguments to train them as they are.",
                           config.param_dtype, config.dtype, config.param_dtype)
        overrides.update(param_dtype="float32", dtype=overrides.get("dtype", config.dtype))
    if overrides:
        config = config.replace(**overrides)
    if warn and "float16" in (config.dtype, config.param_dtype):
        # float16's range ends at 65504 and its small gradients flush to zero: without loss scaling (which this
        # loop does not do) a run either stalls or goes NaN, and the NaN check then stops it.
        logger.warning("The model computes or stores float16 (dtype=%s, param_dtype=%s), which this loop trains "
                       "without loss scaling; use bfloat16, which has float32's range.",
                       config.dtype, config.param_dtype)
    return config


class RayDistributedTrainer:
    """Train a scaled Llama-family causal LM on Ray workers.

    Args:
        pretrained_model_name_or_path: a local directory with a tokenizer and/or a HF `config.json` (its config
            is the base that the scaling variables override). Hub names are not downloaded.
        model_type / model_task / model_class: the architecture (llama, mistral, qwen2) and the task
            (causal-language-model); `model_class=LlamaForCausalLM` implies both.
        config_scaling_variables: fields multiplied by `scaling_index` (hidden_size, intermediate_size, heads...).
        config_variables: fields fixed across scales (dtype, param_dtype, seed, max_position_embeddings,
            sharding_axis_names/dims, and any other LlamaConfig field such as vocab_size or num_hidden_layers).
        checkpoint_path (alias `bucket_path`): starting weights, a ray_jax_train checkpoint directory or a local
            HF model directory (used when `train` gets neither `state` nor `model`).
        tokenizer: a tokenizer object or directory, overriding the one in `pretrained_model_name_or_path`.
    """

    def __init__(self, pretrained_model_name_or_path: Optional[str] = None, *, model_type: Optional[str] = None,
                 model_task: Any = None, model_class: Optional[type] = None,
                 config_scaling_variables: Optional[Dict[str, int]] = None,
                 config_variables: Optional[Dict[str, Any]] = None, checkpoint_path: Optional[str] = None,
                 bucket_path: Optional[str] = None, tokenizer: Any = None):
        from ray_jax_train.models import LlamaForCausalLM

        if model_class is not None:
            if not (isinstance(model_class, type) and issubclass(model_class, LlamaForCausalLM)):
                raise ValueError(f"model_class={model_class!r} is not supported; use LlamaForCausalLM (it serves "
                                 f"model types {', '.join(SUPPORTED_MODEL_TYPES)}).")
            model_task = model_task or "causal-language-model"
        if pretrained_model_name_or_path is not None and not os.path.isdir(pretrained_model_name_or_path):
            # Else the typo went unnoticed: a default-config model trained, or a "no tokenizer" error pointed away.
            raise ValueError(
                f"pretrained_model_name_or_path={os.fspath(pretrained_model_name_or_path)!r} is not a local "
                "directory. Give a directory with a tokenizer and/or a Hugging Face config.json (hub names are not "
                "downloaded: save the model and tokenizer locally first), or leave it out and pass model_type / "
                "config_variables / tokenizer=.")
        if model_type is None and model_class is None and pretrained_model_name_or_path is None:
            model_type = "llama"
        model_type = model_type or self._model_type_from_path(pretrained_model_name_or_path) or "llama"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported; use one of {', '.join(SUPPORTED_MODEL_TYPES)}.")
        if checkpoint_path is not None and bucket_path is not None and checkpoint_path != bucket_path:
            raise ValueError("Give checkpoint_path or bucket_path (its EasyDeL name), not both.")
        self.pretrained_model_name_or_path = (os.fspath(pretrained_model_name_or_path)
                                              if pretrained_model_name_or_path is not None else None)
        self.model_type = model_type
        self.model_task = _task_name(model_task or "causal-language-model")
        self.model_class = model_class or LlamaForCausalLM
        self.config_scaling_variables = dict(config_scaling_variables) if config_scaling_variables else None
        self.config_variables = dict(config_variables or {})
        self.checkpoint_path = checkpoint_path if checkpoint_path is not None else bucket_path
        path = os.fspath(self.checkpoint_path) if self.checkpoint_path is not None else None
        if path is not None and "://" not in path and not os.path.exists(path):  # a typo: said before Ray starts
            raise FileNotFoundError(f"checkpoint_path: {path} does not exist: give a Hugging Face model directory or "
                                    "a checkpoint directory (<run>/checkpoint_...) to start from.")
        self._tokenizer = tokenizer
        self.scaling = self._build_scaling()
        self.last_result = None

    # -- configuration ------------------------------------------------------------------------------------

    @staticmethod
    def _model_type_from_path(path) -> Optional[str]:
        if path is None or not os.path.isfile(os.path.join(path, "config.json")):
            return None
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")

    def _build_scaling(self) -> ModelScaling:
        """ModelScaling from: the HF config in the model path < the tokenizer's vocab < config_variables."""
        from ray_jax_train.config import DEFAULT_SCALING_VARIABLES

        variables = dict(self.config_variables)
        for key in _IGNORED_EASYDEL:
            if variables.pop(key, None) is not None:
                logger.warning("config_variables[%r] is an EasyDeL kernel/layout setting with no equivalent here; "
                               "ignored.", key)
        backend = variables.pop("backend", None)
        if backend is not None and _backend_name(backend) not in _BACKENDS:
            logger.warning("config_variables['backend']=%r is not a device this trainer runs on (%s); ignored.",
                           backend, ", ".join(_BACKENDS))
        checkpointing = variables.pop("gradient_checkpointing", None)
        if checkpointing is not None:
            variables["remat"] = str(getattr(checkpointing, "value", checkpointing)).lower() not in ("none", "false", "0")
        fixed = {k: variables.pop(k) for k in list(variables) if k in _SCALING_FIELDS}
        unknown = [k for k in variables if k not in LlamaConfig.model_fields or k == "model_type"]
        if unknown:
            raise ValueError(f"config_variables {unknown} are not model config fields; known fields: "
                             f"{', '.join(sorted(LlamaConfig.model_fields))} and {', '.join(_SCALING_FIELDS)}.")
        scaling_vars = None
        if self.config_scaling_variables is not None:
            scaling_vars = {k: v for k, v in self.config_scaling_variables.items() if k not in _IGNORED_EASYDEL}
        scaled = set(scaling_vars if scaling_vars is not None else DEFAULT_SCALING_VARIABLES)

        base: Dict[str, Any] = {}
        path = self.pretrained_model_name_or_path
        if path is not None and os.path.isfile(os.path.join(path, "config.json")):
            from ray_jax_train.models import load_hf_config

            hf = load_hf_config(path).model_dump()
            for key in ("max_position_embeddings", "initializer_range"):
                fixed.setdefault(key, hf[key])
            if scaling_vars is None:
                # Index 1 is the directory's own model: with the default sizes instead, fine-tuning it
                # (checkpoint_path=the same directory) failed in the workers on every weight's shape.
                scaling_vars = {k: hf[k] for k in DEFAULT_SCALING_VARIABLES}
                scaled = set(scaling_vars)
            # A head_dim that is hidden_size // heads follows the width as it scales; one of its own (Mistral-NeMo's
            # 128 at hidden 5120 and 32 heads) is the architecture's, and stays: dropped, index 1 was another model.
            width_scaled = bool(scaled & {"hidden_size", "num_attention_heads"})
            derived_head_dim = hf["head_dim"] == hf["hidden_size"] // hf["num_attention_heads"]
            base = {k: v for k, v in hf.items() if v is not None and k not in scaled and k not in _SCALING_FIELDS
                    and k not in ("model_type", "initializer_range")
                    and not (k == "head_dim" and width_scaled and derived_head_dim)}
        base.update(variables)
        if "vocab_size" not in base:
            tokenizer = self._maybe_tokenizer()
            if tokenizer is not None:
                base["vocab_size"] = len(tokenizer)
                for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                    if getattr(tokenizer, name, None) is not None:
                        base.setdefault(name, getattr(tokenizer, name))
        kwargs = dict(model_type=self.model_type, base=base, **fixed)
        if scaling_vars is not None:
            kwargs["scaling_variables"] = scaling_vars
        return ModelScaling(**kwargs)

    def create_config(self, scaling_index: int = 1) -> LlamaConfig:
        """The model config at `scaling_index` (1 = base sizes; k multiplies every scaling variable by k)."""
        return self.scaling.create_config(scaling_index)

    def create_model(self, config: Optional[LlamaConfig] = None, *, scaling_index: int = 1, lazy: bool = False):
        """A model for `config` (default: `create_config(scaling_index)`); `lazy=True` allocates nothing."""
        return self.scaling.create_model(config, scaling_index=scaling_index, lazy=lazy)

    def save_config(self, path) -> None:
        """Write the constructor arguments as JSON, so `from_config(path)` rebuilds this trainer.

        Local paths are written absolute (read from another directory, relative ones pointed elsewhere), and a
        tokenizer given as an object is saved beside the JSON (`<path>.tokenizer/`): without it the rebuilt trainer
        had another vocabulary and no pad or eos id."""
        def located(value):
            return os.path.abspath(value) if value is not None and os.path.exists(value) else value

        tokenizer = self._tokenizer
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            saved = os.fspath(path) + ".tokenizer"
            tokenizer.save_pretrained(saved)
            tokenizer = saved
        data = {
            "pretrained_model_name_or_path": located(self.pretrained_model_name_or_path),
            "model_type": self.model_type,
            "model_task": self.model_task,
            "config_scaling_variables": self.config_scaling_variables,
            "config_variables": _json_safe(self.config_variables),
            "checkpoint_path": located(self.checkpoint_path),
            "tokenizer": located(os.fspath(tokenizer) if tokenizer is not None else None),
        }
        with open(path, "w") as f:
            json.dump(data, f, indent=2)

    @classmethod
    def from_config(cls, path, **overrides) -> "RayDistributedTrainer":
        """Rebuild a trainer from `save_config`'s JSON; keyword `overrides` replace saved values."""
        with open(path) as f:
            data = json.load(f)
        data.update(overrides)
        name = data.pop("pretrained_model_name_or_path", None)
        return cls(name, **data)

    # -- tokenizer and samples ----------------------------------------------------------------------------

    def _maybe_tokenizer(self):
        if self._tokenizer is not None or (self.pretrained_model_name_or_path
                                           and os.path.isdir(self.pretrained_model_name_or_path)):
            try:
                return self.load_processor()
            except (OSError, ValueError) as exc:
                logger.info("No tokenizer in %s (%s).", self.pretrained_model_name_or_path, exc)
        return None

    def load_processor(self):
        """The tokenizer (local only), with a pad token: the eos token, with a warning, if it has none."""
        from ray_jax_train.text import ensure_pad_token, load_tokenizer

        if self._tokenizer is None or isinstance(self._tokenizer, (str, os.PathLike)):
            source = self._tokenizer if self._tokenizer is not None else self.pretrained_model_name_or_path
            if source is None:
                raise ValueError("No tokenizer: pass pretrained_model_name_or_path (a local directory) or tokenizer=.")
            self._tokenizer = load_tokenizer(source)
        return ensure_pad_token(self._tokenizer)

    def process_sample_data(self, sample, max_length: int, padding_side: str = "left", **kwargs):
        """One text (or row) -> padded input_ids / attention_mask of `max_length` (see text.process_sample_data)."""
        from ray_jax_train.text import process_sample_data

        return process_sample_data(self.load_processor(), sample, max_length, padding_side, **kwargs)

    def process_messages_data(self, messages, max_length: int, padding_side: str = "left", **kwargs):
        """One conversation through the tokenizer's chat template -> padded arrays."""
        from ray_jax_train.text import process_messages_data

        return process_messages_data(self.load_processor(), messages, max_length, padding_side, **kwargs)

    @staticmethod
    def extract_column_names(dataset):
        """Column names of a Hugging Face or Ray dataset (None when they cannot be known cheaply)."""
        from ray_jax_train.text import extract_column_names

        return extract_column_names(dataset)

    # -- training -----------------------------------------------------------------------------------------

    def train(self, scaling_index: int = 1, arguments=None, dataset_train=None, dataset_eval=None,
              data_collator=None, model=None, state=None, *, verbose: bool = False):
        """Train on Ray workers and return Ray's `Result` (outputs under `result.path`).

        `scaling_index` picks the model size (1, the default, is a Hugging Face directory's own size when the
        trainer was given one).

        Starting weights, first match wins: `state`, then `model`, then the trainer's `checkpoint_path`, then a
        new model at `scaling_index`. `result.metrics` holds the metrics of the run's last report, its last
        logged step (Ray V2 alone would give the latest checkpoint's, None in a run that saved none). Under `result.path`: `metrics.jsonl` (one record per log/eval step),
        `final_model/` (HF safetensors + tokenizer) and the checkpoints. Ray, Ray Data, JAX and orbax log only
        warnings, as under the CLI, unless `verbose` (then also Train's line per report and orbax's per save).
        """
        from ray.train import CheckpointConfig, FailureConfig, RunConfig

        from ray_jax_train.lm import state as state_lib
        from ray_jax_train.lm.data import in_order_split, prepare_lm_datasets
        from ray_jax_train.lm.loop import loop_config, train_loop_per_worker
        from ray_jax_train.lm.metrics import with_final_metrics
        from ray_jax_train.trainer import JaxTrainer, ensure_ray_leaves_cpu_for_data

        from ray_jax_train.quiet import quiet_driver, quiet_run_settings, quiet_train_loop

        if arguments is None or dataset_train is None:
            missing = [n for n, v in (("arguments", arguments), ("dataset_train", dataset_train)) if v is None]
            raise TypeError(f"train() needs {' and '.join(missing)} (train(scaling_index=1, arguments="
                            "TrainingArguments(...), dataset_train=...)).")
        args = arguments if isinstance(arguments, TrainingArguments) else TrainingArguments.model_validate(arguments)
        args = self._with_backend(args)
        config = self._train_config(scaling_index, args, model)
        problem = config.hf_export_problem() if args.save_final_model else None
        if problem:
            raise ValueError(f"{problem}. The final model could not be exported as a Hugging Face directory; fix "
                             "the config or set TrainingArguments(save_final_model=False).")
        if args.save_final_model and args.run_name and args.output_dir:
            from ray_jax_train.lm.export import final_model_blocked

            blocked = final_model_blocked(os.path.join(absolute(args.output_dir), args.run_name))
            if blocked:
                raise UsageValueError(blocked)
        if args.mesh is None:
            args = args.model_copy()
            args.mesh = dict(zip(self.scaling.mesh.axis_names, self.scaling.mesh.axis_dims))
        config.check_cudnn_attention(use_gpu=args.use_gpu, seq_len=args.max_sequence_length)
        scaling_config, jax_config = scaling_and_jax_config(args)  # Ray's own TPU checks, before Ray starts
        devices = args.num_devices(args.gpus_per_worker, scaling_config)
        if devices is not None:
            args.check_devices(devices)
            args.check_model_on_mesh(config, devices)
        # Ray started as fit() would start it, before the first call that starts it with one CPU per core (a
        # ray.put here, Ray Data below): on a small machine too few for the workers and the data pipeline at once.
        # Whether the cluster has CPUs to spare is fit()'s check, once the datasets are built (or materialized).
        ensure_ray_leaves_cpu_for_data(scaling_config, has_datasets=False)
        init = state_lib.init_spec(state=state, model=model, checkpoint_path=self.checkpoint_path)
        pretrained = self.pretrained_model_name_or_path
        if init["source"] == "scratch" and pretrained and os.path.isdir(pretrained) \
                and state_lib.is_hf_model_dir(pretrained):
            # EasyDeL's meaning (the directory gives config and tokenizer), which a user fine-tuning rarely expects.
            logger.warning("A new run trains from randomly initialised weights (a resumed one from its checkpoint): "
                           "%s gives the model config and tokenizer only. To fine-tune its weights, pass "
                           "checkpoint_path=%r too (CLI: model.init_from).", pretrained, pretrained)
        if init["source"] == "hf":
            state_lib.check_hf_dir_fits(init["path"], config, "Give the trainer the sizes the directory was saved "
                                        "with (config_scaling_variables, config_variables, scaling_index), or leave "
                                        "them out and pass the directory as its first argument.",
                                        chosen=set(self.config_variables),
                                        chosen_how="config_variables={{{wanted}}}, or pass the directory as the "
                                                   "trainer's first argument")
        if init["source"] == "checkpoint":
            state_lib.check_checkpoint_fits(init["path"], config, "Give the trainer the sizes the checkpoint's run "
                                            "trained (config_scaling_variables, config_variables, scaling_index).",
                                            chosen=set(self.config_variables),
                                            chosen_how="config_variables={{{wanted}}}")
        if init["source"] in ("state", "model"):
            import ray

            if self.checkpoint_path is not None:  # the documented order, said: the worker's INFO line went unseen
                logger.warning("The given %s is trained: checkpoint_path=%s is not read (the starting point is the "
                               "first of state, model, checkpoint_path). Leave %s out to start from the checkpoint.",
                               init["source"], self.checkpoint_path, init["source"])

            given = ray.get(init["ref"])["params"]
            state_lib.check_params_match(given, state_lib.abstract_params(config)[1], f"given {init['source']}")

        with quiet_driver(not verbose):
            tokenizer = self._maybe_tokenizer()
            datasets, columns, total_steps = prepare_lm_datasets(
                dataset_train, dataset_eval, tokenizer, args, data_collator=data_collator,
                max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size)

            run_name = args.run_name or f"{self.model_type}-x{scaling_index}-{time.strftime('%Y%m%d-%H%M%S')}"
            trainer = JaxTrainer(
                train_loop_per_worker if verbose else quiet_train_loop,
                train_loop_config=loop_config(args, config, total_steps, init, columns, "eval" in datasets,
                                              tokenizer=tokenizer,
                                              **self._extra_loop_config),
                scaling_config=scaling_config,
                jax_config=jax_config,
                run_config=RunConfig(
                    name=run_name,
                    storage_path=absolute(args.output_dir) if args.output_dir else None,
                    checkpoint_config=CheckpointConfig(num_to_keep=args.save_total_limit),
                    failure_config=FailureConfig(max_failures=args.max_failures),
                    **({} if verbose else quiet_run_settings()),
                ),
                datasets=datasets,
                dataset_config=in_order_split(),
            )
            result = with_final_metrics(trainer.fit())
            self.last_result = result
            return result

    # Extra keys merged into the loop config (tests set {"record_dir": ...}).
    _extra_loop_config: Dict[str, Any] = {}

    def _with_backend(self, args: TrainingArguments) -> TrainingArguments:
        """EasyDeL's config_variables["backend"] as the device: taken where the arguments name none (use_gpu and
        use_tpu False), refused where they name another (it was ignored, and the run went to the CPUs)."""
        backend = _backend_name(self.config_variables.get("backend"))
        named = "tpu" if args.use_tpu else "gpu" if args.use_gpu else None
        if backend not in _BACKENDS or backend == (named or "cpu"):
            return args
        if named is not None:
            raise ValueError(f"config_variables['backend']={backend!r} contradicts "
                             f"TrainingArguments(use_{named}=True); leave one of them out")
        return TrainingArguments.model_validate({**args.model_dump(), f"use_{backend}": True})

    def _train_config(self, scaling_index: int, args: TrainingArguments, model) -> LlamaConfig:
        """The model config for this run: the given model's or the scaled one, with precision overrides."""
        config = model.config if model is not None else self.create_config(scaling_index)
        config = training_precision(config, args.dtype, args.param_dtype, loaded_weights=model is not None)
        if args.max_sequence_length > config.max_position_embeddings:
            raise ValueError(f"max_sequence_length={args.max_sequence_length} exceeds the model's "
                             f"max_position_embeddings={config.max_position_embeddings}: lower max_sequence_length, "
                             "or raise max_position_embeddings (config_variables) for a model trained from scratch.")
        return config


def scaling_and_jax_config(args: TrainingArguments):
    """(ScalingConfig, JaxConfig) of a `train()` call: its workers, their GPUs and JAX's GPU allocator settings
    (a share of a GPU gets JAX's preallocation off and 95% of the share, as under the CLI and JaxTrainer), or their
    TPU slice (Ray gives each worker one host's chips of `topology`; ValueError from Ray for settings it refuses)."""
    from ray.train import ScalingConfig

    from ray_jax_train.backend import JaxConfig

    gpus = {"CPU": 1.0, "GPU": float(args.gpus_per_worker)} if args.gpus_per_worker else None
    scaling_config = ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu, use_tpu=args.use_tpu,
                                   topology=args.topology, accelerator_type=args.accelerator_type,
                                   resources_per_worker=gpus)
    jax_config = JaxConfig(num_cpu_devices=args.num_cpu_devices, gpu_memory_fraction=args.gpu_memory_fraction,
                           gpu_memory_preallocate=args.gpu_memory_preallocate)
    return scaling_config, with_trace_flags(jax_config, args)
