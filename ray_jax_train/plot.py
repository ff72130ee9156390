"""Training curves from a run directory's `metrics.jsonl`, and an optional live TensorBoard writer.

`plot_run` draws one panel per metric (loss with eval loss, learning rate, tokens/s), raw points faint and an
exponential moving average on top, so a noisy tiny run still shows its trend, and marks where the run resumed.
`plot_search` draws a Tune search's trials on shared axes.
Matplotlib's Agg backend: no display needed (clusters, CI).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Iterator, List, Optional, Sequence

from ray.train.v2.api.callback import UserCallback

__all__ = ["PANELS", "MetricsFileCallback", "TensorBoardCallback", "draw_curves", "is_search_dir", "plot_run",
           "plot_search", "read_records", "search_trials", "smooth"]

# (metric keys drawn together, panel title, y label, log scale)
PANELS = (
    (("loss", "eval_loss"), "Loss", "cross-entropy (nats/token)", False),
    (("learning_rate",), "Learning rate", "learning rate", False),
    (("tokens_per_s",), "Throughput", "tokens / s (all workers)", False),
)
_MIN_SMOOTHED = 20  # fewer points than this are drawn as they are
_LABELS = {"loss": "train loss", "eval_loss": "eval loss", "learning_rate": "learning rate",
           "tokens_per_s": "tokens/s"}


def read_records(run_dir: str) -> List[Dict]:
    """The loop's records; a run directory or a metrics.jsonl path. FileNotFoundError if there is none."""
    return parse_records(_read_metrics_text(run_dir))


def _read_metrics_text(run_dir: str) -> str:
    from ray_jax_train.storage import join, read_text

    path = run_dir if run_dir.endswith(".jsonl") else join(run_dir, "metrics.jsonl")
    try:
        text = read_text(path)  # a local path or the run's storage URI (gs://, s3://)
    except FileNotFoundError:
        import glob
        import os

        runs = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(glob.escape(run_dir), "*", "metrics.jsonl")))
        inside = f"; the runs in it: {', '.join(runs[:10])}{' ...' if len(runs) > 10 else ''}" if runs else ""
        raise FileNotFoundError(f"{path} does not exist: RUN_DIR must be a training run directory "
                                f"(<storage_path>/<run name>, printed at the end of `ray-jax-train fit`){inside}. "
                                "A JaxTrainer run of your own loop writes metrics.jsonl with "
                                "RunConfig(callbacks=[rjt.plot.MetricsFileCallback()])") from None
    return text


def _json_records(text: str) -> Iterator[Dict]:
    """Every line of a metrics.jsonl's text that is a JSON object, in file order (all attempts)."""
    for line in text.splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if isinstance(record, dict):
            yield record


def _step_records(text: str) -> Iterator[Dict]:
    """Every step record of a metrics.jsonl's text, in file order (all attempts)."""
    # Not others (attempt lines, hand-written or foreign ones): nothing to draw them at.
    return (record for record in _json_records(text) if isinstance(record.get("step"), (int, float)))


def resumed_steps(text: str) -> List[int]:
    """The step each later attempt of a run resumed from (an attempt after the first resumed from a checkpoint: the
    group failed and Ray restarted it, or the same run was started again). The built-in loop marks each attempt's
    start with an `{"attempt": {"start_step": ...}}` line once it has restored, so attempts that died before their
    first log step count too; files without those lines have each attempt's first step record carry its start-up
    facts (`startup_s`, and `start_step` once it existed, else the first step logged after the resume)."""
    starts: List[int] = []
    marked = False  # an attempt line was read and its first step record is still to come
    for record in _json_records(text):
        attempt = record.get("attempt")
        if isinstance(attempt, dict) and isinstance(attempt.get("start_step"), (int, float)):
            starts.append(int(attempt["start_step"]))
            marked = True
        elif isinstance(record.get("step"), (int, float)) and "startup_s" in record:
            if not marked:  # written by a loop that did not mark its attempts
                starts.append(int(record.get("start_step", record["step"])))
            marked = False
    return starts[1:]


def attempt_line(start_step: int) -> str:
    """The line the built-in loop appends to metrics.jsonl as an attempt starts (read by `resumed_steps`); it has no
    "step", so curves and `read_metrics` skip it."""
    return json.dumps({"attempt": {"start_step": int(start_step), "time": round(time.time(), 3)}})


