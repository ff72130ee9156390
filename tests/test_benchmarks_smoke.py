"""The benchmark suite's smoke mode still runs end to end and writes well-formed outputs (no timing asserted)."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_suite():
    spec = importlib.util.spec_from_file_location("bench_suite", os.path.join(ROOT, "benchmarks", "suite.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_suite_smoke_writes_json_table_and_chart(ray_cluster, tmp_path):
    suite = _load_suite()
    # The cheapest part that still goes through Ray: the bare step and the built-in loop on JaxTrainer, and one
    # real restart of it (a SIGKILL at its first report).
    report = suite.main(["--smoke", "--variants", "bare", "ours", "ours_restart", "--no-checkpoint",
                         "--out", str(tmp_path)])

    with open(tmp_path / "suite.json") as f:
        saved = json.load(f)
    assert saved["summary"] == json.loads(json.dumps(report["summary"]))
    overhead = saved["summary"]["overhead"]
    assert overhead["n"] == 1 and overhead["min"] <= overhead["median"] <= overhead["max"]
    assert overhead["median"] > 0 and overhead["target"] == 0.98 and isinstance(overhead["met"], bool)
    assert set(saved["variants"]) == {"bare", "ours", "ours_restart"}
    assert saved["variants"]["ours"]["startup_s"]["median"] > 0
    assert saved["variants"]["ours_restart"]["restart_s"]["median"] > 0
    table = (tmp_path / "suite.md").read_text()
    assert "| (a) overhead: ours / bare process |" in table and "| ours |" in table
    assert (tmp_path / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_suite_smoke_splits_scaling_into_machine_ray_and_ours(ray_cluster, tmp_path):
    suite = _load_suite()
    # (d)'s split, the 2-process half: the data-parallel step in 2 pinned processes of their own (jax.distributed +
    # gloo, no Ray) and in 2 pinned JaxTrainer workers; both have to train through a real cross-process all-reduce.
    report = suite.main(["--smoke", "--variants", "bare2", "in_worker2", "--no-checkpoint", "--out", str(tmp_path)])

    assert set(report["variants"]) == {"bare2", "in_worker2"}
    for name in ("bare2", "in_worker2"):
        assert report["variants"][name]["tokens_per_s"]["median"] > 0
    share = report["summary"]["scale2_ray_share"]
    assert share["n"] == 1 and share["median"] > 0 and share["target"] is None
    table = (tmp_path / "suite.md").read_text()
    assert "| (d) split, 2 workers: step in pinned workers / in pinned processes |" in table
