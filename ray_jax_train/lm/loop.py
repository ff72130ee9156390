"""The built-in causal-LM `train_loop_per_worker`: what every JaxTrainer worker runs for `RayDistributedTrainer`.

Config keys (built by `loop_config`, as `RayDistributedTrainer.train` and the CLI do, or by hand for `JaxTrainer`):
    arguments     TrainingArguments as a dict
    model_config  LlamaConfig as a dict (precision overrides already applied)
    total_steps   resolved number of optimizer steps
    init          starting point from `state.init_spec` (default: a new model)
    columns       dataset columns to feed (default: the packed-row columns)
    has_eval      whether an "eval" dataset was given
    tokenizer     an object ref of the tokenizer that rank 0 saves beside the final model and into model/
                  (optional)
    progress_label  named in rank 0's progress lines ("[train trial 1a2b3_00001] step ..."), for a Tune trial
    record_dir    tests only: rank 0 writes the starting and final params and every step's global batch there

The step runs asynchronously: losses stay on device and the host only waits at log/eval/save steps.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import numpy as np

from ray_jax_train.errors import UsageValueError
from ray_jax_train.lm.export import GENERATION_CONFIG, HF_CONFIG_KEY, MODEL_FILES, blocked_output

logger = logging.getLogger(__name__)

DEFAULT_COLUMNS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")
# Facts about start-up that only the first logged record of an attempt carries.
STARTUP_KEYS = ("startup_s", "compilation_cache_hits", "compilation_cache_misses", "state_mb_per_device",
                "start_step")
# A checkpoint's data_state key for the per-step metrics of the steps it saved since the last log step.
WINDOW_KEY = "metrics_since_log"
# Every key a record (metrics.jsonl, ray.train.report) can carry; eval_* only on eval steps. A Tune metric must
# be one of these (checked on the driver).
REPORTED_KEYS = ("step", "epoch", "loss", "perplexity", "grad_norm", "loss_tokens", "learning_rate", "tokens_per_s",
                 "step_time_s", "mfu", "eval_loss", "eval_perplexity", "eval_tokens") + STARTUP_KEYS


def loop_config(args, model_config, total_steps: int, init: Dict[str, Any], columns: List[str], has_eval: bool,
                /, tokenizer=None, **extra: Any) -> Dict[str, Any]:
    """The `train_loop_config` that `train_loop_per_worker` reads (keys in the module docstring); `extra` wins.

    The tokenizer goes to the object store as the files it saves (`TokenizerFiles`): rank 0, on whichever node,
    writes them into `final_model/`, and with checkpoints into `model/` (what `export_checkpoint` turns a checkpoint
    into an HF directory with).
    """
    import ray

    wanted = args.save_final_model or args.save_steps
    tokenizer_ref = ray.put(TokenizerFiles.of(tokenizer)) if tokenizer is not None and wanted else None
    return {"arguments": args.model_dump(), "model_config": model_config.model_dump(), "total_steps": total_steps,
            "init": init, "columns": list(columns), "has_eval": has_eval, "tokenizer": tokenizer_ref,
            "generation_config": _generation_config_of(init) if wanted else None, **extra}


class TokenizerFiles:
    """A tokenizer as the files its `save_pretrained` writes, for workers to write out as they are.

    The tokenizer object itself unpickles only by importing transformers: about 4 s of a CPU in rank 0 of every
    run, for files the driver can write in milliseconds.
    """

    def __init__(self, files: Dict[str, bytes]):
        self.files = files

    @classmethod
    def of(cls, tokenizer) -> "TokenizerFiles":
        if isinstance(tokenizer, cls):
            return tokenizer
        with tempfile.TemporaryDirectory(prefix="rjt_tokenizer_") as saved:
            tokenizer.save_pretrained(saved)
            files = {}
            for root, _, names in os.walk(saved):
                for name in names:
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        files[os.path.relpath(path, saved)] = f.read()
        return cls(files)

    def save_pretrained(self, directory: str) -> None:
        for name, data in self.files.items():
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)


def _generation_config_of(init: Dict[str, Any]) -> Optional[str]:
    """The text of the starting Hugging Face model's `generation_config.json`, read on the driver, or None.

    It names the tokens generation stops at (Llama 3 Instruct's `<|eot_id|>` is only there) and the sampling
    defaults: the final model and every export keep it, or `generate` in transformers runs past each turn's end.
    """
    if init.get("source") != "hf":
        return None
    try:
        with open(os.path.join(init["path"], GENERATION_CONFIG)) as f:
            return f.read()
    except OSError:  # none, or unreadable: the model generates with its config.json's eos as before
        return None


def train_loop_per_worker(config: Dict[str, Any]) -> None:
    import jax
    import ray.train

    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.data import iter_jax_batches
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.metrics import Progress, Throughput, peak_flops_per_device
    from ray_jax_train.lm.profiling import StepProfiler
    from ray_jax_train.lm.step import (jit_train_step, keep_hyperparameters, make_eval_step, make_optimizer,
                                       new_state, one_all_reduce_axes)
    from ray_jax_train.models import flops_per_token
    from ray_jax_train.sharding import check_llama_parallelism

    started = time.perf_counter()
    args = TrainingArguments.model_validate(config["arguments"])
    model_config = LlamaConfig.model_validate(config["model_config"])
    total_steps = int(config.get("total_steps") or args.total_steps or 0)
    if total_steps < 1:
        raise UsageValueError("train_loop_per_worker needs total_steps (set TrainingArguments.total_steps, or "
                              "let RayDistributedTrainer count it from num_epochs).")
    columns = list(config.get("columns") or DEFAULT_COLUMNS)
    rank0 = jax.process_index() == 0
    outputs = RunOutputs.of_this_run()
    outputs.refuse_blocked_outputs(args)

    mesh = _loop_mesh(args)
    check_llama_parallelism(model_config, mesh, batch_size=args.micro_batch_size)
    attention = _attention_in_use(model_config, mesh, args)  # an explicit "cudnn" that cannot run fails here
    if rank0:
        logger.info("Attention: %s (model.attention_impl=%r).", attention, model_config.attention_impl)

    def open_epoch(epoch: int, skip: int):
        return iter_jax_batches("train", batch_size=args.batch_size, mesh=mesh, columns=columns, dtypes=np.int32,
                                skip_batches=skip, local_shuffle_buffer_size=args.shuffle_buffer_size,
                                local_shuffle_seed=shuffle_seed(args.seed, epoch, jax.process_index())
                                if args.shuffle_buffer_size else None)

    checkpointer = _checkpointer(args, model_config)
    # A fresh run starts reading now, so Ray Data's first batch (seconds) arrives while the state is built and
    # the step compiles; a resumed run must first learn from its checkpoint where in the data it stopped.
    may_resume = checkpointer is not None and args.resume_if_possible and checkpointer.has_resume_point()
    first_epoch = None if may_resume else open_epoch(0, 0)

    optimizer, schedule = make_optimizer(args, total_steps)
    graphdef, _ = state_lib.abstract_params(model_config)
    new_state_fn = lambda params, step: new_state(params, optimizer, step)  # noqa: E731
    abstract = state_lib.abstract_state(model_config, mesh, new_state_fn)
    step_fn = jit_train_step(graphdef, optimizer, args.gradient_accumulation_steps,
                             jax.tree.map(lambda leaf: leaf.sharding, abstract), mesh)
    if first_epoch is not None:
        first_epoch = _compile_ahead(step_fn, mesh, abstract, first_epoch)

    data_pos = {"epoch": 0, "batch": 0}
    resumed_at, resumed_from, state = None, None, None
    # The steps a checkpoint saved between two log steps, on the host: its resume's first record covers them too.
    carried: Optional[Dict[str, List[float]]] = None
    if checkpointer is not None and not args.resume_if_possible:
        checkpointer._restore_called = True  # starting over is what was asked for: no "restore() not called" warning
    if checkpointer is not None and args.resume_if_possible:  # also cleans up after a crashed first save
        # Restored into the abstract state: the starting weights (a Hugging Face model, a checkpoint) are read
        # only when there is nothing to resume, not on every restart only to be thrown away.
        restored = checkpointer.restore(abstract)
        if restored is not None:
            hyperparams = state_lib.fresh_hyperparameters(abstract, new_state_fn)
            fresh = SimpleNamespace(hyperparams={} if hyperparams is None else hyperparams)
            if rank0:
                try:  # advice only: it must not fail the one process that gives it
                    _warn_about_changed_settings(restored, fresh, args.scheduler, total_steps)
                except Exception as exc:  # noqa: BLE001
                    logger.debug("Could not compare the optimizer settings with the checkpoint's: %s", exc)
            if hyperparams is not None:
                restored.state["opt_state"] = keep_hyperparameters(restored.state["opt_state"], fresh)
            state, data_pos = restored.state, dict(restored.data_state or data_pos)
            carried = data_pos.pop(WINDOW_KEY, None)
            resumed_at, resumed_from = restored.step, restored.path
            if first_epoch is not None:
                # Opened at the data's start: has_resume_point said no on every process, so all reopen here alike.
                logger.warning("A checkpoint turned up after the data was opened for a fresh start; the data is "
                               "opened again at the checkpoint's position.")
                first_epoch = None
            if rank0:  # the same on every worker
                logger.info("Resuming at step %d from %s.", restored.step, restored.path)
            if not restored.data_state and restored.step:
                logger.warning("Checkpoint %s records no data position: step %d trains on the data from its start "
                               "again (a checkpoint saved by another loop?).", restored.path, restored.step)
    if state is None:
        state = state_lib.initial_state(config.get("init") or {}, model_config, mesh, new_state_fn=new_state_fn)
    step = int(jax.device_get(state["step"]))  # one sync, before the loop

    recorder = _Recorder(config.get("record_dir"), rank0)
    recorder.json("mesh", {"shape": dict(mesh.shape),
                           "processes": np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
                           "one_all_reduce_over": one_all_reduce_axes(mesh, jax.tree.map(lambda a: a.sharding,
                                                                                         abstract))})
    recorder.params("initial_params" if step == 0 else f"resumed_params_{step}", state["params"])
    if recorder.path:
        recorder.json("logging", {"train_reports_at_info": _train_logs_each_report()})

    # The model's activation sharding constraints apply only with the mesh in context when the steps trace.
    train_step = _with_mesh(mesh, step_fn)
    # Replicated out: each process reads its sums locally, with no program of their own (see evaluate).
    eval_step = _with_mesh(mesh, jax.jit(make_eval_step(graphdef),
                                         out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
    throughput = Throughput(flops_per_token(model_config, args.max_sequence_length), args.tokens_per_step,
                            jax.device_count(), peak_flops_per_device)
    if rank0 and args.save_steps:
        # After the restore: a resume with another model config fails there, and must not first overwrite the
        # config that the run's earlier checkpoints export with.
        outputs.save_model_files(model_config, config.get("tokenizer"), config.get("generation_config"))
    metrics_file = outputs.metrics_file() if rank0 else None
    if metrics_file is not None:  # the summary's restart count sees an attempt that dies before its first log step
        from ray_jax_train.plot import attempt_line

        metrics_file.append(attempt_line(step))
    progress = Progress(total_steps, initial=step, enabled=rank0 and not args.quiet,
                        label=config.get("progress_label"))
    profiler = StepProfiler(args.profile_start_step, args.profile_num_steps, f"{outputs.run_path}/profile",
                            outputs.filesystem, rank=ray.train.get_context().get_world_rank())
    profiler.skip_resumed(step)

    batch_size = args.eval_batch_size or args.micro_batch_size
    eval_batches = EvalBatches(lambda: iter_jax_batches("eval", batch_size=batch_size, mesh=mesh, columns=columns,
                                                        remainder="pad", dtypes=np.int32), args.max_eval_steps)

    def evaluate() -> Dict[str, float]:
        # Two different programs with collectives in flight at once deadlock gloo on a CPU mesh with sub-group
        # collectives (tp): a device thread starts the second program's collective while another still runs the
        # first's (a review: fsdp2 x tp2 with eval hung in 3 of 3 runs). So the step just dispatched finishes
        # first, and the eval sums are added up on the host, not by a program in flight beside the eval steps.
        jax.block_until_ready(state)
        sums = [eval_step(state["params"], batch) for batch in eval_batches()]
        if not sums:  # every process agreed on no batch, so all raise here together
            raise UsageValueError(
                "The eval dataset gave no batch: Ray splits it equally, rows // workers to each, so it needs at "
                f"least one packed row per worker ({jax.process_count()} processes). Give more eval text, or "
                "fewer workers.")
        loss_sum, tokens = (float(x) for x in np.sum(np.stack(jax.device_get(sums)), axis=0, dtype=np.float64))
        loss = loss_sum / max(tokens, 1.0)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": tokens}

    pending: List[Dict[str, Any]] = []  # device metrics since the last log step
    last: Dict[str, float] = {}

    def batches_of(epoch: int, skip: int):
        nonlocal first_epoch
        if first_epoch is not None:  # a fresh run's epoch 0, opened before the state was built
            opened, first_epoch = first_epoch, None
            return opened()
        return open_epoch(epoch, skip)

    def checkpoint_metrics() -> Dict[str, float]:
        """Called only when a save starts: the steps since the last log step, then the state itself, are checked
        first, so no state that went NaN is saved (and rotates good checkpoints out)."""
        nonlocal window_at_save
        finish_log_ahead()  # the last log step's record first: a save is a sync anyway
        jax.block_until_ready(state)  # the finite check below is a program with collectives: not beside the step
        fetched = _fetch(pending) if pending else None
        if fetched is not None:
            _stop_if_not_finite(fetched, step, checkpointer)
        _stop_if_state_not_finite(state, step, checkpointer)
        window_at_save = _joined_window(carried, fetched)
        return {**last, "step": step}  # the last log step's metrics, at the step saved

    window_at_save: Optional[Dict[str, np.ndarray]] = None

    def checkpoint_data_state() -> Dict[str, Any]:
        """Called after checkpoint_metrics: the data position, and the steps trained since the last log step.
        Without them a resume's first record covered only the steps after the checkpoint, and the steps between
        the last log step and the save were in no record."""
        data_state = {**position, "batch_size": args.batch_size}
        if window_at_save is not None:
            data_state[WINDOW_KEY] = {k: np.asarray(v).tolist() for k, v in window_at_save.items()}
        return data_state

    position = resume_position(data_pos, args.batch_size, warn=rank0)
    loss_tokens_seen, startup_step = 0.0, step
    compiled = False
    startup: Dict[str, float] = {}  # goes into the first logged record only
    # A log step's record whose metrics are on their way to the host. It is finished after the next step is
    # dispatched: a GPU trace showed the device idle for the whole of a log step's host work (the sync, then the
    # report and the next step's dispatch), which cost the loop 3-6% of its steps' speed at log_steps 20-50.
    log_ahead: Optional[Dict[str, Any]] = None

    def begin_log(at: int, epoch: int, due_eval: bool) -> Dict[str, Any]:
        nonlocal pending, startup, carried
        entry = {"record": {"step": at, "epoch": epoch, **startup}, "due_eval": due_eval,
                 "stacked": _to_host_soon(pending) if pending else None, "carried": carried}
        startup, pending, carried = {}, [], None
        return entry

    def finish_log(entry: Dict[str, Any]) -> None:
        nonlocal loss_tokens_seen
        record, at = entry["record"], entry["record"]["step"]
        if entry["stacked"] is not None:
            stacked = jax.device_get(entry["stacked"])
            _stop_if_not_finite(stacked, at, checkpointer)
            stacked = _joined_window(entry["carried"], stacked)
            record.update(_summarise(stacked, at, schedule))
            loss_tokens_seen += record["loss_tokens"]
            # The same global sum on every process: all raise together. Not at the first log step: data sorted
            # with its plain-text rows first may start with a few batches of nothing.
            if not loss_tokens_seen and (at - startup_step >= _NO_LOSS_TOKENS_STEPS or at >= total_steps):
                raise NoLossTokensError(_NO_LOSS_TOKENS.format(steps=at - startup_step))
            record.update(throughput.read())
        if entry["due_eval"]:
            record.update(evaluate())
            throughput.start()  # eval time is not training throughput
        # Re-sent with checkpoints: the latest of each metric, eval_* kept from the last eval, since Ray ranks a
        # checkpoint missing checkpoint_score_attribute first and would keep it over scored ones.
        last.update({k: v for k, v in record.items() if k not in STARTUP_KEYS})
        progress.update(0, record)
        if metrics_file is not None:
            metrics_file.append(json.dumps(record))
        ray.train.report(record)

    def finish_log_ahead() -> None:
        nonlocal log_ahead
        if log_ahead is not None:
            entry, log_ahead = log_ahead, None
            finish_log(entry)

    try:
        if step < total_steps:
            for epoch, seen, batch in epoch_batches(batches_of, position["epoch"], position["batch"], args.batch_size):
                recorder.batch(step + 1, batch)
                profiler.before_step(step + 1)
                state, metrics = train_step(state, batch)
                step, position = step + 1, {"epoch": epoch, "batch": seen}
                profiler.after_step(step, metrics)
                finish_log_ahead()  # the step just dispatched keeps the device busy meanwhile
                pending.append(metrics)
                if compiled:
                    throughput.step()
                else:  # keep the first step's compile out of tokens/s: one extra sync, once
                    jax.block_until_ready(metrics)
                    throughput.start()
                    compiled = True
                    startup = _log_first_step(step, time.perf_counter() - started, recorder, state)
                    throughput.measure_peak()  # still synced: a log step's read comes with a step in flight
                progress.update(1)
                due_log = step % args.log_steps == 0 or step == total_steps
                due_eval = bool(config.get("has_eval") and (
                    (args.eval_steps and step % args.eval_steps == 0) or step == total_steps))
                if due_log or due_eval:
                    log_ahead = begin_log(step, epoch, due_eval)
                    # Eval syncs anyway; the last step has no next one.
                    if due_eval or step >= total_steps or not _LOG_AFTER_NEXT_DISPATCH:
                        finish_log_ahead()
                if checkpointer is not None:
                    if checkpointer.maybe_save(step, state, metrics=checkpoint_metrics,
                                               data_state=checkpoint_data_state,
                                               final=step >= total_steps):
                        throughput.restart_if_just_read()
                if step >= total_steps:
                    break
    except BaseException:
        if log_ahead is not None and metrics_file is not None:
            _write_unfinished(log_ahead, metrics_file, schedule)
        raise
    finally:  # a run that fails keeps the metrics it logged (object stores get them at most every 30 s)
        profiler.stop()
        if metrics_file is not None:
            metrics_file.close()

    if checkpointer is not None or args.save_final_model:
        checkpoint_metrics()  # the last steps' update, before the final model keeps it (the last save checked it too)
    if checkpointer is not None:
        # The last step was saved in the loop (maybe_save(final=True) saves it whether or not it is a save_steps
        # step; a run resumed at the end trains no step and has it saved already): only the save in flight is left.
        checkpointer.close()
    if resumed_at is not None and resumed_at >= total_steps:
        _report_the_finished_run(outputs, resumed_at, resumed_from, rank0)
    recorder.params("final_params", state["params"])
    if args.save_final_model:
        from flax import nnx

        outputs.save_final_model(nnx.merge(graphdef, state["params"]), config.get("tokenizer"), rank0,
                                 config.get("generation_config"))


# benchmarks/suite.py's ours_synclog turns it off, to measure what finishing a log step late gains.
_LOG_AFTER_NEXT_DISPATCH = True
_NO_LOSS_TOKENS_STEPS = 20  # steps with no loss token before the data is called empty of anything to learn
_NO_LOSS_TOKENS = (
    "No token of the {steps} steps trained so far counted for the loss (loss_tokens 0): the model learns nothing "
    "from this data. Chat data needs assistant turns (only their tokens are trained on); pre-tokenised rows need "
    "loss_mask 1 on the tokens to learn. Check the data's messages column, or train on text instead.")


def resume_position(data_state: Dict[str, Any], batch_size: int, warn: bool = True) -> Dict[str, int]:
    """`{"epoch", "batch"}` to go on from, in batches of `batch_size`, for a saved data position.

    The position counts batches of the size the checkpoint was trained with (recorded since this check): a resume
    with another `batch_size` skips the same rows, rounded down to a whole batch, so a few rows are seen twice
    rather than some never seen.
    """
    epoch, batch = int(data_state["epoch"]), int(data_state["batch"])
    saved = int(data_state.get("batch_size") or batch_size)
    if saved == batch_size:
        return {"epoch": epoch, "batch": batch}
    rows = batch * saved
    again = rows % batch_size
    if warn:
        logger.warning("Resuming with batch_size=%d, where the checkpoint trained with %d: skipping the %d rows of "
                       "epoch %d it had trained on%s.", batch_size, saved, rows, epoch,
                       f" ({again} of them are trained on again, to start on a whole batch)" if again else "")
    return {"epoch": epoch, "batch": rows // batch_size}


def epoch_batches(open_epoch: Callable[[int, int], Iterator], epoch: int, skip: int, batch_size: int):
    """`(epoch, batches done in it, batch)` from a saved data position on, epoch after epoch, without end.

    `open_epoch(epoch, skip)` gives an epoch's batches after its first `skip`. A position at an epoch's very end
    (a checkpoint taken on its last batch) opens onto nothing and moves on to the next epoch; only an epoch read
    from its start that yields nothing is an error.
    """
    while True:
        seen = skip
        for batch in open_epoch(epoch, skip):
            seen += 1
            yield epoch, seen, batch
        if seen == 0:
            raise RuntimeError(
                f"Epoch {epoch} yielded no full global batch of {batch_size} rows: the training data is smaller "
                "than one batch (per worker shards may be uneven). Give more data or a smaller batch_size.")
        epoch, skip = epoch + 1, 0


def _compile_ahead(step_fn, mesh, abstract_state, batches) -> Callable[[], Iterator]:
    """Compile the train step in a thread, for the first batch's shapes, while the caller builds the state.

    Compiling (seconds, outside the GIL) then overlaps with initialising the state, and jit's caches make the
    first real call reuse the executable. Returns `join()`, which waits and gives the batches back unconsumed.
    A failed compile is left for the real call to report; a failed read is raised by `join()`.
    """
    import jax

    result: Dict[str, Any] = {}

    def run():
        try:
            result["first"] = next(batches, None)
        except BaseException as exc:  # surfaced by join()
            result["error"] = exc
            return
        if result["first"] is None:
            return
        try:
            with jax.set_mesh(mesh):
                step_fn.lower(abstract_state, result["first"]).compile()
        except Exception as exc:
            logger.debug("Compiling the train step ahead failed (%s); the first step compiles it.", exc)

    thread = threading.Thread(target=run, name="ray_jax_train-compile", daemon=True)
    thread.start()

    def join() -> Iterator:
        thread.join()
        if "error" in result:
            raise result["error"]
        first = result["first"]
        return batches if first is None else itertools.chain([first], batches)

    return join


def _log_first_step(step: int, seconds: float, recorder: "_Recorder", state) -> Dict[str, float]:
    """Say how long start-up took, whether the compiled programs came from the persistent cache (restarts, Tune
    trials), and how much of the train state each device holds (what FSDP and tensor parallelism are meant to
    cut). Returns the same facts for the first metrics record."""
    import jax

    from ray_jax_train.backend import compilation_cache_hits, compilation_cache_misses
    from ray_jax_train.sharding import bytes_per_device

    # Per process, then the fewest loaded and the most compiled: the group starts when its slowest process has
    # its programs.
    from ray_jax_train.checkpoint import _sync

    mine = f"{compilation_cache_hits()} {compilation_cache_misses()}"
    per_process = [tuple(int(n) for n in v.split()) for v in _sync.allgather("compilation_cache", mine)]
    hits, misses = min(h for h, _ in per_process), max(m for _, m in per_process)
    state_mb = max(bytes_per_device(state).values(), default=0) / 2**20
    if jax.process_index() == 0:  # the same line from every process said nothing more
        logger.info("Step %d done %.1f s after the loop started; programs loaded from the compilation cache / "
                    "compiled, per process: %s; the train state takes %.1f MB per device.", step, seconds,
                    ", ".join(f"{h}/{m}" for h, m in per_process), state_mb)
    # start_step: where this attempt began (a resume: its checkpoint's step), for plots and the CLI's summary.
    facts = dict(zip(STARTUP_KEYS, (seconds, hits, misses, state_mb, step - 1)))
    recorder.json(f"first_step_{step:06d}", dict(facts, seconds=seconds,
                                                 compilation_cache_hits_per_process=[h for h, _ in per_process],
                                                 compilation_cache_misses_per_process=[m for _, m in per_process]))
    return facts


def _with_mesh(mesh, fn):
    import jax

    def call(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    return call


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm went NaN or infinite: every later step and checkpoint would hold NaN weights."""

    retry_repeats_it = True  # FailureConfig does not retry it (ray_jax_train.retries)


class NoLossTokensError(ValueError):
    """No token of the data counts for the loss (chats without assistant turns, all-zero loss masks)."""

    retry_repeats_it = True


def _write_unfinished(entry: Dict[str, Any], metrics_file, schedule) -> None:
    """The log step a failure cut off before its record was finished, written if the device has its metrics
    ready (no report: Ray is tearing the group down; no checks: the error is already on its way). Not waited
    for: a step stuck in a collective with a dead peer would hang the way out."""
    import jax

    record = dict(entry["record"])
    try:
        if entry["stacked"] is not None:
            if not all(x.is_ready() for x in entry["stacked"].values()):
                return
            stacked = _joined_window(entry.get("carried"), jax.device_get(entry["stacked"]))
            record.update(_summarise(stacked, record["step"], schedule))
        metrics_file.append(json.dumps(record))
    except Exception as exc:  # noqa: BLE001 - the error that stopped the run is the one to raise
        logger.debug("Could not write step %s's record after the failure: %r", record.get("step"), exc)


def _joined_window(carried: Optional[Mapping[str, Any]], stacked: Optional[Dict[str, np.ndarray]]):
    """A log window's per-step metrics on the host: those a checkpoint carried over a resume, then this attempt's."""
    if not carried:
        return stacked
    if stacked is None:
        return {k: np.asarray(v, dtype=np.float32) for k, v in carried.items()}
    if set(carried) != set(stacked):  # another loop's metrics: the steps since the resume alone, as before
        return stacked
    return {k: np.concatenate([np.asarray(carried[k], dtype=v.dtype), v]) for k, v in stacked.items()}


def _to_host_soon(pending: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The steps' device metrics stacked per key, their copy to the host started (`jax.device_get` collects them):
    queued before the next step, the copy waits for this step only."""
    import jax.numpy as jnp

    stacked = {k: jnp.stack([m[k] for m in pending]) for k in pending[0]}
    for value in stacked.values():
        value.copy_to_host_async()
    return stacked


def _fetch(pending: List[Dict[str, Any]]) -> Dict[str, np.ndarray]:
    """The steps' device metrics, stacked per key, on the host: a host sync."""
    import jax

    return jax.device_get(_to_host_soon(pending))


def _stop_if_not_finite(stacked: Dict[str, np.ndarray], last_step: int, checkpointer) -> None:
    """Raise at the first step whose loss or gradient norm is not finite, after the save in flight is safe.

    Every worker sees the same global values, so all raise together. Without this the run trained on NaN weights
    to the end, and each periodic save pushed a good checkpoint out of `num_to_keep`. FailureConfig does not retry
    it: an attempt resumed from the last checkpoint would only repeat it (`ray_jax_train.retries`).
    """
    bad = ~(np.isfinite(stacked["loss"]) & np.isfinite(stacked["grad_norm"]))
    if not bad.any():
        return
    i = int(np.argmax(bad))
    bad_step = last_step - len(bad) + 1 + i
    if checkpointer is not None:
        checkpointer.wait(registered=True)  # the last good save is on storage and Ray's, not orphaned by the crash
    message = (
        f"Step {bad_step} gave loss {float(stacked['loss'][i])} and gradient norm "
        f"{float(stacked['grad_norm'][i])}: the weights are no longer finite, so the run stops here instead of "
        "training on or checkpointing them (checkpoints saved before this step are kept). Usual causes: a learning "
        "rate too high for the model (lower learning_rate, add warmup_steps, keep max_grad_norm set), float16 "
        "weights, which train without loss scaling here (use bfloat16), or a data_collator that feeds ids outside "
        "[0, vocab_size).")
    raise NonFiniteLossError(message)


def _stop_if_state_not_finite(state, step: int, checkpointer) -> None:
    """A step's loss and gradient norm are computed before its update, so an update that overflows (a learning rate
    past float32's range, an optimizer dividing by a flushed-to-zero epsilon) leaves them finite and the weights
    not. Checked on save steps only: one fused reduction over the state, small beside writing it."""
    if _all_finite(state):
        return
    if checkpointer is not None:
        checkpointer.wait(registered=True)
    message = (
        f"At step {step} the weights or optimizer state are no longer finite, although the loss and gradient norm "
        "of every step so far were (they are computed before each update), so the run stops before saving them "
        "(checkpoints saved before this step are kept). "
        "Usual cause: a learning rate (or weight_decay times it) so high that the update overflows float32.")
    raise NonFiniteLossError(message)


@functools.lru_cache(maxsize=None)
def _finite_check():
    import jax
    import jax.numpy as jnp

    def all_finite(tree):
        floats = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats])) if floats else jnp.bool_(True)

    return jax.jit(all_finite)