def parse_records(text: str) -> List[Dict]:
    """The step records of a metrics.jsonl's text, the latest attempt's record of each step."""
    records: List[Dict] = []
    for record in _step_records(text):
        # A resumed attempt logs again from its checkpoint's step on: what the killed attempt logged from there
        # is replaced, also the steps past where the new attempt has got to so far (a live or twice-killed run).
        while records and records[-1]["step"] >= record["step"]:
            records.pop()
        records.append(record)
    return records


def smooth(values: Sequence[float], weight: float) -> List[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): the first points are not pulled to 0."""
    out, avg, norm = [], 0.0, 0.0
    for value in values:
        avg = weight * avg + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(avg / norm if norm else value)
    return out


def _image_path(output: Optional[str], default: str) -> str:
    """The file savefig will write: it adds ".png" to a name without a suffix (so "-o adir" on a directory wrote
    adir.png beside it, and the path printed was not the file's; a CLI review). A directory gets the default's
    name in it; a suffix matplotlib cannot write is refused before drawing is wasted on it."""
    from ray_jax_train.storage import is_uri

    if not output:
        return default
    if not is_uri(output) and os.path.isdir(output):
        return os.path.join(output, os.path.basename(default))
    suffix = os.path.splitext(output.rstrip("/").rsplit("/", 1)[-1])[1].lstrip(".").lower()
    if not suffix:
        return output + ".png"
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(f"{output}: matplotlib cannot write .{suffix} images; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (or no suffix: .png)")
    return output


def plot_run(run_dir: str, output: Optional[str] = None, smoothing: float = 0.6, title: Optional[str] = None) -> str:
    """Write a PNG of the run's curves (default `<run_dir>/curves.png`) and return its path."""
    from ray_jax_train.storage import is_uri, join

    run_dir = run_dir if is_uri(run_dir) else os.path.expanduser(run_dir)
    output = output if output is None or is_uri(output) else os.path.expanduser(output)
    text = _read_metrics_text(run_dir)
    fig = draw_curves(parse_records(text), resumed_steps(text), smoothing,
                      title or os.path.basename(os.path.normpath(run_dir)), where=run_dir)
    head, slash, _ = run_dir.rpartition("/")
    base = run_dir if not run_dir.endswith(".jsonl") else (head or slash or ".")  # "/m.jsonl" is in "/"
    output = _image_path(output, join(base, "curves.png"))
    if is_uri(output):  # a run in a bucket: drawn locally, then copied beside its metrics (savefig wrote "gs:/...")
        from ray_jax_train.storage import local_dir_for

        folder, name = output.rstrip("/").rsplit("/", 1)
        with local_dir_for(folder) as local:
            fig.savefig(os.path.join(local, name), dpi=110)
    else:
        fig.savefig(output, dpi=110)
    import matplotlib.pyplot as plt  # after draw_curves chose the Agg backend

    plt.close(fig)
    return output


def is_search_dir(path: str) -> bool:
    """A Tune search's directory (`<storage>/<search name>`): it holds `search_config.json` or `best.json`."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("search_config.json", "best.json"))


def search_trials(search_dir: str) -> List[Dict]:
    """[{"trial_id", "label", "run_dir", "best"}] of a local search directory, in trial order.

    Tune keeps a trial's state in `<search>/trial_<id>_<n>_<searched values>_<date>/`, its Train run (our
    metrics.jsonl) is `<search>-<id>` beside the search directory: the label comes from the one, the curve from the
    other.
    """
    import re

    search_dir = os.path.abspath(search_dir)  # best.json holds an absolute path
    best_run = None
    try:
        with open(os.path.join(search_dir, "best.json")) as f:
            best_run = os.path.abspath(json.load(f).get("run_dir") or "")
    except (OSError, ValueError, AttributeError):
        pass
    trials = []
    for name in sorted(os.listdir(search_dir)):
        match = re.match(r"trial_([0-9a-f]+_\d+)_(\d+)_(.*?)(?:_\d{4}-\d{2}-\d{2}_[\d-]+)?$", name)
        if not match or not os.path.isdir(os.path.join(search_dir, name)):
            continue
        trial_id, number, values = match.groups()
        run_dir = f"{search_dir}-{trial_id}"
        values = _searched_values(os.path.join(search_dir, name)) or values
        trials.append({"trial_id": trial_id, "number": int(number), "label": values or trial_id,
                       "run_dir": run_dir, "best": run_dir == best_run})
    return sorted(trials, key=lambda t: t["number"])


def _searched_values(trial_dir: str) -> str:
    """"learning_rate=1e-05" from the trial's params.json: its directory's name rounds values to 4 decimals, so
    1e-05 and 1e-06 both read learning_rate=0.0000 there. "" where the file is missing or unreadable."""
    try:
        with open(os.path.join(trial_dir, "params.json")) as f:
            params = json.load(f)
    except (OSError, ValueError):
        return ""

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    if not isinstance(params, dict):
        return ""
    # The section (training., model.) dropped as the CLI's summary does: the key alone names the value.
    return ", ".join(f"{key.split('.', 1)[-1]}={value:.4g}" if isinstance(value, float) else
                     f"{key.split('.', 1)[-1]}={value}" for key, value in flat(params))


def plot_search(search_dir: str, output: Optional[str] = None, smoothing: float = 0.6) -> str:
    """Write a PNG of every trial's loss on shared axes (default `<search_dir>/trials.png`) and return its path:
    the one picture a search is run for. Local directories only (Tune's trial names are listed from disk)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t for t in search_trials(search_dir) if os.path.isfile(os.path.join(t["run_dir"], "metrics.jsonl"))]
    # Not the trials that have logged no step yet (their file holds only the line each attempt starts with).
    runs = [(t, records) for t in trials for records in [read_records(t["run_dir"])] if records]
    if not runs:
        raise ValueError(f"{search_dir}: a Tune search directory, but no trial has logged a step to metrics.jsonl yet "
                         f"(each trial's run is {os.path.normpath(search_dir)}-<trial id>)")
    with_eval = any("eval_loss" in r for _, records in runs for r in records)
    keys = ("loss", "eval_loss") if with_eval else ("loss",)
    fig, axes = plt.subplots(1, len(keys), figsize=(6.4 * len(keys), 4.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        smoothed = False
        for i, (trial, records) in enumerate(runs):
            points = [(r["step"], r[key]) for r in records if key in r and _finite(r[key])]
            if not points:
                continue
            steps, values = zip(*points)
            if key == "loss" and len(points) >= _MIN_SMOOTHED and smoothing:
                values, smoothed = smooth(values, smoothing), True
            label = trial["label"] + ("  (best)" if trial["best"] else "")
            ax.plot(steps, values, "-" if len(points) >= 60 else "o-", color=f"C{i % 10}", markersize=3,
                    linewidth=2.6 if trial["best"] else 1.3, label=label)
        ax.set_title(_LABELS[key] + (f" (EMA {smoothing:g})" if smoothed else ""))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=7)
    fig.suptitle(f"{os.path.basename(os.path.normpath(search_dir))}: {len(runs)} trials", fontsize=11)
    fig.tight_layout()
    output = _image_path(output, os.path.join(search_dir, "trials.png"))
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def draw_curves(records: List[Dict], resumed: Sequence[int] = (), smoothing: float = 0.6, title: str = "",
                where: str = "the run"):
    """The curves' matplotlib figure: a panel per metric, with a dotted line at the first step each later attempt
    of the run logged (a restart after a failure, or the run started again), so a jump in the loss or tokens/s
    there reads as a resume, not as training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if any(k in r for r in records for k in p[0])]
    if not panels:
        raise ValueError(f"{where}: metrics.jsonl has no loss, learning_rate or tokens_per_s records yet")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    colors = {"loss": "tab:blue", "eval_loss": "tab:orange", "learning_rate": "tab:green",
              "tokens_per_s": "tab:purple"}
    for ax, (keys, panel_title, ylabel, log) in zip(axes[0], panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r and _finite(r[key])]
            if not points:
                continue
            steps, values = zip(*points)
            color = colors.get(key)
            # The schedule is exact (nothing to smooth), eval points are few, and an EMA over a short run only lags.
            if key in ("eval_loss", "learning_rate") or len(points) < _MIN_SMOOTHED or smoothing == 0:
                ax.plot(steps, values, "o-" if len(points) < 60 else "-", color=color, label=_LABELS.get(key, key),
                        markersize=3.5)
                continue
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, smooth(values, smoothing), color=color, linewidth=2,
                    label=f"{_LABELS.get(key, key)} (EMA {smoothing:g})")
        for i, step in enumerate(resumed):
            ax.axvline(step, color="gray", linestyle=":", linewidth=1, label="resumed" if i == 0 else None)
        ax.set_title(panel_title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class MetricsFileCallback(UserCallback):
    """Writes rank 0's metrics of every report, as lines of JSON, to the run's `metrics.jsonl`
    (`<storage_path>/<name>/`, from `RunConfig`), the file the built-in loop writes itself: then `ray-jax-train plot`
    and `rjt.lm.read_metrics` work for a loop of your own. Ray V2's
    `Result.metrics_dataframe` keeps only the reports that came with a checkpoint.

        RunConfig(name="mine", storage_path="/shared/runs", callbacks=[rjt.plot.MetricsFileCallback()])

    Reports with a checkpoint are written too (a loop may report only then). Give each record a "step" for the
    curves; a resumed attempt's records of a step replace the earlier ones when read. Not for the built-in loop,
    which writes the file already (its records would be there twice)."""

    def __init__(self):
        self._file = None

    def after_report(self, run_context, metrics, checkpoint):
        if not metrics or not metrics[0]:
            return
        if self._file is None:
            from ray_jax_train.storage import AppendOnlyFile, filesystem, join

            config = run_context.get_run_config()
            run_dir = join(str(config.storage_path), config.name)
            if config.storage_filesystem is not None:
                fs, path = config.storage_filesystem, run_dir
            else:
                fs, path = filesystem(run_dir)
            # Written through on object stores too (no later hook would flush what is held back); the file is small.
            self._file = AppendOnlyFile(fs, f"{path.rstrip('/')}/metrics.jsonl", flush_every_s=0.0)
        self._file.append(json.dumps(metrics[0], default=_plain))

    def __getstate__(self):
        return {"_file": None}


def _plain(value):
    """numpy and jax scalars in a report's metrics, as JSON numbers."""
    try:
        return value.item()
    except AttributeError:
        return str(value)


class TensorBoardCallback(UserCallback):
    """Writes the metrics of every report to TensorBoard event files as they arrive (on the Train controller); a
    report with a checkpoint only where it brings new values (the built-in loop's re-send its logged ones).

    Opt-in (`run.tensorboard: true`): metrics.jsonl is always written, TensorBoard only when asked for.
    """

    def __init__(self, logdir: str):
        self.logdir, self._writer = logdir, None
        self._latest: dict = {}  # each tag's latest value written

    def after_report(self, run_context, metrics, checkpoint):
        if not metrics:
            return
        record = metrics[0]
        values = {key: float(value) for key, value in record.items()
                  if key not in ("step", "epoch") and _finite(value)}
        # The built-in loop's checkpoint reports re-send its latest logged metrics (checkpoint scoring needs them
        # there); drawn again, every curve got a second, stale point at each save step. A report with a checkpoint
        # is drawn only where it brings a value not drawn already: a loop of your own that reports its metrics
        # with its saves, as `save(..., metrics=...)` advises, lost every save step's point.
        if checkpoint is not None and all(self._latest.get(key) == value for key, value in values.items()):
            return
        self._latest.update(values)
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        if self._writer is None:
            # Written here, not through SummaryWriter's queue: its thread wrote events after flush() returned, and
            # the controller's exit at the end of a run lost the last report's.
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.record_writer import directory_check

            directory_check(self.logdir)
            self._writer = EventsWriter(os.path.join(self.logdir, "events"))
        summary = Summary(value=[Summary.Value(tag=key, simple_value=value) for key, value in values.items()])
        self._writer.write_event(Event(wall_time=time.time(), step=int(record.get("step", 0)), summary=summary))
        self._writer.flush()

    def __getstate__(self):
        return {"logdir": self.logdir, "_writer": None, "_latest": {}}
