"""Checkpoints in S3-compatible object storage (MinIO, R2, Ceph, AWS itself) through Ray Train's
`storage_path="s3://bucket/runs?endpoint_override=..."`, end to end.

The server is moto's S3 server: a real S3-protocol HTTP server listening on localhost, in this process (not a
mock of our code nor of any client library). Ray's controller and workers reach it over HTTP through pyarrow,
and orbax/tensorstore write and read the checkpoints' bytes there themselves.
"""
import json
import os
import re

import numpy as np
import pyarrow.fs as pafs
import pytest
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

import ray_jax_train as rjt
from ray_jax_train.checkpoint import FAULTS_ENV

from test_checkpoint import _assert_bitwise_equal, _leaves, checkpoint_loop, example
from test_export import run  # noqa: F401  (a fixture: a finished 2-worker LM run with checkpoints)

# Dummy credentials, signed like real ones. Set when this module is collected, before the session's Ray cluster
# starts, so Ray's controller and workers (which inherit the environment) have them as well.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

BUCKET = "rjt-checkpoints"


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket_maker = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                                     allow_bucket_creation=True)
    bucket_maker.create_dir(BUCKET)
    yield endpoint
    server.stop()


def _objects(endpoint, prefix):
    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1")
    infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
    return sorted(i.path[len(BUCKET) + len(prefix) + 2:] for i in infos if i.type == pafs.FileType.File)


def test_checkpoints_in_s3_compatible_storage_resume_exactly(ray_cluster, s3_endpoint, tmp_path):
    """Two workers save to the S3 server; rank 1 is killed after the step-5 save is registered, the restarted
    group restores step 5 from the bucket (checksums verified against the saved state) and saves step 10, and
    Ray's retention deletes step 5. The first start removed a checkpoint directory Ray never registered. The
    driver then reads the step-10 checkpoint back from the bucket: bitwise the state the workers held."""
    out = tmp_path / "out"
    out.mkdir()
    storage_path = f"s3://{BUCKET}/runs?endpoint_override={s3_endpoint}&region=us-east-1"
    fs, run_dir = pafs.FileSystem.from_uri(storage_path.replace("/runs?", "/runs/s3run?"))
    with fs.open_output_stream(f"{run_dir}/checkpoint_000000003_0badf00d/state/_METADATA") as f:
        f.write(b"{}")  # what a worker that died mid-save leaves
    trainer = rjt.JaxTrainer(
        checkpoint_loop,
        train_loop_config={"out": str(out), "steps": 10, "save_every": 5, "settle_at": [7]},
        scaling_config=ScalingConfig(num_workers=2),
        jax_config=rjt.JaxConfig(env_vars={FAULTS_ENV: "sigkill@7:1"}, shutdown_timeout_s=5),
        run_config=RunConfig(name="s3run", storage_path=storage_path, failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=1)),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    restores = [json.loads(line) for line in (out / "restores.jsonl").read_text().splitlines()]
    assert [r["step"] for r in restores] == [0, 5], restores
    assert restores[1]["path"].startswith(f"s3://{BUCKET}/runs/s3run/checkpoint_000000005_"), restores

    objects = _objects(s3_endpoint, "runs/s3run")
    names = sorted({o.split("/")[0] for o in objects if re.match(r"checkpoint_\d{9}_[0-9a-f]{8}/", o)})
    assert [n.split("_")[1] for n in names] == ["000000010"], names  # step 5 deleted by Ray, step 3 by us
    for name in names:
        for required in ("_CHECKPOINT_METADATA", "commit_success.txt", "checksums.json", "meta/metadata",
                         "state/_METADATA"):
            assert f"{name}/{required}" in objects, (required, objects)
        assert any(o.startswith(f"{name}/state/") and "/d/" in o for o in objects), objects  # array bytes
    assert not [o for o in objects if "orbax-checkpoint-tmp" in o]

    assert result.checkpoint.path.endswith(names[-1])
    import jax
    import jax.numpy as jnp

    params = example.init_params(0, hidden=16)
    target = rjt.checkpoint.abstract_state(jax.tree.map(jnp.asarray, {
        "params": params, "opt_state": example.make_optimizer(3e-3).init(params),
        "rng": np.asarray(jax.random.PRNGKey(7))}))
    restored = rjt.checkpoint.restore(target, result.checkpoint, fallback=False)
    assert restored.step == 10
    np.savez(tmp_path / "driver.npz", *[np.asarray(x) for x in jax.tree.leaves(restored.state)])
    _assert_bitwise_equal(out / "final.npz", tmp_path / "driver.npz")
    assert len(_leaves(out / "final.npz")) == len(jax.tree.leaves(target))


