"""The benchmark suite's smoke mode still runs end to end and writes well-formed outputs (no timing asserted)."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_suite():
    spec = importlib.util.spec_from_file_location("bench_suite", os.path.join(ROOT, "benchmarks", "suite.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The cheapest part that still goes through Ray: the bare step and the built-in loop on JaxTrainer, and one real
# restart of it (a SIGKILL at its first report); and (d)'s split, the 2-process half: the data-parallel step in 2
# pinned processes of their own (jax.distributed + gloo, no Ray) and in 2 pinned JaxTrainer workers; both have to
# train through a real cross-process all-reduce.
SMOKE_VARIANTS = ("bare", "ours", "ours_restart", "bare2", "in_worker2")


@pytest.fixture(scope="module")
def smoke_run(ray_cluster, tmp_path_factory):
    """One `suite.py --smoke` run of the variants both tests below read (they were two runs): each run builds its
    dataset and writes its report, table and chart once, however many variants it has."""
    suite = _load_suite()
    out = tmp_path_factory.mktemp("suite_smoke")
    report = suite.main(["--smoke", "--variants", *SMOKE_VARIANTS, "--no-checkpoint", "--out", str(out)])
    return report, out


def test_suite_smoke_writes_json_table_and_chart(smoke_run):
    report, out = smoke_run
    with open(out / "suite.json") as f:
        saved = json.load(f)
    assert saved["summary"] == json.loads(json.dumps(report["summary"]))
    overhead = saved["summary"]["overhead"]
    assert overhead["n"] == 1 and overhead["min"] <= overhead["median"] <= overhead["max"]
    assert overhead["median"] > 0 and overhead["target"] == 0.98 and isinstance(overhead["met"], bool)
    assert set(saved["variants"]) == set(SMOKE_VARIANTS)
    assert saved["variants"]["ours"]["startup_s"]["median"] > 0
    assert saved["variants"]["ours_restart"]["restart_s"]["median"] > 0
    table = (out / "suite.md").read_text()
    assert "| (a) overhead: ours / bare process |" in table and "| ours |" in table
    assert (out / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_suite_smoke_splits_scaling_into_machine_ray_and_ours(smoke_run):
    report, out = smoke_run
    assert set(report["variants"]) == set(SMOKE_VARIANTS)
    for name in ("bare2", "in_worker2"):
        assert report["variants"][name]["tokens_per_s"]["median"] > 0
    share = report["summary"]["scale2_ray_share"]
    assert share["n"] == 1 and share["median"] > 0 and share["target"] is None
    table = (out / "suite.md").read_text()
    assert "| (d) split, 2 workers: step in pinned workers / in pinned processes |" in table


def test_gpu_session_reads_loop_windows_and_unpacks_executables(tmp_path):
    """gpu_session.py's pieces that run on a device machine only: log-window figures, the table, carried files."""
    import stat
    import zipfile

    spec = importlib.util.spec_from_file_location("gpu_session", os.path.join(ROOT, "benchmarks", "gpu_session.py"))
    session = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(session)
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 20, "startup_s": 9.5, "loss": 7.0, "tokens_per_s": 10.0, "mfu": 0.01}]  # compile window
    rows += [{"step": 20 * i, "loss": 7.0 - i, "tokens_per_s": 100.0 + i, "mfu": 0.1} for i in range(2, 7)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    figures = session.loop_figures(str(run), skip_windows=2)
    assert figures["windows"] == 4 and figures["tokens_per_s"] == 104.5  # windows 3-6: 103..106
    assert (figures["tokens_per_s_min"], figures["tokens_per_s_max"]) == (103.0, 106.0)
    assert figures["startup_s"] == 9.5 and figures["last_loss"] == 1.0 and not figures["final_model"]
    lines = session.report_lines({"device": "X", "versions": "v", "stages": {"bare_1b": "rc -9, timed out"},
                                  "loop": dict(figures, batch=4, seq=8), "loop_over_bare": 0.5})
    assert any("| 104 | 10.0% |" in line for line in lines)
    assert any("not measured (rc -9, timed out)" in line for line in lines) and lines[-1].endswith("built-in loop / bare step 0.500.")

    archive = tmp_path / "pkg.whl"
    with zipfile.ZipFile(archive, "w") as z:
        info = zipfile.ZipInfo("pkg/bin/server")
        info.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(info, "#!/bin/sh\n")
        z.writestr("pkg/__init__.py", "")
    assert session.unpack([str(tmp_path)], str(tmp_path / "site")) == ["pkg.whl"]
    assert os.access(tmp_path / "site" / "pkg" / "bin" / "server", os.X_OK)  # Ray's gcs_server / raylet must run

    # A stage that hangs mid-line is killed at its limit, and what it printed is kept.
    import io
    import sys
    import time

    hang = "import sys, time; print('first', flush=True); sys.stdout.write('partial'); sys.stdout.flush(); time.sleep(60)"
    log, started = io.StringIO(), time.monotonic()
    session.MIN_STAGE_S = 1
    result = session.run_stage("hang", [sys.executable, "-c", hang], dict(os.environ), 3, log)
    assert result["timed_out"] and time.monotonic() - started < 20
    assert "[hang] first" in log.getvalue() and "partial" in log.getvalue()
    assert session.stage_status(result).endswith("timed out")
    assert session.stage_status(session.run_stage("late", ["true"], {}, 0.5, log)).startswith("skipped")


def test_gpu_trace_summary_finds_the_idle_gap_and_what_the_host_did(monkeypatch, capsys):
    """`trace_summary.py --gpu` on a GPU trace's shape. CPU CI cannot make a GPU trace, so the planes are built by
    hand with the names, lines and stats a real H200 trace had (session 29): two train steps on the compute
    stream, a 1 ms gap between them while the host's Python sat in a metrics fetch."""
    import types

    import jax

    spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(ROOT, "benchmarks", "trace_summary.py"))
    trace_summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace_summary)

    def event(name, start_ms, ms, module=None):
        start, duration = int(start_ms * 1e6), int(ms * 1e6)
        return types.SimpleNamespace(name=name, start_ns=start, duration_ns=duration, end_ns=start + duration,
                                     stats=[("hlo_module", module)] if module else [])

    def line(name, events):
        return types.SimpleNamespace(name=name, events=events)

    gpu = types.SimpleNamespace(name="/device:GPU:0", lines=[
        line("Stream #14(Memset,Compute)", [event("gemm", 0, 29, "jit_train_step"), event("fusion", 29, 1, "jit_train_step"),
                                            event("gemm", 31, 30, "jit_train_step"), event("stack", 61, 0.1, "jit_stack")]),
        line("Stream #15(MemcpyH2D)", [event("MemcpyH2D", 30.5, 0.2)])])
    host = types.SimpleNamespace(name="/host:CPU", lines=[line("ray::RayTrainWo", [
        event("$loop.py:240 train_loop_per_worker", 0, 70), event("$loop.py:442 _fetch", 29.9, 1.0),
        event("$builtins isinstance", 30.1, 0.01)])])
    monkeypatch.setattr(jax.profiler.ProfileData, "from_file", staticmethod(lambda path: types.SimpleNamespace(
        planes=[host, gpu])))
    found = trace_summary.gpu_timeline("trace.xplane.pb", min_gap_ms=0.05)["/device:GPU:0"]
    assert abs(found["window_ms"] - 61.1) < 1e-6 and abs(found["busy_ms"] - 60.3) < 1e-6
    assert abs(found["gap_ms"] - 0.8) < 1e-6  # 30-30.5 and 30.7-31: the copy in between counts as busy
    assert abs(found["modules"]["jit_train_step"] - 60.0) < 1e-6 and "jit_stack" in found["modules"]
    gaps = [row for row in capsys.readouterr().out.splitlines() if " before " in row]
    assert len(gaps) == 2 and all("_fetch" in row and "isinstance" not in row for row in gaps), gaps
