"""Run storage that is not a local path: URIs stay URIs, outputs reach object-store-like filesystems, and a
node that does not see the driver's storage is told so.

`SubTreeFileSystem` over a temporary directory stands in for an object store: it is not pyarrow's
`LocalFileSystem`, so the code takes the same path it takes for gs:// or s3:// (no network here).
"""
import json
import os

import pyarrow.fs as pafs
import pytest

from ray_jax_train import storage
from ray_jax_train.lm.loop import RunOutputs
from ray_jax_train.lm.metrics import read_metrics
from ray_jax_train.plot import read_records
from ray_jax_train.run_config import ExperimentConfig
from ray_jax_train.text import load_tokenizer, train_tokenizer


def object_store(root):
    os.makedirs(root, exist_ok=True)
    return pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())


def test_absolute_keeps_uris_and_anchors_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.absolute("gs://bucket/runs") == "gs://bucket/runs"  # abspath would give <cwd>/gs:/bucket/runs
    assert storage.absolute("runs") == str(tmp_path / "runs")
    assert storage.join("gs://bucket/runs/", "name", "metrics.jsonl") == "gs://bucket/runs/name/metrics.jsonl"
    config = ExperimentConfig.model_validate({"data": {"source": ["a.jsonl"], "eval_source": "s3://b/e.jsonl"},
                                              "tokenizer": {"path": "tok"}, "model": {"init_from": "ckpt"},
                                              "run": {"storage_path": "gs://bucket/runs"}})
    fixed = config.with_absolute_paths()  # what a Tune search hands its trials, which run in other directories
    assert fixed.data.source == [str(tmp_path / "a.jsonl")] and fixed.data.eval_source == "s3://b/e.jsonl"
    assert fixed.tokenizer.path == str(tmp_path / "tok") and fixed.model.init_from == str(tmp_path / "ckpt")
    assert fixed.run.storage_path == "gs://bucket/runs"
    assert ExperimentConfig.model_validate({}).with_absolute_paths().data.source == "stdlib"


def test_uri_paths_keep_their_query_and_ray_paths_get_their_scheme_back():
    """An S3 storage_path carries its endpoint as a query: paths made from it put parts before the query (a run
    directory under it was "?endpoint_override=http://h:9/run"), and the scheme-less path Ray reports for a
    checkpoint (Tune's checkpoint_path) is a URI of that storage again."""
    s3 = "s3://bkt/runs?endpoint_override=http://h:9&region=r"
    assert storage.join(s3, "run", "tokenizer") == "s3://bkt/runs/run/tokenizer?endpoint_override=http://h:9&region=r"
    assert storage.join("gs://b/runs/", "x") == "gs://b/runs/x"
    assert storage.qualified("bkt/runs/t/checkpoint_1", s3) == \
        "s3://bkt/runs/t/checkpoint_1?endpoint_override=http://h:9&region=r"
    assert storage.qualified("b/runs/c", "gs://b/runs") == "gs://b/runs/c"
    assert storage.qualified("/local/runs/c", "/local/runs") == "/local/runs/c"