def test_a_checkpoint_in_s3_exports_through_its_endpoint_uri(s3_endpoint, run, tmp_path):
    """`export_checkpoint` on a checkpoint URI that carries its endpoint (`?endpoint_override=...`): the run
    directory and its model/ files were found by cutting the path inside the query, which named host "model"."""
    from test_export import _checkpoints, _params

    run_dir, _ = run
    latest = _checkpoints(run_dir)[-1]
    query = f"?endpoint_override={s3_endpoint}&region=us-east-1"
    bucket = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", region="us-east-1")
    for part in (os.path.basename(latest), "model"):
        pafs.copy_files(os.path.join(run_dir, part), f"{BUCKET}/exported-run/{part}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=bucket)
    out = rjt.export_checkpoint(f"s3://{BUCKET}/exported-run/{os.path.basename(latest)}{query}", tmp_path / "out")
    final = _params(os.path.join(run_dir, "final_model"))
    exported = _params(out)
    assert exported.keys() == final.keys() and all(np.array_equal(exported[k], final[k]) for k in final)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    # On S3 a save writes under its final name: without the commit file, written last, it is unfinished.
    bucket.delete_file(f"{BUCKET}/exported-run/{os.path.basename(latest)}/commit_success.txt")
    with pytest.raises(Exception, match=r"commit_success.txt is missing \(an unfinished or damaged save\)"):
        rjt.export_checkpoint(f"s3://{BUCKET}/exported-run/{os.path.basename(latest)}{query}", tmp_path / "out2")


def test_starting_weights_at_a_uri_are_looked_up_on_the_driver(s3_endpoint):
    """`model.init_from` / `checkpoint_path` as a URI: a typo, a run directory given for one of its checkpoints,
    or a Hugging Face directory (read from local disk only) fail on the driver with the fix, not as TensorStore
    errors on every worker once the cluster is up."""
    from ray_jax_train.lm.state import init_spec, weights_dir_kind

    query = f"?endpoint_override={s3_endpoint}&region=us-east-1"
    bucket = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", region="us-east-1")
    for name in ("run/checkpoint_000000002_aa/_CHECKPOINT_METADATA", "run/checkpoint_000000004_bb/_CHECKPOINT_METADATA",
                 "run/checkpoint_000000006_cc/state/_METADATA", "hf/config.json", "hf/model.safetensors"):
        with bucket.open_output_stream(f"{BUCKET}/weights/{name}") as f:
            f.write(b"{}")
    uri = f"s3://{BUCKET}/weights"
    assert init_spec(checkpoint_path=f"{uri}/run/checkpoint_000000004_bb{query}") == {
        "source": "checkpoint", "path": f"{uri}/run/checkpoint_000000004_bb{query}"}
    with pytest.raises(FileNotFoundError, match=r"weights/rnu\?endpoint_override=\S+ does not exist"):
        init_spec(checkpoint_path=f"{uri}/rnu{query}")
    # The unfinished step-6 save is not offered; the URI offered keeps its endpoint.
    with pytest.raises(FileNotFoundError, match=re.escape(f"the latest is {uri}/run/checkpoint_000000004_bb{query}")):
        weights_dir_kind(f"{uri}/run{query}")
    with pytest.raises(FileNotFoundError, match=r"Hugging Face model directory in remote storage.*copy it"):
        weights_dir_kind(f"{uri}/hf{query}")
    # Its run's tokenizer comes with it, as from a local checkpoint; none there and no tokenizer.path is refused (a
    # tokenizer trained now would give the weights' ids other meanings: a review found that silent for URIs).
    from ray_jax_train.run_config import ConfigError, check_hf_init_tokenizer, init_tokenizer_dir, load_config

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny_llama.yaml")
    config = load_config(tiny, [f"model.init_from={uri}/run/checkpoint_000000004_bb{query}"])
    with pytest.raises(ConfigError, match="kept no tokenizer beside it"):
        check_hf_init_tokenizer(config)
    with bucket.open_output_stream(f"{BUCKET}/weights/run/model/tokenizer.json") as f:
        f.write(b"{}")
    assert init_tokenizer_dir(config) == f"{uri}/run/model{query}"