def _all_finite(tree) -> bool:
    import jax

    return bool(jax.device_get(_finite_check()(tree)))


def _summarise(stacked: Dict[str, np.ndarray], last_step: int, schedule) -> Dict[str, float]:
    """The interval's token-weighted loss, the last step's grad norm and learning rate."""
    tokens = stacked["tokens"]
    # Token-weighted mean: the loss of all the tokens in the interval, not a mean of per-step means.
    loss = float(np.sum(stacked["loss"] * tokens) / max(np.sum(tokens), 1.0))
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "grad_norm": float(stacked["grad_norm"][-1]),
            "loss_tokens": float(np.sum(tokens)), "learning_rate": float(schedule(last_step - 1))}


class EvalBatches:
    """The eval set's batches, read once and then kept on the devices while they are small (up to `max_bytes` per
    device; a 2048-token batch of 16 rows, ids, labels and mask in int32, is 0.4 MB). Each read is a Ray Data
    execution, and every execution left about 1 MB for good in Ray's stats actor and dashboard agent (a soak review:
    10 MB per 1000 steps at eval_steps=50); the rows are the same every pass (in_order_split)."""

    def __init__(self, open_batches: Callable[[], Iterator[Dict[str, Any]]], max_steps: Optional[int] = None,
                 max_bytes: int = 64 * 2**20):
        self._open, self._max_steps, self._max_bytes = open_batches, max_steps, max_bytes
        self._kept: Optional[List[Dict[str, Any]]] = None

    def __call__(self) -> Iterator[Dict[str, Any]]:
        import jax

        if self._kept is not None:
            yield from self._kept
            return
        # Bytes per device, the same in every process: all of them keep the set or none does, so their evals match.
        # (A batch is split over the batch axes only: on a tp or sp mesh each device holds more than its 1/n.)
        size, kept = 0, []
        with contextlib.closing(self._open()) as batches:  # cut at max_steps: the epoch ends before the next read
            for i, batch in enumerate(batches):
                if self._max_steps and i >= self._max_steps:
                    break
                size += sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                            for leaf in jax.tree.leaves(batch))
                if size > self._max_bytes:
                    kept = None  # too large to keep: the next eval reads the set again
                if kept is not None:
                    kept.append(batch)
                yield batch
        self._kept = kept


