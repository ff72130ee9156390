"""Turn a train-state checkpoint of a causal-LM run into a Hugging Face model directory.

A run writes `final_model/` only when training ends; `export_checkpoint` gives the same directory for any of its
checkpoints (an interrupted run's latest, or the best one Ray kept). Each checkpoint holds the params and the HF
config it was trained with; the tokenizer is in `<run>/model/` (see `RunOutputs`), with the config of the run's
latest start, which checkpoints from before the config was saved with them fall back to.

    export_checkpoint("runs/tiny-llama", "exported")                      # the run's latest checkpoint
    export_checkpoint("runs/tiny-llama/checkpoint_000000200_1a2b3c4d", "step200")
"""
from __future__ import annotations

import logging
import os
from typing import Any, Union

logger = logging.getLogger(__name__)

MODEL_FILES = "model"  # in the run directory: the HF config.json and the tokenizer's files
HF_CONFIG_KEY = "hf_config"  # in a checkpoint's metadata: the config.json its params were trained with
_CHECKPOINT_MARK = "_CHECKPOINT_METADATA"
GENERATION_CONFIG = "generation_config.json"  # HF's generation settings (an instruct model's end-of-turn eos)
_RUN_MARK = "checkpoint_manager_snapshot.json"  # Ray Train's record of a run's registered checkpoints

PathLike = Union[str, "os.PathLike[str]"]


def blocked_output(path: str, name: str, why: str) -> str:
    """The refusal of a file standing where the run writes a directory (the CLI's driver says it too)."""
    off = (", train without it (TrainingArguments(save_final_model=False); CLI: training.save_final_model=false)"
           if name == "final_model" else "")
    return (f"{path} is a file, where this run writes its {name}/ directory {why}. Move or remove the file{off}, or "
            "give the run another name.")


def final_model_blocked(run_dir: str) -> Union[str, None]:
    """The driver's early form of the workers' check (RunOutputs.refuse_blocked_outputs), for a local run directory:
    the refusal if a file stands where `final_model/` goes, else None."""
    final = os.path.join(run_dir, "final_model")
    if "://" in run_dir or not os.path.isfile(final):
        return None
    return blocked_output(final, "final_model", "when training ends")


