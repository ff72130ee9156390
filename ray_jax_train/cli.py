"""`ray-jax-train`: train, tune, plot and check configs from the command line (also `python -m ray_jax_train`).

    ray-jax-train fit examples/tiny_llama.yaml --set training.total_steps=50
    ray-jax-train tune examples/tune_tiny_llama.yaml [--resume]
    ray-jax-train plot runs/tiny-llama
    ray-jax-train generate runs/tiny-llama --prompt "Once upon a time"
    ray-jax-train export runs/tiny-llama/checkpoint_000000200_1a2b3c4d exported/
    ray-jax-train config show examples/tiny_llama.yaml --set scaling.num_workers=2
    ray-jax-train config validate examples/tiny_llama.yaml

Exit codes: 0 success, 2 bad config or usage (said before anything starts), 1 training failed, 130 interrupted.
Ray address: --address, else RAY_ADDRESS (set by `ray job submit`), else run.address, else a new local Ray.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import re
import shlex
import sys
import time
import warnings
from typing import Optional, Sequence

from ray_jax_train.storage import absolute, exists

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130

_NOISY_LOGGERS = ("ray", "ray.train", "ray.data", "ray.tune", "jax", "absl", "orbax", "ray_jax_train")


class UsageError(Exception):
    """Bad command-line use: exit 2."""


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show Ray, Ray Data and JAX logs and full tracebacks")
    with_config = argparse.ArgumentParser(add_help=False, parents=[common])
    with_config.add_argument("config", help="YAML or JSON config file")
    with_config.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                             help="override one setting by its dotted path, e.g. --set training.learning_rate=1e-3 "
                                  "(repeatable; VALUE is read as YAML)")
    with_ray = argparse.ArgumentParser(add_help=False)
    with_ray.add_argument("--address", default=None,
                          help="Ray cluster to use ('auto' = the one `ray start` made here); default: RAY_ADDRESS, "
                               "then run.address, then a new local Ray instance")

    parser = argparse.ArgumentParser(prog="ray-jax-train", parents=[common], description=__doc__.split("\n\n")[0],
                                     epilog="Exit codes: 0 success, 2 bad config, 1 training failed, 130 interrupted.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sub.add_parser("fit", parents=[with_config, with_ray], help="train the model a config describes")
    tune = sub.add_parser("tune", parents=[with_config, with_ray], help="run the config's hyperparameter search")
    tune.add_argument("--resume", action="store_true",
                      help="continue the search saved under this tune.name if there is one (else start it): "
                           "finished trials are kept, unfinished ones resume from their latest checkpoints; the "
                           "config must be the one it started with")
    tune.add_argument("--resume-errored", action="store_true",
                      help="resume (implies --resume) and also run failed trials again from their latest "
                           "checkpoints")
    plot = sub.add_parser("plot", parents=[common], help="write PNG curves of loss, learning rate and tokens/s")
    plot.add_argument("run_dir", help="a run directory (<storage_path>/<run name>) with metrics.jsonl, or a Tune "
                                      "search directory (its trials' losses on shared axes)")
    plot.add_argument("-o", "--output", default=None,
                      help="PNG path (default: RUN_DIR/curves.png; a search's RUN_DIR/trials.png)")
    plot.add_argument("--smoothing", type=float, default=0.6, help="EMA weight in [0, 1) (default 0.6)")
    gen = sub.add_parser("generate", parents=[common], help="complete a prompt with a saved model (no Ray)")
    gen.add_argument("model_dir", help="a run directory (its final_model/ is used) or a Hugging Face model directory "
                                       "(config.json, *.safetensors, tokenizer files)")
    gen.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user turn through the chat template")
    gen.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory's)")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help="most tokens to add (default 64, or what max_position_embeddings leaves after the prompt)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest tokens")
    gen.add_argument("--top-p", type=float, default=None, help="sample among the likeliest tokens holding P")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    export = sub.add_parser("export", parents=[common],
                            help="write a checkpoint as a Hugging Face model directory (no Ray)")
    export.add_argument("source", help="a checkpoint directory (<run>/checkpoint_...) or a run directory (its latest "
                                       "checkpoint); a path or URI")
    export.add_argument("out_dir", help="where to write config.json, *.safetensors and the tokenizer")
    export.add_argument("--model-config", default=None,
                        help="a directory with the model's HF config.json (default: the one saved in the "
                             "checkpoint, else the run's model/; needed for checkpoints from before either was)")
    export.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the run's model/)")
    export.add_argument("--dtype", default=None, help="cast the weights, e.g. bfloat16 (default: as trained)")
    export.add_argument("--overwrite", action="store_true",
                        help="write into OUT_DIR even if it holds files (default: refuse, so no model is replaced)")
    config = sub.add_parser("config", parents=[common], help="show or validate a config")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION")
    config_sub.required = True
    config_sub.add_parser("show", parents=[with_config], help="print the effective config, defaults filled in")
    config_sub.add_parser("validate", parents=[with_config], help="check a config; exit 0 if it is valid, else 2")
    return parser


def _quiet(verbose: bool) -> None:
    if verbose:
        return
    from ray_jax_train.quiet import QUIET_ENV

    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR if name != "ray_jax_train" else logging.WARNING)
    from ray_jax_train.quiet import DATA_TASK_ERROR_LOGGERS

    for name in DATA_TASK_ERROR_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _connect(config, address: Optional[str], verbose: bool):
    """Join the cluster the user named, or start a private local one (never someone else's by accident)."""
    import ray

    from ray_jax_train.quiet import QUIET_ENV
    from ray_jax_train.trainer import TASK_EVENTS_IN_GCS, env_unless_set, with_import_guard, with_named_dashboard

    if ray.is_initialized():
        return ray
    given = bool(address)
    address = address or os.environ.get("RAY_ADDRESS") or config.run.address
    kwargs = dict(logging_level=logging.INFO if verbose else logging.ERROR, log_to_driver=True)
    if not address or address == "local":
        need = config.scaling.num_workers * (config.scaling.cpus_per_worker or 1)
        warning = _more_cpus_than_cores(need, os.cpu_count() or 1)
        if warning:  # the private Ray is sized to fit the workers, so nothing else would say so
            print(f"ray-jax-train: warning: {warning}", file=sys.stderr, flush=True)
        env = {} if verbose else dict(QUIET_ENV)
        # Logical CPUs beyond the workers' leave room for Ray Data on a small machine.
        with env_unless_set(*TASK_EVENTS_IN_GCS), _without_ray_start_line(verbose):  # the env: read by the GCS
            ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1, int(need) + 1),
                     **with_import_guard(with_named_dashboard(dict(runtime_env={"env_vars": env}, **kwargs))))
    else:
        _check_address(address, "--address" if given else ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS")
                                                            else "run.address"))
        with _without_ray_start_line(verbose):
            ray.init(address=address, **kwargs)
    if not verbose:
        from ray_jax_train.quiet import filter_worker_notices, quiet_data_context

        quiet_data_context()
        filter_worker_notices()  # for the rest of this command
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR if name != "ray_jax_train" else logging.WARNING)
    return ray