def _report_the_finished_run(outputs, step: int, checkpoint_path: str, rank0: bool) -> None:
    """A run resumed at its end trains nothing, and reported nothing: a Tune trial rerun after its search's driver
    was killed past the trial's last save then had no loss and no checkpoint, and the search named another trial
    best (a Tune chaos review). Its logged metrics up to `step` are reported again, with the checkpoint's path."""
    import ray.train

    from ray_jax_train.plot import parse_records

    metrics: Dict[str, Any] = {}
    if rank0:
        try:
            with outputs.filesystem.open_input_stream(f"{outputs.run_path}/metrics.jsonl") as f:
                text = f.read().decode()
        except Exception:  # noqa: BLE001 - none kept: the step and checkpoint alone
            text = ""
        for record in parse_records(text):
            if int(record.get("step", -1)) <= step:
                metrics.update(record)
        metrics.update(step=step, checkpoint_path=checkpoint_path)
    ray.train.report(metrics)


def _warn_about_changed_settings(restored, current_opt_state, scheduler: str, total_steps: int) -> None:
    """A resume trains with this run's optimizer numbers; say so where they differ from the checkpoint's (a longer
    total_steps restarts the decay from a higher rate), and when the checkpoint leaves nothing to train."""
    from ray_jax_train.lm.step import changed_hyperparameters, hyperparameter_values, schedule_value

    if restored.step >= total_steps:
        logger.warning("The checkpoint %s is at step %d, at or past this run's total_steps=%d: nothing is left to "
                       "train (the final model is written from it). Raise training.total_steps to train on.",
                       restored.path, restored.step, total_steps)
        return
    changed = changed_hyperparameters(restored.state["opt_state"], current_opt_state)
    if not changed:
        return
    hp = hyperparameter_values(current_opt_state)

    def rate(numbers):
        return float(schedule_value(restored.step, scheduler=scheduler, peak=numbers["peak_learning_rate"],
                                    end=numbers["end_learning_rate"], warmup=numbers["warmup_steps"],
                                    total=numbers["total_steps"]))

    saved = {**hp, **{name: old for name, (old, _) in changed.items()}}
    logger.warning("Resuming from %s with other optimizer settings than it was saved with: %s. The run trains on with "
                   "this config's numbers: the learning rate of step %d is %.3g (%.3g with the saved ones).",
                   restored.path, ", ".join(f"{name} {old:g} -> {new:g}" for name, (old, new) in changed.items()),
                   restored.step + 1, rate(hp), rate(saved))


