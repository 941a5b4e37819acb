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


def test_lanes_run_side_by_side_and_every_step_is_recorded(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)  # (on the device, $OUT is what comes back)
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


def test_ncu_table_labels_each_kernel_with_its_case():
    """bench/profile_attention.py reads ncu's raw CSV: a case's kernels follow its forward kernel,
    thousands separators and nanoseconds are read, and the top stall reasons are named."""
    spec = importlib.util.spec_from_file_location("profile_attention",
                                                  ROOT / "bench" / "profile_attention.py")
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    stall = prof.STALL_METRIC.format
    raw = ("==PROF== Connected to process\n"
           f'"ID","Kernel Name","gpu__time_duration.sum","{stall("barrier")}","{stall("wait")}"\n'
           '"","","nsecond","",""\n'
           '"0","void attn_fwd_kernel<bf16, FwdCfg<1>>","1,234,567","2.5","0.7"\n'
           '"1","void attn_bwd_dq_kernel<bf16>","2000000","4.0","1.0"\n'
           '"2","void attn_fwd_kernel<bf16, FwdCfg<1>>","900000","0.1","3.0"\n')
    lines = prof.table(raw, ["some__metric"]).splitlines()
    labels = prof._labels()
    assert lines[1].startswith(f"{labels[0]} | void attn_fwd_kernel") and "| 1.235 |" in lines[1]
    assert lines[2].startswith(f"{labels[0]} | void attn_bwd_dq") and "barrier 4.0, wait 1.0" in lines[2]
    assert lines[3].startswith(f"{labels[1]} |") and lines[3].endswith("wait 3.0, barrier 0.1")
    assert lines[-1] == "metrics this ncu does not know: some__metric"


def test_a_test_step_logs_each_test_as_it_ends_even_when_killed(tmp_path, monkeypatch):
    """The per-test log (tests/conftest.py) is what a killed pytest step leaves: no junit XML."""
    monkeypatch.delenv("OUT", raising=False)
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "test_x.py").write_text(
        "import time\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'bad on purpose'\n"
        "def test_zhangs(): time.sleep(60)\n")
    step = protocol._tests("t", "-p", "no:randomly", str(tests), junit="t", step_timeout=20,
                           workers=None)
    assert protocol.run_call("t", [step], tmp_path / "out") == 1
    rows = [line.split("\t") for line in (tmp_path / "out" / "t-tests.tsv").read_text().splitlines()]
    assert [(r[0].split("::")[-1], r[2]) for r in rows] == [("test_ok", "passed"),
                                                           ("test_bad", "failed")]
    assert "bad on purpose" in (tmp_path / "out" / "t-tests.tsv.failures").read_text()
    assert not (tmp_path / "out" / "t.xml").exists()  # killed: the log is all there is


# bench/cxx_exceptions.py: the GPU image segfaulted while errors were raised through C++ (H100,
# 2026-11-26); here, where they raise, every probe must say so, and a crash must read as one.
_cx_spec = importlib.util.spec_from_file_location("cxx_exceptions", ROOT / "bench" / "cxx_exceptions.py")
cxx_exceptions = importlib.util.module_from_spec(_cx_spec)
_cx_spec.loader.exec_module(cxx_exceptions)


