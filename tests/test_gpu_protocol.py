"""The staged GPU protocol (bench/gpu_protocol.py) is checked here without a GPU: its plan fits
the device lease, and a step that overruns is killed while the results so far are still packed."""

import importlib.util
import json
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_protocol", ROOT / "bench" / "gpu_protocol.py")
protocol = importlib.util.module_from_spec(_spec)
sys.modules["gpu_protocol"] = protocol  # dataclasses look their module up
_spec.loader.exec_module(protocol)


def test_dry_run_prints_every_call_within_budget(capsys):
    assert protocol.main(["--dry-run", "all"]) == 0
    printed = capsys.readouterr().out
    for call in protocol.CALLS:
        assert f"call {call}:" in printed
        assert protocol.budget(call) <= protocol.CALL_BUDGET_S < 600  # the tool's per-call limit
    assert "PROBLEM" not in printed


def test_dry_run_flags_a_call_over_budget(monkeypatch, capsys):
    long = protocol.Step("long", ["true"], protocol.CALL_BUDGET_S + 1)
    monkeypatch.setitem(protocol.CALLS, "triton", [long])
    assert protocol.main(["--dry-run", "triton"]) == 1
    assert "triton is over budget" in capsys.readouterr().out


def test_unknown_call_is_refused():
    with pytest.raises(SystemExit):
        protocol.main(["benchmarks"])


def test_overrunning_step_is_killed_and_results_are_packed_after_each_step(tmp_path, monkeypatch):
    out_dir, device_out = tmp_path / "results", tmp_path / "OUT"
    device_out.mkdir()
    monkeypatch.setenv("OUT", str(device_out))
    steps = [
        protocol.Step("hangs", [sys.executable, "-c",
                                "import time; print('started'); time.sleep(30)"], 1),
        protocol.Step("writes", [sys.executable, "-c",
                                 "open('{out}/made.txt', 'w').write('x')"], 30),
        protocol.Step("fails", [sys.executable, "-c", "raise SystemExit(3)"], 30),
    ]
    assert protocol.run_call("test", steps, out_dir) == 1
    records = json.loads((out_dir / "steps.json").read_text())
    assert [(r["step"], r["status"]) for r in records] == [
        ("hangs", "timeout"), ("writes", "ok"), ("fails", "exit 3")]
    assert records[0]["seconds"] < 10
    assert "started" in (out_dir / "hangs.log").read_text()
    with tarfile.open(device_out / "test.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("made.txt") for n in names)
    assert any(n.endswith("steps.json") for n in names)
    assert "timeout" in (device_out / "test-summary.txt").read_text()


def test_lanes_run_side_by_side_and_every_step_is_recorded(tmp_path):
    def sleeps(name):
        return protocol.Step(name, [sys.executable, "-c", "import time; time.sleep(1.5)"], 30)

    stages = [protocol.Lanes([[sleeps("a1"), sleeps("a2")], [sleeps("b")]]), sleeps("after")]
    assert protocol.Lanes(stages[0].lanes).timeout == 60
    start = time.monotonic()
    assert protocol.run_call("test", stages, tmp_path) == 0
    wall = time.monotonic() - start
    records = {r["step"]: r for r in json.loads((tmp_path / "steps.json").read_text())}
    assert set(records) == {"a1", "a2", "b", "after"}
    # b ran beside a1 and a2: the whole took about 4.5 s, where one after the other takes 6
    assert sum(r["seconds"] for r in records.values()) >= 6 > wall + 0.5
    assert all(r["status"] == "ok" for r in records.values())