def shuffle_seed(seed: int, epoch: int, process: int) -> int:
    """The local shuffle's seed for one epoch of one process: a function of all three, so a resume shuffles as before.
    With `seed + epoch` alone every worker shuffled its shard the same way, and the rows at one position of each
    shard met in one batch every epoch (a review); `seed + epoch` also gave seed 1's first epoch seed 0's second."""
    import numpy as np

    return int(np.random.SeedSequence([seed, epoch, process]).generate_state(1)[0])


def _attention_in_use(model_config, mesh, args) -> str:
    """Which attention the step will trace to on this backend and mesh: "cudnn (fused)" or "xla (materialised)"."""
    import jax

    from ray_jax_train.models.llama import attention_implementation

    cfg = model_config
    q_shape = (args.micro_batch_size, args.max_sequence_length, cfg.num_key_value_heads, cfg.num_key_value_groups,
               cfg.head_dim)
    with jax.set_mesh(mesh):
        impl = attention_implementation(cfg.attention_impl, q_shape, cfg.jnp_dtype)
    return "cudnn (fused)" if impl == "cudnn" else "xla (materialised)"


def _checkpointer(args, model_config):
    if not (args.save_steps or args.resume_if_possible):
        return None
    from ray_jax_train.checkpoint import JaxCheckpointer

    # Each checkpoint carries the HF config it was trained with: `export_checkpoint` needs no other file, and a
    # resume that changes a setting the restore cannot see (rope_theta) leaves earlier checkpoints' configs alone.
    hf_config = None if model_config.hf_export_problem() else model_config.to_hf_dict()
    # orbax's per-save INFO lines where this worker logs INFO (train(verbose=True), --verbose): quiet_worker did not run.
    return JaxCheckpointer(save_every=args.save_steps, handle_preemption=bool(args.save_steps),
                           metadata={HF_CONFIG_KEY: hf_config} if hf_config else None,
                           orbax_info_logs=logging.getLogger("absl").getEffectiveLevel() <= logging.INFO)