def test_cxx_exception_probes_raise_here(capsys):
    assert cxx_exceptions.main(["--no-builds"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("  ok ") >= 6 and "FAIL" not in printed
    assert "fastattn cpu op, after its parallel op: raised RuntimeError: x must be 4-D" in printed
    assert "mapped after a parallel op" in printed


def test_cxx_exception_probe_reports_a_crash_and_no_raise():
    assert cxx_exceptions.run_probe("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)") == (
        False, "CRASH: signal 11")
    ok, what = cxx_exceptions.run_probe(cxx_exceptions._raise_code("", "1 + 1"))
    assert not ok and "did not raise" in what


@pytest.mark.skipif(importlib.util.find_spec("ninja") is None or not cxx_exceptions.compilers(),
                    reason="needs a C++ compiler and ninja")
def test_cxx_exception_probe_of_a_built_op(tmp_path):
    from fastattn.extending import DEFAULT_CFLAGS, DEFAULT_LDFLAGS

    lines = cxx_exceptions.build_variant(tmp_path, "cxxprobetest", cxx_exceptions.compilers()[0],
                                         list(DEFAULT_CFLAGS), list(DEFAULT_LDFLAGS))
    assert len(lines) == 2 and all(line.strip().startswith("ok") for line in lines), lines
    assert "after its parallel loop: raised RuntimeError: probe asked to fail, x of shape [3]" in lines[1]


def _tree(root, source="int x;\n"):
    (root / "csrc" / "cuda").mkdir(parents=True)
    (root / "fastattn").mkdir()
    (root / "setup.py").write_text("setup()\n")
    (root / "fastattn" / "extending.py").write_text("FLAGS = ('-O3',)\n")
    (root / "csrc" / "cuda" / "a.cu").write_text(source)
    return root


def test_extension_digest_follows_every_source_the_build_reads(tmp_path):
    root = _tree(tmp_path / "t")
    digest = protocol.extension_digest(root)
    assert digest == protocol.extension_digest(root)
    assert len(digest) == 64
    (root / "csrc" / "cuda" / "a.cu").write_text("int y;\n")
    changed = protocol.extension_digest(root)
    assert changed != digest
    (root / "fastattn" / "extending.py").write_text("FLAGS = ('-O2',)\n")
    assert protocol.extension_digest(root) != changed
    # a file's name counts too: the same bytes under another name build something else
    other = _tree(tmp_path / "u")
    (other / "csrc" / "cuda" / "a.cu").rename(other / "csrc" / "cuda" / "b.cu")
    assert protocol.extension_digest(other) != digest


def test_prebuilt_extension_only_stands_in_for_the_same_sources_torch_and_python():
    stamp = {"digest": "d" * 64, "torch": protocol.DEVICE_TORCH, "python": protocol.DEVICE_PYTHON}
    here = ("d" * 64, protocol.DEVICE_TORCH, protocol.DEVICE_PYTHON)
    assert protocol.prebuilt_refusal(stamp, *here) is None
    assert "digest" in protocol.prebuilt_refusal(stamp, "e" * 64, *here[1:])
    assert "2.10.0" in protocol.prebuilt_refusal(stamp, here[0], "2.10.0+cu130", here[2])
    assert "python" in protocol.prebuilt_refusal(stamp, *here[:2], "3.11")
    assert "torch" in protocol.prebuilt_refusal({**stamp, "torch": None}, *here)


def test_build_step_refuses_a_stale_prebuilt_extension_and_leaves_nothing(tmp_path, monkeypatch):
    prebuilt = tmp_path / ".gpu-prebuilt"
    prebuilt.mkdir()
    name = "_C.stale-test.so"
    (prebuilt / name).write_bytes(b"not a library")
    import torch
    stamp = {"file": name, "digest": "0" * 64, "torch": torch.__version__,
             "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    (prebuilt / "stamp.json").write_text(json.dumps(stamp))
    monkeypatch.setattr(protocol, "PREBUILT", prebuilt)
    why = protocol._use_prebuilt()
    assert why is not None and "digest" in why
    assert not (ROOT / "fastattn" / name).exists()
    # the same file stamped for these sources is put in place, and taken away when it does not
    # import
    (prebuilt / "stamp.json").write_text(json.dumps({**stamp, "digest": protocol.extension_digest()}))
    monkeypatch.setattr(protocol, "_import_extension", lambda py=None: protocol.subprocess.
                        CompletedProcess([], 1, "", "ImportError: undefined symbol"))
    why = protocol._use_prebuilt()
    assert why is not None and "did not import" in why and "undefined symbol" in why
    assert not (ROOT / "fastattn" / name).exists()