def _without_ray_start_line(verbose: bool):
    """The driver's own "Set ray log level from environment variable" line opened every quiet run's output."""
    from ray_jax_train.quiet import without_ray_start_line

    return contextlib.nullcontext() if verbose else without_ray_start_line()


def _more_cpus_than_cores(need: float, cores: int) -> Optional[str]:
    if need <= cores:
        return None
    return (f"the workers ask for {need:g} CPUs in all (scaling.num_workers x scaling.cpus_per_worker), and this "
            f"machine has {cores} cores: they share them, each slower. On a cluster, pass --address (or run.address) "
            "to use its nodes.")


@contextlib.contextmanager
def _sigterm_interrupts(resume_command: str):
    """`ray job stop` sends SIGTERM, then SIGKILL a few seconds later: handled as Ctrl-C is (Ray aborts the run, exit
    130), with the resume command printed at once, while there is time. Before, the log ended in a C++ signal dump."""
    import signal
    import threading

    said = {"resume": False}  # the caller prints only where the run resumes from once the command is out
    if threading.current_thread() is not threading.main_thread():
        yield said
        return

    def on_sigterm(signum, frame):
        print(f"[ray-jax-train] stopping on SIGTERM (`ray job stop`?); resume: {resume_command}", file=sys.stderr,
              flush=True)
        said["resume"] = True
        handler = signal.getsignal(signal.SIGINT)  # Ray's or Tune's abort while they run, else KeyboardInterrupt
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield said
    finally:  # None: a handler installed outside Python (JAX's signal dump), which Python cannot put back
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _check_address(address: str, where: str) -> None:
    """Refuse an address nothing answers at, or a dashboard URL, before `ray.init`: Ray retried the first for
    ever and gave a traceback for the second."""
    import socket

    from ray_jax_train.run_config import ConfigError

    if address.lower().startswith(("http://", "https://")):
        raise ConfigError(
            f"{where} {address} is a dashboard URL, which `ray job submit --address` takes. ray-jax-train joins a "
            "cluster by its GCS address, host:port (`ray start --head` prints it; 6379 by default), or 'auto' on one "
            f"of its nodes. To run there from this machine: ray job submit --address {address} --working-dir . -- "
            "ray-jax-train fit CONFIG")
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return  # Ray finds (or refuses) it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(
            f"{where} {address}: nothing answers there ({exc.strerror or exc}). Check that the cluster is up "
            f"(`ray status --address {address}`) and the host and port (the head's GCS port, 6379 by default); or "
            "leave the address out to start a private local Ray") from None


def _resume_hint(args, name: str) -> str:
    """The command that resumes this run, quoted so it pastes back into a shell (`{dp: 2}`, names with spaces)."""
    sets = [s for s in args.overrides if not s.startswith("run.name=")] + [f"run.name={name}"]
    return _as_submitted("ray-jax-train fit " + shlex.quote(args.config)
                         + "".join(f" --set {shlex.quote(s)}" for s in sets))