class RunOutputs:
    """Where the loop writes `metrics.jsonl` and `final_model/`: the run's directory in Ray's storage, a shared
    path or a URI (gs://, s3://) alike, so the outputs do not depend on which node rank 0 runs on."""

    def __init__(self, filesystem, run_path: str):
        self.filesystem, self.run_path = filesystem, run_path.rstrip("/")

    @classmethod
    def of_this_run(cls) -> "RunOutputs":
        import ray.train

        storage = ray.train.get_context().get_storage()
        return cls(storage.storage_filesystem, storage.experiment_fs_path)

    def refuse_blocked_outputs(self, args) -> None:
        """A file where the run writes a directory failed the run as training ended (`final_model/`), after all
        its steps, with a bare FileExistsError; it is refused before the first step, naming the fix."""
        import pyarrow.fs as pafs

        wanted = {"final_model": "when training ends"} if args.save_final_model else {}
        if args.save_steps:
            wanted[MODEL_FILES] = "for its checkpoints' export"
        for name, why in wanted.items():
            path = f"{self.run_path}/{name}"
            if self.filesystem.get_file_info(path).type == pafs.FileType.File:
                raise UsageValueError(blocked_output(path, name, why))

    def metrics_file(self):
        from ray_jax_train.storage import AppendOnlyFile

        return AppendOnlyFile(self.filesystem, f"{self.run_path}/metrics.jsonl")

    def save_model_files(self, model_config, tokenizer_ref, generation_config: Optional[str] = None) -> None:
        """`model/`: the HF config.json, the tokenizer and the generation config (where the run started from an HF
        model with one), all an export of a checkpoint needs besides its params. Rank 0 only. Skipped for a config HF cannot load, whose checkpoints have no HF form to export to."""
        import ray

        from ray_jax_train.storage import local_dir_for

        problem = model_config.hf_export_problem()
        if problem is not None:
            logger.info("This run's checkpoints cannot be exported as a Hugging Face model: %s", problem)
            return
        # Written aside (beside model/, so a crash leaves nothing an export copies), then each file moved in whole:
        # a crash mid-write leaves the earlier files, not torn ones.
        with local_dir_for(f"{self.run_path}/{MODEL_FILES}", self.filesystem) as local:
            staging = tempfile.mkdtemp(prefix=f".{MODEL_FILES}_writing_", dir=os.path.dirname(local))
            try:
                if tokenizer_ref is not None:
                    ray.get(tokenizer_ref).save_pretrained(staging)
                with open(os.path.join(staging, "config.json"), "w") as f:
                    json.dump(model_config.to_hf_dict(), f, indent=2)
                _write_generation_config(staging, generation_config)
                for name in os.listdir(staging):
                    os.replace(os.path.join(staging, name), os.path.join(local, name))
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def save_final_model(self, model, tokenizer_ref, rank0: bool, generation_config: Optional[str] = None) -> None:
        """HF safetensors, the tokenizer and the generation config. Every process calls it (gathering sharded
        params is collective)."""
        import ray

        from ray_jax_train.models import save_pretrained
        from ray_jax_train.storage import local_dir_for

        final = f"{self.run_path}/final_model"
        if not rank0:
            save_pretrained(model, final)  # takes part in the gather; only process 0 writes
            return
        with local_dir_for(final, self.filesystem) as local:
            save_pretrained(model, local)
            if tokenizer_ref is not None:
                ray.get(tokenizer_ref).save_pretrained(local)
            _write_generation_config(local, generation_config)