def export_checkpoint(source: PathLike, out_dir: PathLike, *, model_config: Any = None, tokenizer: Any = None,
                      dtype: Any = None, overwrite: bool = False) -> str:
    """Write `source`'s params as an HF directory (config.json, safetensors, tokenizer) in `out_dir`; returns it.

    `source`: a checkpoint directory (`<run>/checkpoint_...`) or a run directory (its latest registered
    checkpoint), a local path or a URI, or the `ray.train.Checkpoint` `fit()` returns. Only the params are read, into this process's host memory (no Ray,
    no optimizer). `model_config` (a LlamaConfig, or a directory or file with an HF config.json) replaces the
    config the checkpoint was saved with (else the run's `<run>/model/config.json`), and `tokenizer` (a directory
    or tokenizer object) the run's `<run>/model/` tokenizer; a checkpoint from before configs were saved with it,
    of a run without `model/`, needs `model_config`. `dtype` casts the saved weights (default: the params' dtype).
    The run's `generation_config.json` (kept from the Hugging Face model it started from) comes along. An `out_dir`
    that holds files already is refused unless `overwrite=True`: a user's base model would otherwise be replaced.
    """
    import pyarrow.fs as pafs

    from ray_jax_train import storage
    from ray_jax_train.models import save_pretrained

    from ray_jax_train.checkpoint.core import checkpoint_text

    _refuse_a_full_dir(os.fspath(out_dir), overwrite)
    if dtype is not None:  # before anything is written: a refused dtype left files that refused the retry
        from ray_jax_train.config import canonical_dtype

        dtype = canonical_dtype(dtype)
    checkpoint, run_dir = _resolve(checkpoint_text(source))  # `result.checkpoint` too, as `restore` takes it
    _refuse_writing_into_the_run(os.fspath(out_dir), checkpoint, run_dir)
    fs, model_files = storage.filesystem(storage.join(run_dir, MODEL_FILES))
    has_files = fs.get_file_info(f"{model_files}/config.json").type == pafs.FileType.File
    own_config = _checkpoint_hf_config(checkpoint) if model_config is None else None
    if own_config is not None:
        model_config = _config_from_dict(own_config, f"{checkpoint}'s {HF_CONFIG_KEY}")
    elif model_config is None:
        if not has_files:
            raise FileNotFoundError(
                f"{run_dir} has no {MODEL_FILES}/config.json: the checkpoint is not one of the built-in LM loop's "
                "(export converts its Llama params; a loop of your own saves what it likes), or the run was made "
                "before ray_jax_train saved its model config there (or its config has no Hugging Face form, and no "
                "export can help). For the built-in loop's, pass the model "
                "config it trained with: model_config=<a directory with its config.json, e.g. another export or "
                "final_model/ of the same model> (CLI: --model-config DIR), and tokenizer=<DIR> (--tokenizer).")
        model_config = _read_config(fs, f"{model_files}/config.json", f"{run_dir}/{MODEL_FILES}/config.json")
    else:
        model_config = _config_from(model_config)
        saved = _checkpoint_hf_config(checkpoint)
        if isinstance(saved, dict):  # the split into heads has no shape of its own: the restore cannot see it
            from ray_jax_train.lm.state import FUNCTION_FIELDS, check_weights_fit

            check_weights_fit(_config_from_dict(saved, f"{checkpoint}'s {HF_CONFIG_KEY}"), f"checkpoint {checkpoint}",
                              model_config, "Export with the model config the checkpoint was saved with (leave "
                              "model_config out: the checkpoint records it).", chosen=FUNCTION_FIELDS)

    model = _restore_model(checkpoint, model_config)
    with storage.local_dir_for(os.fspath(out_dir)) as local:
        if overwrite and os.path.isfile(os.path.join(local, GENERATION_CONFIG)):
            os.remove(os.path.join(local, GENERATION_CONFIG))  # the earlier model's, which the run may not have
        generation = f"{model_files}/{GENERATION_CONFIG}"
        if has_files and tokenizer is None:  # the tokenizer's files; save_pretrained then writes config.json
            pafs.copy_files(model_files, local, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        elif has_files and fs.get_file_info(generation).type == pafs.FileType.File:
            # Another tokenizer (written below): the run's generation settings still belong to the model.
            pafs.copy_files(generation, os.path.join(local, GENERATION_CONFIG), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
        if isinstance(tokenizer, (str, os.PathLike)):
            from ray_jax_train.text import load_tokenizer

            load_tokenizer(os.fspath(tokenizer)).save_pretrained(local)
        elif tokenizer is not None:
            tokenizer.save_pretrained(local)
        save_pretrained(model, local, dtype=dtype)
        if not os.path.isfile(os.path.join(local, "tokenizer_config.json")):
            logger.warning("%s has no tokenizer (the run trained without one, or from before it was saved): pass "
                           "tokenizer= (CLI: --tokenizer DIR), or give one to whatever loads it.", out_dir)
    logger.info("Exported %s to %s.", checkpoint, out_dir)
    return os.fspath(out_dir)


def _refuse_a_full_dir(out_dir: str, overwrite: bool) -> None:
    """An export into a directory with files in it would mix two models' files, or replace a model a run starts
    from (a mistyped path): refused before anything is read, unless asked for."""
    import pyarrow.fs as pafs

    from ray_jax_train import storage

    fs, path = storage.filesystem(out_dir)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise FileExistsError(f"{out_dir} is a file: give export a directory to write the model in.")
    if info.type != pafs.FileType.Directory or overwrite:
        return
    if fs.get_file_info(pafs.FileSelector(path, recursive=False)):
        raise OutputDirNotEmpty(out_dir)


class OutputDirNotEmpty(FileExistsError):
    """An export's out_dir holds files already. Its fix is phrased per caller: `overwrite=True` in Python,
    `--overwrite` on the CLI."""

    def __init__(self, out_dir: str, fix: str = "pass overwrite=True (CLI: --overwrite)"):
        self.out_dir = out_dir
        super().__init__(f"{out_dir} holds files already (a model there would be replaced, and its other files mixed "
                         f"with this one's): give export a new or empty directory, or {fix}.")


def _refuse_writing_into_the_run(out_dir: str, checkpoint: str, run_dir: str) -> None:
    """Even with overwrite: an export into the checkpoint it reads, the run's directory or its model/ mixed an HF
    model's files into the run's own (a new user's walkthrough), and replaced model/config.json, which resumes and
    later exports read."""
    from ray_jax_train.storage import is_uri

    def norm(path: str) -> str:
        return path.rstrip("/") if is_uri(path) else os.path.realpath(path)

    out = norm(out_dir)
    # Only the checkpoint is refused below as well: a run directory's other subdirectories (final_model/) are fine.
    for place, what, nor_below in ((norm(checkpoint), "the checkpoint it exports", True),
                                   (norm(run_dir), "the run's directory", False),
                                   (norm(f"{run_dir.rstrip('/')}/{MODEL_FILES}"), f"the run's {MODEL_FILES}/", False)):
        if out == place or (nor_below and out.startswith(place + "/")):
            raise ValueError(f"{out_dir} is {what if out == place else 'inside ' + what}: an export there mixes a "
                             "Hugging Face model's files into the run's own. Give export a directory outside the "
                             f"run's checkpoints, e.g. {norm(run_dir)}/final_model or a new one.")


def _resolve(source: str):
    """(checkpoint, run directory) for a checkpoint or run directory; FileNotFoundError saying what was given."""
    import pyarrow.fs as pafs

    from ray_jax_train import storage

    fs, path = storage.filesystem(source)
    path = path.rstrip("/")
    # A URI keeps its query (an S3 endpoint_override) at the end of every path made from it.
    where, query = source.partition("?")[::2] if storage.is_uri(source) else (path, "")
    where, query = where.rstrip("/"), f"?{query}" if query else ""

    def has(name: str) -> bool:
        return fs.get_file_info(f"{path}/{name}").type != pafs.FileType.NotFound

    kind = fs.get_file_info(path).type
    if kind != pafs.FileType.Directory:
        what = "does not exist" if kind == pafs.FileType.NotFound else "is not a directory"
        raise FileNotFoundError(f"{source} {what}: give a checkpoint directory or a run directory.")
    if has(_CHECKPOINT_MARK):
        return where + query, where.rsplit("/", 1)[0] + query
    if has(_RUN_MARK):
        from ray.train import Result

        # Ray's latest registered checkpoint, not the highest-numbered directory (maybe a save never registered).
        # Reading it, Ray's checkpoint manager logs advice for starting a training run here: not what happens.
        manager_log = logging.getLogger("ray.train.v2._internal.execution.checkpoint.checkpoint_manager")
        level = manager_log.level
        manager_log.setLevel(max(level, logging.WARNING))
        try:
            latest = Result.from_path(where + query).checkpoint
        finally:
            manager_log.setLevel(level)
        from ray_jax_train.checkpoint.core import _location_of, finished_after

        # A save that finished after the run was stopped, before Ray registered it: the run's newest state, and
        # the one its next start resumes from.
        newer = finished_after(_location_of(where + query), _location_of(latest) if latest else None)
        name = newer[0].fs_path if newer else latest.path if latest else None
        if name is None:
            raise FileNotFoundError(f"The run {source} registered no checkpoint (training.save_steps saves them); "
                                    "its final_model/, if it finished, is already a Hugging Face directory.")
        if newer:
            logger.warning("Exporting %s, a finished checkpoint newer than the last one Ray registered (the run "
                           "stopped before registering it).", newer[0].uri)
        return f"{where}/{name.rstrip('/').rsplit('/', 1)[-1]}{query}", where + query
    if has("metrics.jsonl"):
        from ray_jax_train.checkpoint.core import _location_of, finished_after

        # Stopped before Ray registered its first checkpoint (a second Ctrl-C): no record, but a finished save,
        # which the next start resumes from. The driver said "no checkpoint saved yet: it starts over".
        unregistered = finished_after(_location_of(where + query), None)
        if unregistered:
            logger.warning("Exporting %s, a finished checkpoint of a run that stopped before Ray registered any.",
                           unregistered[0].uri)
            name = unregistered[0].fs_path.rstrip("/").rsplit("/", 1)[-1]
            return f"{where}/{name}{query}", where + query
    if has("best.json"):  # a Tune search's directory: its best trial is what a user exports
        best = _read_json(fs, f"{path}/best.json")
        if best.get("checkpoint"):
            logger.warning("%s is a Tune search: exporting its best trial's checkpoint, %s.", source,
                           best["checkpoint"])
            return _resolve(best["checkpoint"])
        raise FileNotFoundError(f"{source} is a Tune search whose best trial saved no checkpoint (training.save_steps"
                                f" saves them); its final model, already a Hugging Face directory, is in "
                                f"{best.get('run_dir')}/final_model.")
    hint = " It is a Hugging Face model directory already." if has("config.json") else ""
    if has("metrics.jsonl"):
        hint = (" It is a run that saved no checkpoint (it stopped before its first save; training.save_steps "
                "sets how often it saves).")
    raise FileNotFoundError(
        f"{source} is neither a ray_jax_train checkpoint (no {_CHECKPOINT_MARK}) nor a Ray Train run directory "
        f"(no {_RUN_MARK}).{hint}")


def _read_json(fs, fs_path: str):
    import json

    with fs.open_input_stream(fs_path) as f:
        return json.loads(f.read().decode())


def _read_config(fs, fs_path: str, shown: str):
    return _config_from_dict(_read_json(fs, fs_path), shown)


def _config_from_dict(data: dict, shown: str):
    from ray_jax_train.config import LlamaConfig

    try:
        return LlamaConfig.from_hf(data)
    except ValueError as exc:
        raise ValueError(f"{shown}: {exc}") from exc


def _checkpoint_hf_config(checkpoint: str):
    """The HF config saved in the checkpoint itself, or None (a checkpoint from before configs were saved there)."""
    from ray_jax_train import storage
    from ray_jax_train.checkpoint.core import META_FILE

    fs, path = storage.filesystem(storage.join(checkpoint, META_FILE))
    try:
        meta = _read_json(fs, path)
    except (OSError, ValueError):  # an unfinished or foreign checkpoint: the restore says which, clearly
        return None
    return meta.get(HF_CONFIG_KEY) if isinstance(meta, dict) else None


def _config_from(model_config: Any):
    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.models import load_hf_config

    if isinstance(model_config, LlamaConfig):
        return model_config
    path = os.fspath(model_config)
    if os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))
    return load_hf_config(path)


def _restore_model(checkpoint: str, model_config):
    """The checkpoint's params in a model of `model_config`, on one device of this process."""
    from flax import nnx

    from ray_jax_train.lm.state import abstract_params, restore_params

    return nnx.merge(abstract_params(model_config)[0], restore_params(checkpoint, model_config))