def _as_submitted(command: str) -> str:
    """`command` as a Ray job submits it, when this one runs as a job's entrypoint: run on the head node by hand, it
    would start a private local Ray instead of using the cluster (and after `ray job stop` the user is at their
    laptop, where the job was submitted from). The job's working directory is a copy of the submitter's, so its
    relative paths hold from the directory the job was submitted from."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return command
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        runtime_env = {}
    return "ray job submit" + (" --working-dir ." if runtime_env.get("working_dir") else "") + " -- " + command


def _latest_checkpoint(run_dir: str) -> str:
    """The checkpoint a resume of `run_dir` starts from: its newest finished one, registered with Ray or not
    (FileNotFoundError when it has none)."""
    from ray_jax_train.lm.export import _resolve

    export_log = logging.getLogger("ray_jax_train.lm.export")
    level = export_log.level
    export_log.setLevel(logging.ERROR)  # its "Exporting ..." notice: nothing is exported here
    try:
        return _resolve(run_dir)[0]
    finally:
        export_log.setLevel(level)


def _resume_point(run_dir: str) -> str:
    """Where a resume of `run_dir` would start, said in words."""
    from ray_jax_train.run_config import checkpoint_step

    try:
        checkpoint = _latest_checkpoint(run_dir)
    except FileNotFoundError:
        return "(no checkpoint saved yet: it starts over)"
    except Exception:  # noqa: BLE001 - an unreadable run directory: the resume line itself still matters most
        return "(from its latest checkpoint, if it saved one)"
    step = checkpoint_step(checkpoint)
    return f"(from the checkpoint of step {step})" if step is not None else f"(from {checkpoint})"


def _check_storage_not_in_job_copy(path: str) -> None:
    """A storage path in the job's copy of its working directory: a warning on one node; refused (exit 2) before
    anything is written where the cluster has several, since that copy is this node's alone (the workers found it
    about 30 s in, after the driver had written the tokenizer there)."""
    from ray_jax_train.run_config import ConfigError
    from ray_jax_train.storage import in_ray_package_cache

    if not in_ray_package_cache(path):
        return
    import ray

    nodes = sum(1 for node in ray.nodes() if node.get("Alive")) if ray.is_initialized() else 1
    if nodes > 1:
        raise ConfigError(
            f"run.storage_path: {path} is inside this job's copy of its --working-dir, which this node alone has; the "
            f"cluster has {nodes} nodes, and workers on the others could not write their checkpoints there. Set an "
            "absolute path (or a URI) that every node sees: --set run.storage_path=/mnt/shared/runs.")
    logging.getLogger("ray_jax_train").warning(
        "%s is inside this job's copy of its --working-dir, which Ray deletes with its cache; a resubmitted job gets "
        "another copy and would start over instead of resuming. Set run.storage_path to an absolute path (or a URI) "
        "that every node sees: --set run.storage_path=/mnt/shared/runs.", path)


def _refuse_starting_over_beside_checkpoints(config) -> None:
    """`training.resume_if_possible: false` under a run name that holds checkpoints started over beside them: it
    trained a new tokenizer over the run's (same size, other ids) and rewrote its model files, so exporting an old
    checkpoint paired its weights with the wrong tokenizer, without a word (a deletion-safety review). Refused
    before Ray starts, naming the ways out."""
    from ray_jax_train.run_config import ConfigError
    from ray_jax_train.storage import join

    if config.training.get("resume_if_possible", True) or not config.run.name:
        return
    run_dir = join(config.with_absolute_paths().run.storage_path, config.run.name)
    try:
        checkpoint = _latest_checkpoint(run_dir)
    except Exception:  # noqa: BLE001 - no checkpoint there (or none readable): nothing to keep apart
        return
    raise ConfigError(
        f"training.resume_if_possible: false would start run {config.run.name!r} over in {run_dir}, beside the "
        f"checkpoints it holds (the latest: {checkpoint}), and replace the tokenizer and model files they need. Give "
        f"the new run another run.name, or move {run_dir} away first; or leave resume_if_possible on to resume it.")


def _check_the_resume_before_ray(config) -> Optional[str]:
    """A run that resumes meets its tokenizer and checkpoint here, before Ray starts: a changed
    tokenizer.vocab_size or model size was refused 12-16 s later, once Ray was up (a CLI review). Only where both
    are on local disk already (no tokenizer to train first); the trainer's build checks again, and warns, later.
    Returns the checkpoint it resumes from, where it looked."""
    from ray_jax_train.run_config import TOKENIZER_DIR, check_resumed_model, ensure_tokenizer
    from ray_jax_train.storage import is_uri, join

    if not config.run.name:
        return None  # a new run: its name is made now
    run_dir = join(config.with_absolute_paths().run.storage_path, config.run.name)
    from ray_jax_train.lm.export import final_model_blocked

    blocked = final_model_blocked(run_dir) if config.training.get("save_final_model", True) else None
    if blocked:
        from ray_jax_train.run_config import ConfigError

        raise ConfigError(f"run.name: {blocked}")
    if not config.training.get("resume_if_possible", True):
        return None  # refused above for starting over
    saved = os.path.isfile(os.path.join(run_dir, TOKENIZER_DIR, "tokenizer.json"))
    if is_uri(run_dir) or not (saved or config.tokenizer.path) or not glob.glob(os.path.join(run_dir, "checkpoint_*")):
        return None
    quiet = [logging.getLogger(name) for name in ("ray_jax_train.run_config", "ray_jax_train.lm.export",
                                                  "ray_jax_train.lm.state")]
    levels = [log.level for log in quiet]
    for log in quiet:  # the build's own check says its warnings once Ray is up; errors are raised either way
        log.setLevel(logging.ERROR)
    try:
        tokenizer = ensure_tokenizer(config, join(run_dir, TOKENIZER_DIR), reuse=True)
        return check_resumed_model(run_dir, config.llama_config(tokenizer))
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def _finished_already(config, resumes_from: Optional[str]) -> bool:
    """True, said, where the run is at training.total_steps already and its final_model/ was written after that
    checkpoint: a rerun started Ray and a worker (30 s) only to write final_model/ again, and its summary counted
    the no-op as a restart. Where final_model/ is missing or older (a run stopped before it), the run goes on to
    write it. Local runs with total_steps set only: num_epochs is counted from the data, once Ray is up."""
    from ray_jax_train.run_config import checkpoint_step

    total, at = config.training.get("total_steps"), checkpoint_step(resumes_from)
    if not total or at is None or at < total or not config.training.get("save_final_model", True):
        return False
    final = os.path.join(os.path.dirname(resumes_from), "final_model")

    def newest(path):
        return max((os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs), default=0.0)

    weights = glob.glob(os.path.join(final, "*.safetensors"))
    if not (os.path.isfile(os.path.join(final, "config.json")) and weights):
        return False
    if min(os.path.getmtime(f) for f in weights) < newest(resumes_from):
        return False
    print(f"ray-jax-train: run {config.run.name} is at step {at} already, at or past training.total_steps={total}, "
          f"and its final model is from that step: nothing to train, and Ray was not started.\n"
          f"final model: {final}\n"
          "Raise training.total_steps to train it on, or give a new run.name.", file=sys.stderr, flush=True)
    return True


def _check_storage_usable(path: str, make: bool = True) -> None:
    """A local run.storage_path is made now, on the driver, before Ray starts: a file there, or a directory this user
    may not create, failed seconds later inside Ray naming neither the key nor the fix. `make=False` (`config
    validate`, which writes nothing) looks instead: a file in the way, or no right to create it."""
    from ray_jax_train.run_config import ConfigError
    from ray_jax_train.storage import in_ray_package_cache, is_uri

    path = _file_uri_path(path)  # a local path all the same: a file there failed 20 s in, once Ray was up
    if is_uri(path) or in_ray_package_cache(path):  # a job's copy: refused or warned once Ray is up, unwritten
        return
    blocked = path
    while not os.path.exists(blocked) and os.path.dirname(blocked) != blocked:
        blocked = os.path.dirname(blocked)
    if not os.path.isdir(blocked):
        raise ConfigError(f"run.storage_path: {blocked} is a file; runs are directories under "
                          f"{'it' if blocked == path else path}. Set run.storage_path to a directory (made if "
                          "missing), or a gs:// / s3:// URI.")
    try:
        if not make:
            if not os.access(blocked, os.W_OK | os.X_OK):
                raise PermissionError(f"{blocked} is not writable by this user")
            return
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run.storage_path: {path} cannot be made here ({exc.strerror or exc}). Set "
                          "run.storage_path to a directory this user may create and write, or a gs:// / s3:// URI."
                          ) from None


RUN_CONFIG = "config.yaml"


def _keep_config(config, run_dir: str) -> None:
    """The effective config (overrides applied, defaults filled in, paths absolute) in the run's directory: the run
    can be read, and run again, from there once the file it came from has changed (a review: only the terminal's
    resume line recorded it)."""
    from ray_jax_train.run_config import dump
    from ray_jax_train.storage import local_dir_for

    try:
        with local_dir_for(run_dir) as local:
            with open(os.path.join(local, RUN_CONFIG), "w") as f:
                f.write(dump(config.with_absolute_paths()))
    except OSError as exc:  # the run itself matters more: storage problems are reported where they stop it
        logging.getLogger("ray_jax_train").warning("Could not write %s/%s: %s", run_dir, RUN_CONFIG, exc)


def cmd_fit(args) -> int:
    from ray_jax_train.run_config import (ConfigError, build_trainer, check_cluster_fits, check_data_columns,
                                          load_config, read_error)

    config = load_config(args.config, args.overrides)
    if config.tune is not None:  # the search's values were not used, and nothing said so (a CLI review)
        print(f"ray-jax-train: warning: {args.config} has a tune section, which fit does not read: this trains once "
              "with the config's own values. For the search: ray-jax-train tune CONFIG", file=sys.stderr, flush=True)
    check_data_columns(config)  # before Ray starts
    _check_storage_usable(config.with_absolute_paths().run.storage_path)
    _refuse_starting_over_beside_checkpoints(config)
    if _finished_already(config, _check_the_resume_before_ray(config)):
        return EXIT_OK
    _connect(config, args.address, args.verbose)
    check_cluster_fits(config.scaling)
    _check_storage_not_in_job_copy(config.with_absolute_paths().run.storage_path)
    started = time.time()
    import ray.exceptions

    try:
        trainer, info = build_trainer(config, quiet=not args.verbose)
    # Data, sizes or storage the driver can see are wrong: a config problem. A bad row past the first ones that the
    # driver checks itself fails in a Ray Data task while the data is tokenised, and is one all the same.
    except (ValueError, OSError, ray.exceptions.RayTaskError) as exc:
        if args.verbose:
            import traceback

            traceback.print_exc()
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            # e.g. a storage_path it may not write, or a bucket without credentials: was a traceback, exit 1
            raise ConfigError(f"{exc} (check run.storage_path and the data and tokenizer paths: the driver could "
                              "not read or write them)") from None
        raise ConfigError(read_error(exc) + _where_the_bad_row_is(read_error(exc), config)) from None
    print(f"[ray-jax-train] run {info['name']}: {config.scaling.num_workers} worker(s), {info['total_steps']} steps, "
          f"outputs in {info['run_dir']}", flush=True)
    _keep_config(config, info["run_dir"])
    _say_it_resumes(info)
    said = {"resume": False}
    try:
        with _sigterm_interrupts(_resume_hint(args, info["name"])) as said:
            result = trainer.fit()
    except KeyboardInterrupt:  # exit 130 in main; the run resumes from its latest checkpoint
        if said["resume"]:  # the SIGTERM handler printed the command at once, before Ray's abort
            print(f"[ray-jax-train] the resume command above: {_resume_point(info['run_dir']).strip('()')}",
                  file=sys.stderr)
        else:
            print(f"[ray-jax-train] resume:  {_resume_hint(args, info['name'])}  {_resume_point(info['run_dir'])}",
                  file=sys.stderr)
        raise
    except Exception as exc:  # the run failed after it started: exit 1, not 2
        return _training_failed(exc, args.verbose, info["run_dir"], resume=_resume_hint(args, info["name"]),
                                config=config)
    _summary(args, result, info, started)
    return EXIT_OK


def _where_the_bad_row_is(message: str, config) -> str:
    """The file and line of the data's first bad row, for an error about a row that does not say where it is."""
    from ray_jax_train.text.locate import BAD_ROW_FOUND, where_the_bad_row_is

    if BAD_ROW_FOUND in message:
        return ""
    return where_the_bad_row_is(message, config.data.paths() + config.data.paths("eval_source"),
                                text_column=config.training.get("text_column", "text"),
                                messages_column=config.training.get("messages_column", "messages"))