def _write_generation_config(directory: str, text: Optional[str]) -> None:
    if text is not None:
        with open(os.path.join(directory, GENERATION_CONFIG), "w") as f:
            f.write(text)


def _loop_mesh(args):
    """The loop's mesh: `TrainingArguments.mesh`, else the worker's `JaxConfig(mesh=...)`, else all devices on dp;
    with `JaxConfig(dcn_mesh=...)`, a hybrid mesh whose dcn axes cross hosts or slices.

    A JaxConfig mesh is checked as `TrainingArguments.mesh` would be (the axes this loop splits over); one that
    contradicts `TrainingArguments.mesh` is refused rather than silently losing to it.
    """
    import jax
    import ray.train

    from ray_jax_train.backend import worker_config
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.mesh import make_mesh, resolve_axes

    config = worker_config()
    if config is not None and not config.distributed and ray.train.get_context().get_world_size() > 1:
        raise UsageValueError(
            f"JaxConfig(distributed=False) makes each of the {ray.train.get_context().get_world_size()} workers a JAX "
            "job of its own, so the built-in loop would train that many separate models. Leave distributed at its "
            "default (True), or train on one worker.")
    own = dict(config.mesh) if config is not None and config.mesh else None
    if own is not None:
        # Order matters too: the last axes stay within a process.
        if args.mesh and (list(resolve_axes(args.mesh, jax.device_count()).items())
                          != list(resolve_axes(own, jax.device_count()).items())):
            raise UsageValueError(f"TrainingArguments(mesh={args.mesh}) and JaxConfig(mesh={own}) disagree; set the "
                                  "mesh in one place (TrainingArguments.mesh is what the driver checks the batch "
                                  "against).")
        own = TrainingArguments.model_validate({**args.model_dump(), "mesh": own}).mesh
    return make_mesh(args.mesh or own or {"dp": -1}, dcn=config.dcn_mesh if config is not None else None)