def test_metrics_on_an_object_store_keep_an_earlier_attempts_lines(tmp_path):
    fs = object_store(tmp_path / "bucket")
    first = RunOutputs(fs, "/run").metrics_file()
    first.append(json.dumps({"step": 1, "loss": 3.0}))  # written at once (the first write of an attempt)
    first.append(json.dumps({"step": 2, "loss": 2.5}))  # held back: a rewrite at most every 30 s
    assert len((tmp_path / "bucket" / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    first.close()
    again = RunOutputs(fs, "/run").metrics_file()  # a restarted attempt: no append on object stores
    again.append(json.dumps({"step": 2, "loss": 2.4}))
    lines = (tmp_path / "bucket" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [3.0, 2.5, 2.4]
    # Readers take URIs too; the later record of a repeated step wins.
    uri = f"file://{tmp_path / 'bucket' / 'run'}"
    assert [r["loss"] for r in read_records(uri)] == [3.0, 2.4]
    assert read_metrics(uri) == read_records(uri) and read_metrics(f"file://{tmp_path}/nothing") == []
    # A line a killed attempt cut short is ended before the next attempt's first (they ran into one, both lost).
    for where, files in ((tmp_path / "local" / "run", pafs.LocalFileSystem()), (tmp_path / "bucket" / "cut", fs)):
        where.mkdir(parents=True)
        (where / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
        again = RunOutputs(files, str(where) if files is not fs else "/cut").metrics_file()
        again.append(json.dumps({"step": 2, "loss": 2.4, "start_step": 1}))
        again.close()
        assert [r["loss"] for r in read_records(str(where))] == [3.0, 2.4], (where / "metrics.jsonl").read_text()


def test_final_model_and_tokenizer_reach_an_object_store(ray_cluster, tmp_path):
    import ray
    from flax import nnx

    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.models import LlamaForCausalLM, from_pretrained

    tokenizer = train_tokenizer(["one two three four five six seven"] * 50, vocab_size=280)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    fs = object_store(tmp_path / "bucket")
    RunOutputs(fs, "/run").save_final_model(model, ray.put(tokenizer), rank0=True)
    final = tmp_path / "bucket" / "run" / "final_model"
    assert not list(tmp_path.glob("rjt_upload_*"))
    loaded = from_pretrained(str(final))
    same = jax_tree_equal(nnx.state(model, nnx.Param), nnx.state(loaded, nnx.Param))
    assert same, "the exported weights differ from the model's"
    # The tokenizer saved beside them loads back from a storage URI (copied down first).
    again = load_tokenizer(f"file://{final}")
    assert again("three four")["input_ids"] == tokenizer("three four")["input_ids"]


def test_a_file_where_the_run_writes_a_directory_is_refused_before_training(tmp_path):
    """A file at final_model/ failed the run only as training ended (a bare FileExistsError, after every step) and
    restarted it (a review); the loop's first lines refuse it now, on an object store too, and the refusal is not
    retried (a UsageError)."""
    from ray_jax_train.errors import UsageError
    from ray_jax_train.lm.arguments import TrainingArguments

    fs = object_store(tmp_path / "bucket")
    (tmp_path / "bucket" / "run").mkdir()
    outputs = RunOutputs(fs, "/run")
    args = TrainingArguments(total_steps=1, save_steps=5)
    outputs.refuse_blocked_outputs(args)  # nothing there yet
    (tmp_path / "bucket" / "run" / "final_model").write_text("notes")
    with pytest.raises(UsageError, match=r"/run/final_model is a file, where this run writes its final_model/ "
                                         r"directory when training ends.*save_final_model=False"):
        outputs.refuse_blocked_outputs(args)
    outputs.refuse_blocked_outputs(args.model_copy(update={"save_final_model": False}))
    (tmp_path / "bucket" / "run" / "model").write_text("notes")
    with pytest.raises(UsageError, match=r"/run/model is a file, where this run writes its model/ directory for its "
                                         r"checkpoints' export"):
        outputs.refuse_blocked_outputs(args.model_copy(update={"save_final_model": False}))
    outputs.refuse_blocked_outputs(args.model_copy(update={"save_final_model": False, "save_steps": 0}))


def jax_tree_equal(a, b) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_marker_names_a_node_that_does_not_see_the_storage(tmp_path):
    path, token = storage.write_marker(str(tmp_path / "run"))
    assert storage.marker_problem(path, token) is None
    stale = storage.marker_problem(path, "a-token-from-another-run")  # a node-local dir left by an earlier run
    assert stale and "another run's token" in stale and "gs://" in stale
    missing = storage.marker_problem(str(tmp_path / "elsewhere" / storage.MARKER_NAME), token)
    assert missing and "is missing" in missing and "not shared" in missing


def test_uri_tokenizer_path_is_accepted_by_the_config_check(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    train_tokenizer(["alpha beta gamma"] * 30, vocab_size=270, save_dir=str(tokenizer_dir))
    from ray_jax_train.run_config import ConfigError, parse_config

    parse_config({"tokenizer": {"path": f"file://{tokenizer_dir}"}})  # a URI is not a local directory to test
    with pytest.raises(ConfigError, match="tokenizer.path"):
        parse_config({"tokenizer": {"path": str(tmp_path / "missing")}})


def test_a_run_inside_a_jobs_working_dir_copy_is_recognised():
    # Where a relative run.storage_path lands under `ray job submit --working-dir .`: Ray's package cache.
    cache = "/tmp/ray/session_2026/runtime_resources/working_dir_files/_ray_pkg_0a1b/runs/tiny-llama"
    assert storage.in_ray_package_cache(cache)
    assert not storage.in_ray_package_cache("/mnt/shared/runs/tiny-llama")
    assert not storage.in_ray_package_cache("s3://bucket/runtime_resources/working_dir_files/runs")


def test_checkpoints_in_a_bucket_without_its_fsspec_package_are_refused_naming_the_extra(monkeypatch):
    """Orbax writes its metadata through fsspec: with no gcsfs the first save failed inside orbax, a save interval
    into the run, and Ray retried it. The machine without the package is stood in for by hiding it from the import
    system; the filesystem is pyarrow's real GCS one (nothing is asked of the network)."""
    import importlib.util

    import pyarrow.fs

    from ray_jax_train.checkpoint.core import _uri_for
    from ray_jax_train.retries import repeats_on_retry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in ("gcsfs", "s3fs") else real(name, *a, **k))
    with pytest.raises(storage.StoragePackageMissing, match=r"gs:// storage need the gcsfs package.*"
                                                            r"pip install 'ray-jax-train\[gcs\]'") as missing:
        _uri_for(pyarrow.fs.GcsFileSystem(anonymous=True), "bucket/runs/r")
    assert repeats_on_retry(missing.value)  # FailureConfig's retries would find it missing again
    with pytest.raises(storage.StoragePackageMissing, match=r"ray-jax-train\[s3\]"):
        storage.require_fsspec_client("s3")
    # Where TensorFlow is installed, etils reaches gs:// through its gfile instead (unless EPATH_USE_TF says no).
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: (
        object() if name == "tensorflow" else None if name in ("gcsfs", "s3fs") else real(name, *a, **k)))
    storage.require_fsspec_client("gs")
    monkeypatch.setenv("EPATH_USE_TF", "false")
    with pytest.raises(storage.StoragePackageMissing, match="gcsfs"):
        storage.require_fsspec_client("gs")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    storage.require_fsspec_client("s3")  # installed by the test extras