def _shortened(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters at a sentence's end (else a word's), marked as cut: a summary line cut
    mid-sentence read as the whole advice ("... lower learning_rate,")."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind(". "), head.rfind("; "))
    return (head[:end + 1] if end > limit // 3 else head.rsplit(" ", 1)[0]) + " [...]"


def _error_line(exc: BaseException) -> str:
    """`Type: message` of the error behind `exc`: the first worker's own exception where Ray wraps it (Ray's
    WorkerGroupError text is a traceback whose middle Ray cuts out of long messages, so its last line could start
    mid-word and hide the error's type), else the last line of the innermost cause."""
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    failures = getattr(cause, "worker_failures", None)
    if failures:
        rank = min(failures)
        cause = failures[rank]
        lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
        message = lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""
        lost = getattr(cause, "health_check_failure", None)
        if lost is not None:  # the worker's process or node died: Ray's first line named neither rank nor cause
            message = f"{message} {_lost_worker(rank, lost)}"
    else:
        text = str(cause).strip().splitlines()
        message = text[-1] if text else ""
        if re.search(r"^\s*class_name: TrainController$", str(cause), re.M):  # Ray's text blames a worker's OOM
            pid = re.search(r"^\s*pid: (\S+)", str(cause), re.M)
            message = (f"the run's controller (Ray Train's TrainController actor{f', pid {pid.group(1)}' if pid else ''}"
                       f") died, and the workers with it; the checkpoints saved so far stand. {_shortened(message, 200)}")
    message = message if len(message) <= 600 else message[:600] + " ..."
    return f"{type(cause).__name__}: {message}"


def _worker_error(exc: BaseException) -> BaseException:
    """The first worker's own exception behind a failed run (what `_error_line` reports), else the innermost cause."""
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    failures = getattr(cause, "worker_failures", None)
    return failures[min(failures)] if failures else cause


def _lost_worker(rank: int, failure: BaseException) -> str:
    """Which worker, where, and Ray's reason, from the error of a worker that died or stopped answering."""
    text = str(failure)
    found = {key: re.search(rf"^\s*{key}: (\S+)", text, re.M) for key in ("pid", "ip")}
    where = " on ".join(m.group(1) for m in (found["pid"], found["ip"]) if m)
    reason = next((line.strip() for line in text.splitlines() if "dead because" in line or "exit detail" in line
                   or "was killed" in line.lower()), "")
    reason = _shortened(reason, 300) if reason else type(failure).__name__
    return (f"Worker {rank}{f' (pid {where})' if where else ''}: {reason} A killed process, a lost node or memory "
            "running out does this; the other workers' JAX aborts that follow are its consequence.")


def _training_failed(exc: BaseException, verbose: bool, run_dir: str, resume: Optional[str] = None,
                     config=None) -> int:
    if verbose:
        import traceback

        traceback.print_exception(exc)
    line = _error_line(exc)
    if config is not None:  # rows read while training (the data streams): which file, which line
        from ray_jax_train.text.errors import read_error

        line += _where_the_bad_row_is(read_error(_worker_error(exc)), config)
    print(f"[ray-jax-train] training failed: {line}", file=sys.stderr)
    from ray_jax_train.retries import why_not_retried

    if why_not_retried(exc):  # the first worker's error, above, may only say that a worker died
        print(f"[ray-jax-train] {why_not_retried(exc)}", file=sys.stderr)
    print(f"[ray-jax-train] logs and partial outputs: {run_dir}"
          + ("" if verbose else " (re-run with --verbose for the traceback)"), file=sys.stderr)
    if resume:  # once the cause is fixed (or a lost node is back), from the run's latest checkpoint if it saved one
        from ray_jax_train.retries import repeats_on_retry

        fix_first = (" (after fixing the cause: as it is, it stops the same way)"
                     if repeats_on_retry(exc) or why_not_retried(exc) else "")
        print(f"[ray-jax-train] resume:  {resume}{fix_first}", file=sys.stderr)
    return EXIT_FAILED


def _summary(args, result, info, started: float) -> None:
    from ray_jax_train.plot import parse_records, resumed_steps
    from ray_jax_train.storage import join, read_text

    run_dir = info["run_dir"]
    try:
        text = read_text(join(run_dir, "metrics.jsonl"))
    except FileNotFoundError:
        text = ""
    everything = parse_records(text)
    records = [r for r in everything if "loss" in r]
    evals = [r for r in everything if "eval_loss" in r]
    lines = ["", "=== ray-jax-train: done ===", f"run:         {info['name']} ({time.time() - started:.0f}s)"]
    if records:
        first, last = records[0], records[-1]
        # The median over the log steps: the last one's alone, which the line showed, was 801 or 10550 in runs whose
        # median was 4432 (a review): a short last interval, a save or an eval in it.
        rates = sorted(r["tokens_per_s"] for r in records if r.get("tokens_per_s"))
        speed = f"; {rates[len(rates) // 2]:.0f} tokens/s (median of {len(rates)} log steps)" if rates else ""
        lines.append(f"train loss:  {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} "
                     f"(step {last['step']}){speed}")
    if evals:
        lines.append(f"eval loss:   {evals[0]['eval_loss']:.3f} (step {evals[0]['step']}) -> "
                     f"{evals[-1]['eval_loss']:.3f} (step {evals[-1]['step']})")
    relogged = resumed_steps(text)
    if relogged:  # the group failed and resumed from a checkpoint (or this command resumed an earlier run)
        starts = [f"step {s}" if s else "the start" for s in relogged]  # the start: no checkpoint was saved yet
        lines.append(f"restarts:    {len(relogged)} (from {', '.join(starts)})")
    lines.append(f"metrics:     {os.path.join(run_dir, 'metrics.jsonl')}")
    if result.checkpoint is not None:
        kept = len(getattr(result, "best_checkpoints", None) or [])
        lines.append(f"checkpoint:  {result.checkpoint.path} (latest; {kept} kept)")
    else:
        lines.append("checkpoint:  none (set training.save_steps to save some)")
    try:
        has_final = exists(os.path.join(run_dir, "final_model"))
    except (OSError, ValueError):  # storage out of reach now: the summary leaves the line out
        has_final = False
    if has_final:
        lines.append(f"final model: {os.path.join(run_dir, 'final_model')} (HF safetensors + tokenizer)")
    lines.append(f"resume:      {_resume_hint(args, info['name'])}")
    lines.append(f"plot:        ray-jax-train plot {shlex.quote(run_dir)}")
    print("\n".join(lines), flush=True)


def cmd_tune(args) -> int:
    from ray_jax_train import tune
    from ray_jax_train.run_config import ConfigError, check_data_columns, load_config

    config = load_config(args.config, args.overrides)  # validate before Ray starts
    tune.require_param_space(config)
    check_data_columns(config)
    resume = args.resume or args.resume_errored
    if resume:
        tune.can_resume(config, warn=False)  # a changed config is refused before Ray starts; tune.run warns
    _check_storage_usable(config.with_absolute_paths().run.storage_path)
    _connect(config, args.address, args.verbose)
    _check_storage_not_in_job_copy(config.with_absolute_paths().run.storage_path)
    started = time.time()
    command = _as_submitted("ray-jax-train tune " + shlex.quote(args.config)
                            + "".join(f" --set {shlex.quote(s)}" for s in args.overrides) + " --resume")
    said = {"resume": False}
    try:
        with _sigterm_interrupts(command) as said:
            outcome = tune.run(args.config, overrides=args.overrides, quiet=not args.verbose, resume=resume,
                               resume_errored=args.resume_errored)
    except (ConfigError, FileNotFoundError):
        raise
    except tune.SearchInterrupted as exc:
        print(f"[ray-jax-train] {exc}" + ("" if said["resume"] else f"\n[ray-jax-train] resume:  {command}"),
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        return _training_failed(exc, args.verbose, absolute(config.run.storage_path))
    grid = outcome.results
    print("\n=== ray-jax-train: search done ===")
    took = f"{time.time() - started:.0f}s" + (" since the resume" if resume else "")
    print(f"trials:      {len(grid)} ({sum(1 for r in grid if r.error)} failed; {took})")
    for line in _trial_lines(grid, outcome, config.training.get("total_steps")):
        print(line)
    print(f"trial runs:  {outcome.experiment_dir}-<trial id> (each trial's Train run: metrics.jsonl, checkpoints)")
    print(f"best {outcome.metric}:  {outcome.best_metrics[outcome.metric]:.4f} with "
          + ", ".join(f"{k}={_get(outcome.best_config, k)}" for k in outcome.searched))
    if outcome.warning:
        print(f"warning:     {outcome.warning}")
    print(f"best run:    {outcome.best_run_dir}")
    print(f"checkpoint:  {outcome.best_checkpoint or f'none ({outcome.no_checkpoint_reason()})'}")
    print(f"summary:     {os.path.join(outcome.experiment_dir, 'best.json')} "
          "(ray_jax_train.tune.restore_best(DIR) loads the best parameters)")
    print(f"best config: {os.path.join(outcome.experiment_dir, tune.BEST_CONFIG)} (`ray-jax-train fit` trains it)")
    return EXIT_OK


def _say_it_resumes(info) -> None:
    """A run name used before resumes that run (run.resume_if_possible): said on the driver, and loudly where the
    checkpoint leaves nothing to train, which would otherwise 'finish' at once with the old run's numbers."""
    at, total = info.get("resumes_at"), info["total_steps"]
    if info.get("resumes_from") is None:
        return
    # "latest": the workers check it, and fall back to the one before if it does not restore (a chaos review).
    where = (f"its latest checkpoint, at step {at} (or an earlier one, where that one does not restore)"
             if at is not None else info["resumes_from"])
    print(f"[ray-jax-train] run {info['name']} exists: it resumes from {where} (a new run needs another "
          "run.name)", flush=True)
    if at is not None and at >= total:
        print(f"ray-jax-train: warning: run {info['name']} is at step {at} already, at or past training.total_steps="
              f"{total}: nothing is left to train. Raise training.total_steps to train it on, or give a new "
              "run.name.", file=sys.stderr, flush=True)


def _trial_lines(grid, outcome, base_total_steps: Optional[int]) -> list:
    """One line per trial: its id (its Train run is <search dir>-<id>), searched values, last step and metric, and
    how it ended (finished, stopped early by the scheduler, or failed, with the error)."""
    from ray_jax_train.tune import trained_to_end

    def searched(result, dotted: str, default=None):  # Tune's trial config is nested: {"training": {...}}
        section, key = dotted.split(".", 1)
        return ((result.config or {}).get(section) or {}).get(key, default)

    lines = []
    for result in sorted(grid, key=lambda r: (r.metrics or {}).get("trial_id") or ""):
        values = ", ".join(f"{k.split('.', 1)[-1]}={_short(searched(result, k))}" for k in outcome.searched)
        metrics = result.metrics or {}
        step, total = metrics.get("step"), searched(result, "training.total_steps", base_total_steps)
        if result.error is not None:
            ended = f"failed: {_shortened(_error_line(result.error), 300)}"
        elif not trained_to_end(result, base_total_steps):
            ended = "stopped early by the scheduler"
        else:
            ended = "finished"
        value = metrics.get(outcome.metric)
        shown = f"{outcome.metric} {value:.4f}" if isinstance(value, (int, float)) else f"no {outcome.metric}"
        at = f"step {step}/{total}" if step is not None and total else f"step {step}" if step is not None else ""
        best = "  <- best" if metrics.get("trial_id") == outcome.best_metrics.get("trial_id") else ""
        # A trial that failed before its first report has no trial_id there; its Tune directory is trial_<id>_...
        trial_id = metrics.get("trial_id") or "_".join(os.path.basename(result.path or "").split("_")[1:3])
        lines.append(f"  {trial_id}  {values}: {shown}, {at}, {ended}{_resumes(outcome, trial_id)}{best}"
                     .replace(", , ", ", "))
    return lines


def _resumes(outcome, trial_id: str) -> str:
    """", resumed 2 times (from step 8, 16)" for a trial whose Train run restarted from its checkpoints: its
    workers failed and Train retried, its trial actor was lost and Tune ran it again, or the search was resumed.
    Without it a search that ended well hid the failures it rode over."""
    from ray_jax_train.plot import resumed_steps
    from ray_jax_train.storage import read_text

    try:
        relogged = resumed_steps(read_text(f"{outcome.experiment_dir}-{trial_id}/metrics.jsonl"))
    except (OSError, ValueError):  # no run yet (failed before its first report), or storage out of reach now
        return ""
    if not relogged:
        return ""
    starts = ", ".join(str(s) if s else "the start" for s in relogged)
    return f", resumed {len(relogged)} time{'s' * (len(relogged) > 1)} (from step {starts})".replace(
        "from step the start", "from the start")


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else repr(value)


def _get(config, dotted: str):
    section, key = dotted.split(".", 1)
    if section == "training":
        return config.training.get(key)
    return getattr(getattr(config, section), key, None)


def cmd_plot(args) -> int:
    from ray_jax_train.plot import is_search_dir, plot_run, plot_search

    if not 0 <= args.smoothing < 1:
        raise UsageError(f"--smoothing {args.smoothing}: must be in [0, 1)")
    try:
        if is_search_dir(args.run_dir):  # a Tune search: its trials' losses together
            path = plot_search(args.run_dir, args.output, smoothing=args.smoothing)
        else:
            path = plot_run(args.run_dir, args.output, smoothing=args.smoothing)
    except ValueError as exc:  # e.g. a run with no records yet: a message, not a traceback and "training failed"
        raise UsageError(str(exc)) from None
    print(path)
    return EXIT_OK


def cmd_generate(args) -> int:
    from ray_jax_train.models import from_pretrained, generate_text, generation_eos_ids
    from ray_jax_train.text import load_tokenizer

    model_dir, args.tokenizer = _local_dir(args.model_dir), args.tokenizer and _local_dir(args.tokenizer)
    if os.path.isfile(os.path.join(model_dir, "best.json")):  # a Tune search: its best trial's run
        with open(os.path.join(model_dir, "best.json")) as f:
            best = json.load(f)
        model_dir = best.get("run_dir") or model_dir
        print(f"[ray-jax-train] {args.model_dir} is a Tune search: generating with its best trial, {model_dir}",
              file=sys.stderr)
        _warn_if_trained_on(args.model_dir, best)
    if os.path.isfile(os.path.join(model_dir, "final_model", "config.json")):
        model_dir = os.path.join(model_dir, "final_model")
    if not os.path.exists(model_dir):
        raise UsageError(f"{model_dir} does not exist: give a run directory (<storage_path>/<run name>), its "
                         "final_model/, or a Hugging Face model directory")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UsageError(f"{args.model_dir}: neither a model directory (config.json and *.safetensors) nor a run "
                         "directory with a final_model/ (a run writes it when training ends; `ray-jax-train export` "
                         "makes one from a checkpoint)")
    tokenizer_dir = args.tokenizer or model_dir
    if args.tokenizer and not os.path.isdir(tokenizer_dir):
        raise UsageError(f"--tokenizer {tokenizer_dir}: no such directory; give the directory that holds the "
                         "tokenizer's files (tokenizer.json, tokenizer_config.json)")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer_config.json")):
        raise UsageError(f"{tokenizer_dir} holds no tokenizer (tokenizer_config.json)" + (
            "; give --tokenizer the directory with the tokenizer's files" if args.tokenizer else
            " (a run saves one beside its final model only when it trained with one); pass --tokenizer DIR"))
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        text = generate_text(from_pretrained(model_dir), load_tokenizer(tokenizer_dir), prompt,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed, eos_token_id=generation_eos_ids(model_dir))
    except ValueError as exc:  # a bad checkpoint, prompt or sampling setting: a message, not a traceback
        raise UsageError(str(exc)) from None
    print(text)
    return EXIT_OK


def _file_uri_path(path: str) -> str:
    """The local path a file:// URI names (percent-escapes decoded); any other path as it is."""
    if not path.startswith("file://"):
        return path
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(path).path)


def _local_dir(path: str) -> str:
    """A file:// URI as the local path it names (the run summary prints them for file:// storage); other URIs are
    refused: generate reads the weights on this machine."""
    from ray_jax_train.storage import is_uri

    path = _file_uri_path(path)
    if is_uri(path):
        raise UsageError(f"{path}: generate reads a directory on this machine; copy it here first (e.g. "
                         "`ray-jax-train export` of a checkpoint at a URI writes a local directory)")
    return path


def _warn_if_trained_on(search_dir: str, best: dict) -> None:
    """The best trial's final_model/ is what `generate` uses, its recorded checkpoint what `export` uses: the same
    model, until the trial's run is trained on after the search (fit under its name). Said when they differ."""
    from ray_jax_train.lm.export import _resolve

    if not best.get("checkpoint") or not best.get("run_dir"):
        return
    try:
        latest, _ = _resolve(best["run_dir"])
    except Exception:  # noqa: BLE001 - no run directory left to compare with: nothing to say
        return
    if os.path.basename(latest.rstrip("/")) != os.path.basename(best["checkpoint"].rstrip("/")):
        print(f"ray-jax-train: warning: the best trial's run was trained on after the search: its final_model/ comes "
              f"after {os.path.basename(latest.rstrip('/'))}, the search's best is {best['checkpoint']}. To generate "
              f"with the search's best, export it (`ray-jax-train export {shlex.quote(search_dir)} DIR`) and pass DIR.",
              file=sys.stderr)


def cmd_export(args) -> int:
    from ray_jax_train.checkpoint import CheckpointCorruptError
    from ray_jax_train.lm.export import OutputDirNotEmpty, export_checkpoint

    try:
        out = export_checkpoint(args.source, args.out_dir, model_config=args.model_config, tokenizer=args.tokenizer,
                                dtype=args.dtype, overwrite=args.overwrite)
    except OutputDirNotEmpty as exc:
        raise UsageError(str(OutputDirNotEmpty(exc.out_dir, fix="pass --overwrite"))) from None
    except (ValueError, FileExistsError) as exc:  # another model's checkpoint, a bad dtype: a message
        raise UsageError(str(exc)) from None
    except CheckpointCorruptError as exc:
        print(f"ray-jax-train: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(out)
    return EXIT_OK


def cmd_config(args) -> int:
    from ray_jax_train.run_config import check_data_columns, dump, load_config

    config = load_config(args.config, args.overrides)
    if args.config_command == "show":
        sys.stdout.write(dump(config))
    else:
        check_data_columns(config)
        # What fit and tune refuse before Ray starts, so "valid" means they will not (a CLI review); nothing written.
        _check_storage_usable(config.with_absolute_paths().run.storage_path, make=False)
        _refuse_starting_over_beside_checkpoints(config)
        print(f"{args.config}: valid")
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for usage errors
        return int(exc.code or 0)
    args.verbose = bool(getattr(args, "verbose", False))
    for name in ("config", "run_dir", "output", "model_dir", "tokenizer", "source", "out_dir", "model_config"):
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):  # quoted, the shell left it (config keys expand it too)
            setattr(args, name, os.path.expanduser(value))
    _quiet(args.verbose)
    from ray_jax_train.run_config import ConfigError

    handlers = {"fit": cmd_fit, "tune": cmd_tune, "plot": cmd_plot, "generate": cmd_generate, "export": cmd_export,
                "config": cmd_config}
    try:
        return handlers[args.command](args)
    except (ConfigError, UsageError) as exc:
        print(f"ray-jax-train: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except FileNotFoundError as exc:
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(f"ray-jax-train: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("ray-jax-train: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run_main()
