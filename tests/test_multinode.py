"""Ray-native deployment, end to end: `ray job submit` of the CLI to a real 2-node `ray start` cluster.

One test covers both: the job (working directory = a config only) trains across 2 Ray nodes, one worker per
node, with checkpoints in one shared storage path. The cluster is this test's own: its own ports and temp dir,
started with `ray start --block` so a SIGTERM to those two processes stops exactly it (never `ray stop`, which
would stop every Ray on the machine). It does not touch the session's `ray_cluster` fixture.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp", reason="`ray job submit` needs the dashboard's job server: pip install 'ray[default]'")

BIN = os.path.dirname(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait(predicate, timeout, what, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: a `ray start` process exited with {proc.returncode}")
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(1)
    raise TimeoutError(f"{what}: not ready after {timeout}s")


def _stop(proc, timeout=60):
    """SIGTERM to our `ray start --block`: it stops the processes of its node, then exits (else they are killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own process group (start_new_session=True)
            proc.wait(10)


@pytest.fixture
def two_node_cluster():
    # Short temp dir: Ray's unix socket paths must stay under ~107 characters.
    temp = tempfile.mkdtemp(prefix="rjt-", dir="/tmp")
    (gcs, dashboard, client, agent_http, agent_grpc, runtime_env, metrics,
     agent_http2, agent_grpc2, runtime_env2, metrics2, nm1, nm2, om1, om2) = _free_ports(15)
    url = f"http://127.0.0.1:{dashboard}"
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), RAY_USAGE_STATS_ENABLED="0",
               # Other Ray instances may run on this machine: name ours wherever Ray would otherwise guess (without
               # it, the head takes 30 s to stop). The jobs are given none, below, as on a user's cluster.
               RAY_API_SERVER_ADDRESS=url,
               # A loopback-only throwaway cluster: no token to hand to the job client and state API.
               RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0",
              '--resources={"rjt_slot": 1}', "--disable-usage-stats"]
    head_cmd = [os.path.join(BIN, "ray"), "start", "--head", f"--port={gcs}", f"--dashboard-port={dashboard}",
                "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--ray-client-server-port={client}",
                f"--temp-dir={temp}", f"--node-manager-port={nm1}", f"--object-manager-port={om1}",
                f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
                f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}", *common]
    # Each node its own temp dir, as on separate machines: a shared one would let one node's runtime-env agent
    # garbage-collect the job's working directory that the other node unpacked there.
    worker_cmd = [os.path.join(BIN, "ray"), "start", f"--address=127.0.0.1:{gcs}", f"--temp-dir={temp}/w",
                  f"--node-manager-port={nm2}", f"--object-manager-port={om2}",
                  f"--dashboard-agent-listen-port={agent_http2}", f"--dashboard-agent-grpc-port={agent_grpc2}",
                  f"--runtime-env-agent-port={runtime_env2}", f"--metrics-export-port={metrics2}", *common]
    logs = [open(os.path.join(temp, name), "w") for name in ("head.log", "worker.log")]
    procs = []
    try:
        procs.append(subprocess.Popen(head_cmd, env=env, stdout=logs[0], stderr=subprocess.STDOUT,
                                      start_new_session=True))
        _wait(lambda: urllib.request.urlopen(f"{url}/api/version", timeout=5).status == 200, 180, "head dashboard",
              procs)
        procs.append(subprocess.Popen(worker_cmd, env=env, stdout=logs[1], stderr=subprocess.STDOUT,
                                      start_new_session=True))
        from ray.util.state import list_nodes

        _wait(lambda: len([n for n in list_nodes(address=url) if n.state == "ALIVE"]) == 2, 180, "second node",
              procs)
        yield {"url": url, "env": env, "temp": temp}
    finally:
        for proc in reversed(procs):
            # The head's `ray start` waits ~30 s for something at its stop (10 s of every run went there); a
            # throwaway cluster need not: its process group is killed after 3 s.
            _stop(proc, timeout=3)
        for log in logs:
            log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_job_submit_trains_across_two_nodes(ray_cluster, two_node_cluster, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    url, env = two_node_cluster["url"], two_node_cluster["env"]
    # The job's working directory holds the example config and nothing else: the job depends only on it and
    # on the installed package (the tokenizer is trained inside the job, the corpus is the stdlib).
    workdir = tmp_path / "job"
    (workdir / "examples").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "examples", "tiny_llama.yaml"), workdir / "examples")
    storage = tmp_path / "shared-runs"  # one path both nodes see (same machine here; NFS/S3 on a real cluster)
    entrypoint = [
        "ray-jax-train", "fit", "examples/tiny_llama.yaml", "--set", "run.name=two-nodes",
        "--set", f"run.storage_path={storage}", "--set", "scaling.num_workers=2",
        "--set", "scaling.resources_per_worker={rjt_slot: 1}", "--set", "training.total_steps=4",
        "--set", "training.save_steps=2", "--set", "training.eval_steps=4", "--set", "data.max_docs=30",
        "--set", "run.tensorboard=true",
    ]
    # The job sees no dashboard address (the cluster's processes have one): with another Ray instance on the machine
    # (the session's), Train's placement-group cleaner must be told it by the trainer, as on a user's machine (an ops
    # review: it crashed in every job, and leaked the placement group of a run that ended badly).
    no_address = json.dumps({"env_vars": {"RAY_API_SERVER_ADDRESS": ""}})
    submitted = subprocess.run(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", url, "--working-dir", str(workdir),
         "--runtime-env-json", no_address, "--submission-id", "rjt-two-nodes", "--no-wait", "--", *entrypoint],
        env=env, capture_output=True, text=True, timeout=180)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    client = JobSubmissionClient(url)
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    _wait(lambda: client.get_job_status("rjt-two-nodes") in terminal, 540, "job")
    logs = client.get_job_logs("rjt-two-nodes")
    assert client.get_job_status("rjt-two-nodes") == JobStatus.SUCCEEDED, logs[-4000:]

    run_dir = storage / "two-nodes"
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint_*") if p.is_dir())
    assert checkpoints and not any(name.endswith("-tmp") for name in checkpoints), os.listdir(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step" in r]  # not the attempt's start line
    assert records[-1]["step"] == 4 and "loss" in records[-1]
    assert (run_dir / "final_model").is_dir()
    # TensorBoard has each logged point once: the checkpoint reports (steps 2 and 4) re-send the latest metrics.
    scalars = _tensorboard_scalars(run_dir / "tensorboard")
    assert [step for step, _ in scalars["loss"]] == [2, 4], scalars["loss"]
    assert [value for _, value in scalars["loss"]] == pytest.approx([r["loss"] for r in records])
    assert [step for step, _ in scalars["eval_loss"]] == [4]
    # The summary tells the user where the checkpoints are and how to resume.
    assert "=== ray-jax-train: done ===" in logs and str(run_dir) in logs and "--set run.name=two-nodes" in logs
    # A job's log is no terminal: progress is a line per log step, not redrawn bars, and start-up lines that ask
    # nothing of the user (JAX's coordinator address, gloo's peer count) are left out of it.
    assert "[train] step 2/4, loss " in logs and "\r" not in logs, logs[-4000:]
    assert "JAX distributed service" not in logs and "[Gloo]" not in logs, logs[-4000:]
    assert "multiple active Ray instances" not in logs, logs[-4000:]

    # One training worker on each node.
    workers = list_actors(address=url, filters=[("class_name", "=", "RayTrainWorker")], detail=True)
    assert len({w.node_id for w in workers}) == 2, [(w.node_id, w.state) for w in workers]
    # A cluster from `ray start` may have its nodes drained (an autoscaler, a cloud's preemption): Train's
    # preemption watcher, which passes the notice on to the workers, ran beside them (a local Ray leaves it out).
    assert list_actors(address=url, filters=[("class_name", "=", "PreemptionWatcher")]), "no preemption watcher"

    # A plain training script (no CLI), written for one machine, runs unchanged as a job: it joins the job's cluster
    # instead of asking for a local Ray of its own size, which Ray refuses once RAY_ADDRESS names a cluster.
    shutil.copy(os.path.join(REPO, "examples", "mlp_data_parallel.py"), workdir)
    # A relative storage path lands in the job's copy of its working directory, which only the head has: refused
    # before the driver writes anything (the workers found it about 30 s in). Runs beside the next job.
    local = [a if not a.startswith("run.storage_path=") else "run.storage_path=runs" for a in entrypoint]
    subprocess.run(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", url, "--working-dir", str(workdir),
         "--submission-id", "rjt-job-copy", "--no-wait", "--", *local],
        env=env, capture_output=True, text=True, timeout=180, check=True)
    subprocess.run(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", url, "--working-dir", str(workdir),
         "--submission-id", "rjt-script", "--no-wait", "--", "python", "mlp_data_parallel.py", "--steps", "10",
         "--rows", "512", "--storage-path", str(tmp_path / "script-runs")],
        env=env, capture_output=True, text=True, timeout=180, check=True)
    _wait(lambda: client.get_job_status("rjt-script") in terminal, 300, "script job")
    logs = client.get_job_logs("rjt-script")
    assert client.get_job_status("rjt-script") == JobStatus.SUCCEEDED, logs[-4000:]
    assert "done: 2 workers, 10 steps" in logs
    _wait(lambda: client.get_job_status("rjt-job-copy") in terminal, 120, "job with storage in its working dir")
    logs = client.get_job_logs("rjt-job-copy")
    assert client.get_job_status("rjt-job-copy") == JobStatus.FAILED, logs[-4000:]
    assert "inside this job's copy of its --working-dir, which this node alone has; the cluster has 2 nodes" in logs
    assert "[ray-jax-train] run two-nodes:" not in logs, logs[-4000:]  # refused before the run was built

    # And the curves of that run plot from its directory.
    from ray_jax_train.cli import main

    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "curves.png").stat().st_size > 10_000


