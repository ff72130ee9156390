"""TrainingArguments: every knob of the built-in causal-LM loop, validated on the driver.

A bad value fails here, with the field and the fix named, before any Ray worker starts. The arguments travel
to the workers as a plain dict (`model_dump()`), so they must stay JSON-friendly.
"""
from __future__ import annotations

import difflib
import math
from typing import Dict, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ray_jax_train.config import canonical_dtype, refuse_bool_numbers

# The optimizer's numbers live in float32 state (optax.inject_hyperparams).
_FLOAT32_MAX, _FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38

SCHEDULERS = ("cosine", "linear", "constant")


# Names other trainers use for our settings. Looked up before spelling matches: difflib took "max_steps" for
# max_eval_steps and "per_device_train_batch_size" for eval_batch_size, valid keys that then did something else.
KEY_ALIASES = {"lr": "learning_rate", "bs": "batch_size", "steps": "total_steps", "max_steps": "total_steps",
              "num_steps": "total_steps", "train_steps": "total_steps", "num_train_steps": "total_steps",
              "num_train_epochs": "num_epochs", "epochs": "num_epochs", "wd": "weight_decay",
              "warmup": "warmup_steps", "layers": "num_hidden_layers", "n_layers": "num_hidden_layers",
              "num_layers": "num_hidden_layers", "heads": "num_attention_heads", "n_heads": "num_attention_heads",
              "num_heads": "num_attention_heads", "per_device_train_batch_size": "batch_size",
              "train_batch_size": "batch_size", "global_batch_size": "batch_size", "lr_scheduler_type": "scheduler",
              "block_size": "max_sequence_length", "seq_len": "max_sequence_length",
              "max_seq_len": "max_sequence_length", "max_seq_length": "max_sequence_length",
              "seq_length": "max_sequence_length", "context_length": "max_sequence_length",
              "max_length": "max_sequence_length", "d_model": "hidden_size", "n_embd": "hidden_size"}


def _with_hint(error: dict, fields) -> dict:
    """An "Extra inputs" error of pydantic's, with the argument probably meant (its type stays extra_forbidden)."""
    name = str(error["loc"][-1])
    close = ([KEY_ALIASES[name]] if KEY_ALIASES.get(name) in fields
             else difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6))
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return {**error, "type": PydanticCustomError("extra_forbidden", f"unknown argument {name!r}{hint}")}