def _train_logs_each_report() -> bool:
    """Whether Ray Train logs its "Reporting training result" line here (tests: quiet mode turns it off)."""
    import logging

    from ray.train.v2._internal.execution import context

    return context.logger.isEnabledFor(logging.INFO)


class _Recorder:
    """Test hook: rank 0 keeps every step's global batch and the params, so a test can replay the run in one process.

    Each batch is written at once, as `batch_<step>.npz`: a worker killed mid-run leaves the batches it trained on,
    and a resumed run overwrites the steps it repeats. The gathers are collective, so every process runs them;
    only rank 0 writes.
    """

    def __init__(self, path: Optional[str], rank0: bool):
        self.path, self.rank0 = path, rank0
        if path and rank0:
            os.makedirs(path, exist_ok=True)

    def _gather(self, tree):
        import jax
        from jax.experimental import multihost_utils

        return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)

    def batch(self, step: int, batch) -> None:
        if self.path:
            gathered = self._gather(batch)
            if self.rank0:
                np.savez(os.path.join(self.path, f"batch_{step:06d}.npz"), **gathered)

    def json(self, name: str, record: Dict[str, Any]) -> None:
        if self.path and self.rank0:
            with open(os.path.join(self.path, f"{name}.json"), "w") as f:
                json.dump(record, f)

    def params(self, name: str, params) -> None:
        if not self.path:
            return
        import jax

        flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(self._gather(params))}
        if self.rank0:
            np.savez(os.path.join(self.path, f"{name}.npz"), **flat)