def _tensorboard_scalars(logdir):
    """{tag: [(step, value), ...]} from the event files in `logdir` (TFRecord framing, tensorboardX's protos)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4  # length, its crc, the record, its crc
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_draws_a_checkpoint_report_only_where_it_brings_new_values(tmp_path):
    """The built-in loop's checkpoint reports re-send its logged metrics (not drawn twice, above). A loop of your
    own that reports its metrics with its saves, as `save(..., metrics=...)` advises, lost every save step's point
    (an API review)."""
    import pickle

    from ray_jax_train.plot import TensorBoardCallback

    callback = pickle.loads(pickle.dumps(TensorBoardCallback(str(tmp_path / "tb"))))  # as Ray ships it
    callback.after_report(None, [{"step": 2, "loss": 3.0, "eval_loss": 3.5}], None)
    callback.after_report(None, [{"step": 4, "loss": 3.0, "eval_loss": 3.5}], object())  # a re-send: not drawn
    callback.after_report(None, [{"step": 6, "loss": 2.5, "eval_loss": 3.5}], object())  # a loop's own save report
    callback.after_report(None, [{"step": 8, "loss": float("nan")}], None)
    scalars = _tensorboard_scalars(tmp_path / "tb")
    assert scalars["loss"] == [(2, 3.0), (6, 2.5)] and scalars["eval_loss"] == [(2, 3.5), (6, 3.5)], scalars