class TrainingArguments(BaseModel):
    """How to train: length, batch, optimiser, precision, cadence, resume, mesh and workers.

    Length: `total_steps`, or `num_epochs` passes over the training data (steps are then counted on the
    driver from the packed dataset). When both are given, `total_steps` wins and epochs repeat as needed.

    Batch: `batch_size` is the GLOBAL number of sequences per optimizer step (all workers, all
    micro-batches). It is split into `gradient_accumulation_steps` micro-batches, so activation memory
    follows `batch_size / gradient_accumulation_steps` while the update is that of the whole batch.

    Precision: `dtype` is the compute dtype and `param_dtype` the stored ("master") weights; None keeps the
    model config's. `dtype="bfloat16", param_dtype="float32"` is the usual mixed-precision recipe.
    """

    # NaN passed no bound check and was said as "should be >= 0"; inf is said as not finite, too.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)
    _no_bool_numbers = field_validator("*", mode="before")(refuse_bool_numbers)

    def __init__(self, **arguments):
        try:
            super().__init__(**arguments)
        except ValidationError as exc:  # pydantic names an unknown argument with "Extra inputs are not permitted"
            errors = exc.errors()
            if not all(e["type"] == "extra_forbidden" for e in errors):  # other types cannot all be rebuilt
                raise
            raise ValidationError.from_exception_data(exc.title, [_with_hint(e, type(self).model_fields)
                                                                  for e in errors]) from None

    # Length
    total_steps: Optional[int] = Field(None, ge=1)
    num_epochs: Optional[int] = Field(None, ge=1)

    # Batch
    batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    max_sequence_length: int = Field(512, ge=2)
    eval_batch_size: Optional[int] = Field(None, ge=1)
    max_eval_steps: Optional[int] = Field(None, ge=1)
    shuffle_buffer_size: Optional[int] = Field(None, ge=1)

    # Optimizer (AdamW) and schedule, counted in optimizer steps (as Hugging Face's): with warmup, step 0 uses a
    # learning rate of 0 and step warmup_steps the peak; cosine and linear then fall towards
    # min_learning_rate_ratio x peak, reached at step total_steps (one past the last); "constant" warms up too.
    learning_rate: float = Field(3e-4, ge=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_learning_rate_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.01, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    max_grad_norm: Optional[float] = Field(1.0, gt=0)

    # Precision
    dtype: Optional[str] = None
    param_dtype: Optional[str] = None

    # Cadence
    log_steps: int = Field(10, ge=1)
    eval_steps: Optional[int] = Field(None, ge=1)
    save_steps: Optional[int] = Field(None, ge=1)
    save_total_limit: Optional[int] = Field(None, ge=1)
    save_final_model: bool = True
    # Rank 0's progress is a line per log step; quiet turns it off (metrics still go to metrics.jsonl, Ray's
    # reports and TensorBoard). progress_bar is kept for configs that set it: it changes nothing (no bar reached
    # the driver from Train V2's workers).
    progress_bar: bool = True
    quiet: bool = False
    # A jax.profiler trace of steps profile_start_step .. +profile_num_steps-1 on every worker, in the run's
    # profile/ directory. Start after step 1, which compiles.
    profile_start_step: Optional[int] = Field(None, ge=1)
    profile_num_steps: int = Field(3, ge=1)

    # Resume and reproducibility
    resume_if_possible: bool = True
    seed: int = 0
    max_failures: int = Field(0, ge=-1)

    # Where and on what
    output_dir: Optional[str] = None
    run_name: Optional[str] = None
    # None: the trainer's ModelScaling mesh (EasyDeL's sharding_axis_*), or {"dp": -1} for a bare loop.
    mesh: Optional[Dict[str, int]] = None
    num_workers: int = Field(1, ge=1)
    num_cpu_devices: int = Field(1, ge=1)
    use_gpu: bool = False
    # GPUs per worker (default 1; a share below 1 for one-worker runs sharing a GPU) and JAX's GPU allocator
    # (default: JAX's own; a share turns preallocation off and caps the process at 95% of it). With use_gpu only.
    gpus_per_worker: Optional[float] = Field(None, gt=0)
    gpu_memory_fraction: Optional[float] = Field(None, gt=0, le=1)
    gpu_memory_preallocate: Optional[bool] = None
    # TPU workers, as Ray's ScalingConfig takes them: the slice's `topology` ("4x4") and `accelerator_type`
    # ("TPU-V6E"), which Ray needs for more than one worker; each worker then gets one whole host's chips.
    # `accelerator_type` is Ray's generic field: with use_gpu it asks for a GPU type ("A100").
    use_tpu: bool = False
    topology: Optional[str] = None
    accelerator_type: Optional[str] = None

    # Data columns (raw text or chat) for the driver-side tokenisation
    text_column: str = "text"
    messages_column: Optional[str] = "messages"  # None: no conversations, rows that hold both train on their text

    @field_validator("learning_rate")
    @classmethod
    def _learning_rate_fits_float32(cls, value: float) -> float:
        if value > _FLOAT32_MAX:
            raise ValueError(f"learning_rate={value} is beyond float32's range (max {_FLOAT32_MAX:.4g}): the optimizer "
                             "state holds it as float32, where it is inf, and the first update makes every weight "
                             "NaN. Use a learning rate below 1 (3e-4 is the default)")
        return value

    @field_validator("adam_epsilon")
    @classmethod
    def _epsilon_survives_float32(cls, value: float) -> float:
        if value < _FLOAT32_TINY:
            raise ValueError(f"adam_epsilon={value} is below float32's smallest normal number ({_FLOAT32_TINY:.4g}), "
                             "which XLA flushes to zero: a weight whose gradient is 0 (an embedding row no batch "
                             "used) then updates by 0/0 = NaN. Use 1e-8 (the default) or another value above it")
        return value

    @field_validator("dtype", "param_dtype", mode="before")
    @classmethod
    def _dtype(cls, value, info):
        return None if value is None else canonical_dtype(value, info.field_name)

    @field_validator("mesh", mode="before")
    @classmethod
    def _mesh(cls, value):
        from ray_jax_train.mesh import validate_axes

        if value is None:
            return None
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], str):
            raise ValueError(f"mesh={value!r} needs sizes too, e.g. {{'dp': -1}} or {{'dp': 1, 'fsdp': -1, 'tp': 1}}")
        axes = validate_axes(value)
        if not any(name in axes for name in ("dp", "fsdp", "data")):
            raise ValueError(f"mesh={axes} has no batch axis; include 'dp' or 'fsdp' (e.g. {{'dp': -1}})")
        known = ("dp", "fsdp", "tp", "sp", "data")
        for name, size in axes.items():
            if name not in known and size != 1:
                # The partition rules name only the known axes: this one's devices would all repeat the same work.
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.3)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"mesh axis {name!r}={size} is not one the built-in Llama loop splits over{hint}; "
                                 f"use {', '.join(known)}, or give it size 1")
        return axes

    @model_validator(mode="after")
    def _check(self) -> "TrainingArguments":
        k = self.gradient_accumulation_steps
        if self.batch_size % k:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by gradient_accumulation_steps={k}: the global "
                f"batch is split into {k} equal micro-batches. Use a batch_size that is a multiple of {k} "
                f"(e.g. {max(k, self.batch_size // k * k)}; with several batch shards, of {k} times their number)."
            )
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} is longer than total_steps={self.total_steps}; the learning "
                "rate would never finish warming up. Lower warmup_steps."
            )
        if self.total_steps is not None:
            self.check_profile_window(self.total_steps)
        if self.use_tpu and self.use_gpu:
            raise ValueError("use_tpu and use_gpu are both True: a worker runs JAX on one platform, and Ray refuses "
                             "both; keep one of them")
        if self.topology is not None and not self.use_tpu:  # Ray ignores it then: the run would use CPUs or GPUs
            raise ValueError(f"topology={self.topology!r} set but use_tpu is False; set use_tpu=True for TPU "
                             "workers, or leave topology out")
        gpu_only = [k for k in ("gpus_per_worker", "gpu_memory_fraction", "gpu_memory_preallocate")
                    if getattr(self, k) is not None]
        if gpu_only and self.use_tpu:
            raise ValueError(f"{' / '.join(gpu_only)} set with use_tpu=True, but they are GPU settings and the run "
                             "uses TPUs; leave them out")
        if gpu_only and not self.use_gpu:
            raise ValueError(f"{' / '.join(gpu_only)} set but use_gpu is False, so the run would use CPUs; set "
                             "use_gpu=True, or leave them out")
        if self.use_gpu:
            from ray_jax_train.backend import gpu_share_problem

            problem = gpu_share_problem(self.num_workers, float(self.gpus_per_worker or 1))
            if problem:
                raise ValueError(f"gpus_per_worker: {problem}")
        return self

    def check_profile_window(self, total_steps: int) -> None:
        """Refuse a profile window that starts after the run's last step (with num_epochs, once it is counted)."""
        if self.profile_start_step is not None and self.profile_start_step > total_steps:
            raise ValueError(
                f"profile_start_step={self.profile_start_step} is after the last step ({total_steps} steps), so "
                f"nothing would be profiled. Pick a step <= {total_steps}; step 1 also times the compile.")

    # -- derived ------------------------------------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.gradient_accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.max_sequence_length

    def steps_for_rows(self, num_rows: int) -> int:
        """Total optimizer steps for `num_epochs` passes over `num_rows` packed rows."""
        per_epoch = num_rows // self.batch_size
        if per_epoch < 1:
            raise ValueError(
                f"The training data has {num_rows} packed rows of {self.max_sequence_length} tokens, fewer than one "
                f"global batch (batch_size={self.batch_size}). Give more data or a smaller batch_size."
            )
        return per_epoch * (self.num_epochs or 1)

    def check_devices(self, num_devices: int) -> None:
        """Fail before the workers start when the micro-batch cannot be split over the mesh's batch axes."""
        from ray_jax_train.mesh import resolve_axes

        axes = resolve_axes(self.mesh or {"dp": -1}, num_devices)
        sp = axes.get("sp", 1)
        if self.max_sequence_length % sp:  # the activation constraint would silently drop sp, every device the whole sequence
            raise ValueError(f"max_sequence_length={self.max_sequence_length} does not split over mesh axis "
                             f"'sp'={sp}; use a multiple of {sp}.")
        shards = math.prod(size for name, size in axes.items() if name in ("dp", "fsdp", "data"))
        self._check_batch_split_over_workers(axes, shards, num_devices)
        k = self.gradient_accumulation_steps
        if self.micro_batch_size % shards:
            step = shards * k  # a batch_size both splits take: into k micro-batches, each over the shards
            fix = f"Use a batch_size that is a multiple of {step} (e.g. {max(step, self.batch_size // step * step)})"
            raise ValueError(
                f"The micro-batch (batch_size={self.batch_size} / gradient_accumulation_steps={k}) is "
                f"{self.micro_batch_size}, which does not split over the {shards} batch shards of mesh {axes}. "
                f"{fix}{', or fewer gradient_accumulation_steps' if k > 1 else ''}.")
        if self.eval_batch_size is not None and self.eval_batch_size % shards:
            raise ValueError(f"The eval_batch_size is {self.eval_batch_size}, which does not split over the {shards} "
                             f"batch shards of mesh {axes}. Use a multiple of {shards}.")

    def _check_batch_split_over_workers(self, axes: Dict[str, int], shards: int, num_devices: int) -> None:
        """Each worker must own whole batch shards: its devices are a contiguous block of the mesh (make_mesh orders
        devices by process), so an axis after the data axes (tp, sp) that spans workers gives two workers the same
        rows. The workers found it only after start-up."""
        import numpy as np

        workers = self.num_workers
        if workers <= 1 or num_devices % workers:
            return
        per_worker = num_devices // workers
        coords = np.indices(tuple(axes.values())).reshape(len(axes), -1)
        batch_dims = [i for i, name in enumerate(axes) if name in ("dp", "fsdp", "data")]
        shard = (np.ravel_multi_index(tuple(coords[batch_dims]), tuple(np.asarray(list(axes.values()))[batch_dims]))
                 if batch_dims else np.zeros(num_devices, int))
        owner = np.arange(num_devices) // per_worker
        if all(len(set(shard[owner == w].tolist())) * workers == shards for w in range(workers)):
            return
        later = {name: size for name, size in list(axes.items())[max(batch_dims, default=-1) + 1:] if size > 1}
        more = ("GPUs per worker; CLI: scaling.gpus_per_worker" if self.use_gpu
                else "a TPU worker has one host's chips: a TPU type with more chips per host" if self.use_tpu
                else "num_cpu_devices; CLI: scaling.cpu_devices_per_worker")
        raise ValueError(
            f"Mesh {axes} does not give each of the {workers} workers its own block of the batch (each worker has "
            f"{per_worker} device(s), a contiguous block of the mesh). Put the data axes (dp/fsdp) first, and keep "
            f"the axes after them{f' ({later})' if later else ''} inside one worker: their product must divide "
            f"{per_worker}. Give each worker more devices ({more}) or make those axes smaller.")

    def check_model_on_mesh(self, model_config, num_devices: int) -> None:
        """On the driver, the worker's check of the model against the mesh (tp and kv heads, every parameter
        dimension against its mesh axes), on an abstract mesh of the sizes the workers will have."""
        from jax.sharding import AbstractMesh

        from ray_jax_train.mesh import resolve_axes
        from ray_jax_train.sharding import check_llama_parallelism

        axes = resolve_axes(self.mesh or {"dp": -1}, num_devices)
        mesh = AbstractMesh(tuple(axes.values()), tuple(axes))
        check_llama_parallelism(model_config, mesh, batch_size=self.micro_batch_size)

    def num_devices(self, gpus_per_worker: Optional[float] = None, scaling_config=None) -> Optional[int]:
        """Devices the run will have: CPU devices, GPUs (`gpus_per_worker`, default 1; a share of one GPU is one
        device), or TPU devices, which only Ray's `scaling_config` knows (its topology, accelerator type and TPUs
        per worker). None where Ray would refuse the count anyway (a fraction above 1), and for TPU workers without
        `scaling_config` or an accelerator type."""
        if self.use_tpu:
            from ray_jax_train.tpu import devices_per_worker

            per_worker = devices_per_worker(scaling_config) if scaling_config is not None else None
            return None if per_worker is None else self.num_workers * per_worker
        if not self.use_gpu:
            return self.num_workers * self.num_cpu_devices
        gpus = float(gpus_per_worker or 1)
        return self.num_workers * max(1, int(gpus)) if gpus < 1 or gpus.is_integer() else None
