"""The benchmark harness: `fastattn bench` end to end on tiny cases, JSON, errors, plots, summary."""

import importlib.util
import json
import os
import platform
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fastattn import _extension, bench, cli
from fastattn.bench import suites
from fastattn.bench.suites import REFERENCE_MAX_ELEMENTS, SUITES, Options, attention_flops, attention_suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_KEYS = {"device", "device_type", "torch", "triton", "python", "date", "commit", "peaks", "backends"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One `fastattn bench` run on the hidden tiny preset, every op, forward + backward."""
    path = str(tmp_path_factory.mktemp("bench") / "tiny.json")
    argv = ["bench", "--tiny", "--op", "all", "--seq", "32", "--mode", "fwd_bwd", "--budget", "0.001",
            "--device", "cpu", "--json", path]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: thread start-up and a busy machine would dominate
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    with open(path) as f:
        return path, json.load(f)


def test_environment_records_the_isa_caps_of_torchs_gemms(monkeypatch):
    """An AVX2 run on an AVX-512 machine caps oneDNN and MKL too (docs/benchmarking.md): the
    environment block says which caps were set, and leaves out those that were not."""
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    env = bench.environment("cpu")
    assert "onednn_max_cpu_isa" not in env and "mkl_enable_instructions" not in env
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    env = bench.environment("cpu")
    assert env["onednn_max_cpu_isa"] == "avx2" and env["mkl_enable_instructions"] == "avx2"


@pytest.mark.skipif(not _extension.loaded(), reason="the extension is not built")
def test_environment_records_the_cpu_backends_kernel_choices(monkeypatch):
    """The cpu backend picks some kernels by CPU (csrc/include/fastattn/cpu_choices.h); a recorded
    run says which ones it timed, as the kernels decide them, variables that force them included."""
    monkeypatch.setenv("FASTATTN_CPU_TORCH_ATTENTION", "1")
    monkeypatch.setenv("FASTATTN_CPU_FFN_GEMM", "float32")
    env = bench.environment("cpu")
    assert env["cpu_isa"] in ("avx512", "avx2", "default")
    assert env["cpu_kernels"] == {"attention_plain_forward": "torch", "ffn_bfloat16_matmuls": "float32",
                                  "ffn_float16_matmuls": "float32"}
    monkeypatch.setenv("FASTATTN_CPU_TORCH_ATTENTION", "0")
    monkeypatch.setenv("FASTATTN_CPU_FFN_GEMM", "native")
    assert bench.environment("cpu")["cpu_kernels"] == {
        "attention_plain_forward": "fastattn", "ffn_bfloat16_matmuls": "bfloat16", "ffn_float16_matmuls": "float16"}


def test_cli_writes_json_with_environment_and_ratios(tiny_run):
    _, data = tiny_run
    env = data["environment"]
    assert ENV_KEYS <= set(env), ENV_KEYS - set(env)
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__
    assert env["command"].startswith("fastattn bench --tiny")
    assert "partial" not in env  # the last write is the whole run
    if platform.libc_ver()[0] == "glibc":
        assert env["cpu_malloc"].startswith("glibc, mmap above"), env["cpu_malloc"]
    rows = data["results"]
    assert {r["op"] for r in rows} == set(SUITES)
    for op in SUITES:
        naive = [r for r in rows if r["op"] == op and r["provider"] == "naive"]
        assert naive and all(r["ms"] > 0 and r["speedup_vs_naive"] == pytest.approx(1.0) for r in naive)
        peers = [r for r in rows if r["op"] == op and r["provider"].startswith("torch") and r["ms"]]
        assert peers and all(r["speedup_vs_torch"] is not None for r in peers)
        assert max(r["speedup_vs_torch"] for r in peers) == pytest.approx(1.0)  # the best peer
    # paged decoding has no backward, the jvp suite times one JVP call: their suites time "fwd"
    forward_only = {"decode", "jvp"}
    for r in rows:
        assert r["mode"] == ("fwd" if r["op"] in forward_only else "fwd_bwd") and r["dtype"] == "float32"
        if r["error"]:
            assert r["ms"] is None
            continue
        assert r["ms_p20"] <= r["ms"] <= r["ms_p80"]
        assert (r["tflops"] is not None) == (r["op"] in ("attention", "ffn", "model", "varlen", "jvp"))
        assert (r["gbps"] is not None) == (r["op"] in ("softmax", "layer_norm", "decode"))
        assert r["peak_fraction"] > 0 and r["params"] and r["sweep"] in r["params"]
        if r["provider"] == "matmuls (floor)" or r["provider"].startswith("forward only"):
            pass  # reference points, not the op: not checked
        else:
            assert r["max_error"] < 1e-4, r
            if r["op"] not in ("model", *forward_only):  # no float64 backward of the whole model
                assert r["max_grad_error"] < 1e-4, r
        if r["op"] == "jvp":  # peak memory measured on the CPU too
            assert r["peak_mem_mb"] is not None and r["peak_mem_mb"] >= 0


def test_cli_covers_attention_providers_and_masks(tiny_run):
    _, data = tiny_run
    rows = [r for r in data["results"] if r["op"] == "attention"]
    assert {r["params"]["mask"] for r in rows} == {"none", "padding", "bias"}
    assert {r["params"]["causal"] for r in rows} == {False, True}
    providers = {r["provider"] for r in rows}
    assert {"naive", "torch.sdpa", "torch.sdpa[flash]", "torch.sdpa[math]", "torch.sdpa[efficient]"} <= providers
    # PyTorch has no memory-efficient kernel on a CPU: the row says why instead of stopping the run.
    eff = [r for r in rows if r["provider"] == "torch.sdpa[efficient]"]
    assert all(r["error"] and "CUDA" in r["error"] for r in eff)


def test_provider_that_raises_is_reported_not_fatal():
    def make():
        return (torch.randn(8, 16),)

    def boom(x):
        raise RuntimeError("kernel exploded\nsecond line")

    case = bench.Case("softmax", "8x16", torch.float32, "fwd", make, bytes=2 * 8 * 16 * 4,
                      reference=lambda x: torch.softmax(x.double(), -1).numpy())
    providers = {"naive": lambda x: torch.softmax(x, -1), "boom": boom, "torch": lambda x: torch.softmax(x, -1)}
    rows = bench.compare(providers, [case], device="cpu", progress=False, budget_s=0.001)
    by = {r.provider: r for r in rows}
    assert by["boom"].error == "RuntimeError: kernel exploded" and by["boom"].ms is None
    assert by["naive"].ms and by["torch"].ms and by["torch"].speedup_vs_naive > 0
    assert by["naive"].max_error < 1e-6
    bench.print_table(rows)  # an error row renders


def test_reference_may_cover_a_leading_corner():
    def make():
        return (torch.randn(4, 3, 8),)

    case = bench.Case("softmax", "4x3x8", torch.float32, "fwd", make,
                      reference=lambda x: torch.softmax(x[:1].double(), -1).numpy())
    rows = bench.compare({"naive": lambda x: torch.softmax(x, -1)}, [case], device="cpu", progress=False, budget_s=0.001)
    assert rows[0].max_error < 1e-6


def test_softmax_reference_of_a_big_case_is_its_first_batch_and_head(monkeypatch):
    """A big softmax case (the GPU's 2**25 elements) gets the float64 reference of its first
    (batch, head) only; every provider is compared with that same corner, so a correct one errs
    by its rounding alone. CPU grids never reach that size, hence the lowered threshold here (the
    first H100 run's 4.1e-05 ... 2.8e-03, quoted without their exponents, read as errors of 1-10)."""
    monkeypatch.setattr(suites, "REFERENCE_MAX_ELEMENTS", 2**16)  # the corner from 2**12 elements
    options = Options(seqs=[128], causal=[False, True], masks=["none", "padding", "bias"])
    providers, cases = suites.softmax_suite(torch.device("cpu"), torch.bfloat16, ["fwd_bwd"], False, options)
    assert len(cases) == 6 and cases[0].shape == "4x8x256x128"
    assert cases[0].reference(*cases[0].make()).shape == (1, 1, 256, 128)
    rows = bench.compare(providers, cases, device="cpu", progress=False, budget_s=0.001)
    assert len(rows) == 6 * len(providers) and not any(r.error for r in rows)
    for r in rows:
        assert r.max_error < 1e-2 and r.max_grad_error < 1e-2, (r.shape, r.provider, r.max_error, r.max_grad_error)
    assert not bench.wrong_results(rows)


def test_attention_flops():
    assert attention_flops(2, 4, 128, 256, 64, False, "fwd") == 4 * 2 * 4 * 128 * 256 * 64
    assert attention_flops(2, 4, 128, 256, 64, True, "fwd") == 2 * 2 * 4 * 128 * 256 * 64
    assert attention_flops(1, 1, 64, 64, 64, False, "bwd") == 2.5 * 4 * 64**3
    assert attention_flops(1, 1, 64, 64, 64, True, "fwd_bwd") == 3.5 * 2 * 64**3


def test_huge_attention_cases_skip_the_float64_reference():
    cpu = torch.device("cpu")
    _, cases = attention_suite(cpu, torch.float32, ["fwd"], False, Options(seqs=[16384], dims=[64], masks=["none"]))
    assert cases and all(c.reference is None and c.params["L"] ** 2 > REFERENCE_MAX_ELEMENTS for c in cases)
    _, cases = attention_suite(cpu, torch.float32, ["fwd"], False, Options(seqs=[256], dims=[64], masks=["none"]))
    assert all(c.reference is not None for c in cases)


def test_cpu_default_grid_is_small_and_gpu_grid_is_full():
    _, cpu_cases = attention_suite(torch.device("cpu"), torch.float32, ["fwd", "fwd_bwd"], False)
    assert 0 < len(cpu_cases) <= 24 and max(c.params["L"] for c in cpu_cases) <= 1024
    # The GPU grid, built without a GPU (make() is never called).
    _, gpu_cases = attention_suite(torch.device("cuda"), torch.bfloat16, ["fwd"], False, Options(compile=False))
    assert {c.params["D"] for c in gpu_cases} == {64, 128, 256}
    assert {c.params["L"] for c in gpu_cases} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {c.params["mask"] for c in gpu_cases} == {"none", "padding", "bias"}
    assert {c.params["causal"] for c in gpu_cases} == {False, True}


def test_plot_writes_a_png(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = tiny_run
    results, _env = bench.load_json(path)
    out = tmp_path / "plot.png"
    bench.plot(results, str(out), title="tiny")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_option(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "ln.png"
    argv = ["bench", "--tiny", "--op", "layer_norm", "--mode", "fwd", "--budget", "0.001", "--device", "cpu",
            "--plot", str(out)]
    assert cli.main(argv) == 0
    assert out.stat().st_size > 1000


def test_a_run_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """--json is written after every case, marked partial until the run ends: a GPU lease's step
    timeout (the first GPU run lost a whole benchmark to one) keeps what was measured."""
    from fastattn import bench

    real, done = bench.run_case, []

    def run_case(*args, **kwargs):
        if len(done) == 2:
            raise KeyboardInterrupt  # the kill, between two cases
        done.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "run_case", run_case)
    path = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["bench", "--tiny", "--op", "layer_norm", "--mode", "fwd,fwd_bwd", "--budget", "0.001",
                  "--device", "cpu", "--threads", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["environment"]["partial"] is True
    assert len({(r["shape"], r["mode"]) for r in data["results"]}) == 2


def test_summarize_writes_markdown(tiny_run, tmp_path):
    path, _ = tiny_run
    spec = importlib.util.spec_from_file_location("summarize", os.path.join(ROOT, "bench", "summarize.py"))
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    out = tmp_path / "SUMMARY.md"
    assert summarize.main([path, "-o", str(out)]) == 0
    text = out.read_text()
    assert "**CPU numbers**" in text and "### Headlines" in text
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in json.load(open(path))["results"]))
    assert f"small shapes, {dtypes};" in text  # the dtypes the run measured, not a fixed one
    from fastattn.bench import Result
    bf16 = [Result("ffn", "s", "bfloat16", "fwd", "torch", ms=1.0)]
    assert "small shapes, bfloat16;" in summarize._label({"device_type": "cpu", "threads": 2}, bf16)
    for op in SUITES:
        assert f"### {op}" in text
    assert "Could not run:" in text and "torch.sdpa[efficient]" in text


def test_summarize_keeps_wrong_results_out_of_the_speedups():
    """A fastattn result whose error is far over its peers' (the 2026-11-26 H200 run's D128
    forward) is marked WRONG and left out of the geomeans, however fast it ran."""
    spec = importlib.util.spec_from_file_location("summarize", os.path.join(ROOT, "bench", "summarize.py"))
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    from fastattn.bench import Result

    def row(provider, ms, err, shape="s"):
        return Result("attention", shape, "bfloat16", "fwd", provider, ms=ms, ms_p20=ms, ms_p80=ms,
                      speedup_vs_naive=4 / ms,
                      speedup_vs_torch=None if provider.startswith("torch") else 1 / ms, max_error=err)

    rows = [row("naive", 4.0, 1e-3), row("torch.sdpa", 1.0, 1e-3), row("fastattn-triton", 0.5, 0.25),
            row("naive", 4.0, 1e-3, "t"), row("torch.sdpa", 1.0, 1e-3, "t"),
            row("fastattn-triton", 2.0, 2e-3, "t"), row("fastattn-cuda", 2.0, float("nan"), "t")]
    assert summarize.wrong_results(rows) == {id(rows[2]), id(rows[6])}
    text = "\n".join(summarize.headline(rows) + summarize.op_table("attention", rows))
    assert "| attention | **fastattn-triton** | 1 (+1 wrong, left out) | 2.00 | 0.50 |" in text
    assert "0.5 WRONG" in text and "**1**" in text  # the wrong one is not the fastest
    from fastattn.bench import table_rows
    cells = [row[-1] for row in table_rows(rows, ["provider", "max err"])]
    assert cells[2] == "2.5e-01 WRONG" and cells[6] == "nan WRONG" and "WRONG" not in cells[5]


def test_info_still_works(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "fastattn" in out and "backends" in out and "naive" in out


def test_bench_suites_are_not_collected_by_plain_pytest(pytestconfig):
    # bench/conftest.py collects bench/bench_*.py only when bench/ is passed explicitly.
    assert pytestconfig.getini("testpaths") == ["tests"]
    names = os.listdir(os.path.join(ROOT, "bench"))
    assert {"bench_attention.py", "bench_softmax.py", "bench_layer_norm.py", "bench_ffn.py", "conftest.py"} <= set(names)
    assert not [n for n in names if n.startswith("test_")]



def test_token_counting_cases_get_a_tokens_per_second_column(tiny_run):
    _, data = tiny_run
    results = [bench.Result(**r) for r in data["results"]]
    for op in ("varlen", "decode"):
        rows = [r for r in results if r.op == op and r.ms]
        assert rows and all(r.tokens_per_s == pytest.approx(r.params["tokens"] / (r.ms / 1000)) for r in rows)
        cols = bench.columns(rows)
        assert "tok/s" in cols
        for cells in bench.table_rows(rows, cols):
            assert cells[cols.index("tok/s")] != "-" and len(cells[cols.index("tok/s")]) <= 6
    softmax = [r for r in results if r.op == "softmax"]
    assert "tok/s" not in bench.columns(softmax)
    assert [bench._fmt_count(v) for v in (950, 12_340, 4_560_000, 1.2e9, None)] == ["950", "12.3k", "4.56M", "1.2G", "-"]


def test_references_run_on_one_blas_thread():
    """The float64 references run with NumPy's OpenBLAS on one thread (its workers busy-wait after
    a call and would slow the provider timed next); the count is restored afterwards."""
    import numpy as np

    np.ones((64, 64)) @ np.ones((64, 64))  # make sure NumPy's BLAS is loaded
    setters = bench._openblas_thread_setters()
    if not setters:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS")
    before = [get() for get, _ in setters]
    with bench.one_blas_thread():
        assert [get() for get, _ in setters] == [1] * len(setters)
    assert [get() for get, _ in setters] == before


def test_cpu_providers_are_timed_in_interleaved_rounds():
    """On a CPU the providers of a case are timed in rounds, one call each, in an order shuffled
    every round (the machine's state falls on all alike, and no call always follows the same
    other one); a call that raises leaves the rounds with its error and the others go on to
    their own sample counts."""
    order = []

    def provider(name, fail_on=None):
        def call():
            order.append(name)
            if order.count(name) == fail_on:
                raise RuntimeError(f"{name} failed")
        return call

    results = bench.sample_interleaved([provider("a"), provider("b"), provider("c", fail_on=2)],
                                       budget_s=0.0)
    # a budget of 0: 3 samples each; c fails on its second call and leaves the rounds
    assert sorted(order[:3]) == sorted(order[3:6]) == ["a", "b", "c"] and sorted(order[6:]) == ["a", "b"]
    assert order.count("c") == 2 and order[:3] != order[3:6]  # (seeded: the same shuffles every run)
    assert isinstance(results[2], RuntimeError) and str(results[2]) == "c failed"
    for samples in results[:2]:
        median, p20, p80 = samples.summary()
        assert 0 <= p20 <= median <= p80 and sorted(samples.by_round) == [0, 1, 2]

    # run_case: every provider warmed up (first calls in provider order), then timed in rounds
    calls = []

    def make():
        return (torch.randn(4, 8),)

    def tracked(name):
        def fn(x):
            calls.append(name)
            return torch.softmax(x, -1)
        return fn

    case = bench.Case("softmax", "4x8", torch.float32, "fwd", make, bytes=2 * 4 * 8 * 4)
    rows = bench.run_case(case, {"p": tracked("p"), "q": tracked("q")}, "cpu", budget_s=0.0)
    assert calls[:2] == ["p", "q"] and all(r.ms for r in rows)
    assert all(sorted(calls[i:i + 2]) == ["p", "q"] for i in range(2, 6, 2))  # rounds: one call each


def test_paired_ratio_is_the_median_of_per_round_ratios():
    """A slowdown that hit rounds 3-6, where only the slower call still ran, moves a ratio of
    medians 5x; the per-round ratio over the rounds both ran does not move."""
    fast = bench.Samples({0: 1.0, 1: 1.0, 2: 1.0, 3: 5.0, 4: 5.0})
    slow = bench.Samples({0: 2.0, 1: 2.0, 2: 2.0, 3: 10.0, 4: 10.0, 5: 10.0, 6: 10.0})
    assert bench.paired_ratio(slow, fast) == 2.0 and bench.paired_ratio(fast, slow) == 0.5
    assert slow.summary()[0] / fast.summary()[0] == 10.0
    assert bench.paired_ratio(fast, bench.Samples({9: 1.0})) is None
    assert bench.paired_ratio(None, fast) is None


def test_speedups_are_taken_against_the_peer_fastest_in_paired_terms():
    """The peer of speedup_vs_torch is the fastest as the speedups judge it (paired ratios), so
    no peer reads a speedup over 1 against it: here "a" has the lower median (rounds 3-6 hit
    only "b", which ran longer), yet "b" is faster in every round both ran (CI, 2026-11-27:
    1.0146 against the lower median)."""
    a = bench.Samples({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    b = bench.Samples({0: 0.9, 1: 0.9, 2: 0.9, 3: 3.0, 4: 3.0, 5: 3.0, 6: 3.0})
    rows = [SimpleNamespace(provider=name, ms=samples.summary()[0])
            for name, samples in (("torch:a", a), ("torch:b", b))]
    assert rows[0].ms < rows[1].ms
    best = bench._fastest_peer(rows, {"torch:a": a, "torch:b": b})
    assert best.provider == "torch:b"
    assert max(bench.paired_ratio(b, s) for s in (a, b)) == 1.0
    assert bench._fastest_peer(rows, {}).provider == "torch:a"  # (a GPU: medians alone)
    assert bench._fastest_peer([], {}) is None


_FAULTS = """
import resource, torch
from fastattn import bench
print(bench.steady_cpu_allocator())
def rounds(k):
    for _ in range(k):  # tensors of 4, 8 and 12 MiB, freed out of order
        a = torch.ones(2**20); b = torch.ones(2**21); del a; c = torch.ones(3 * 2**20); del b, c
rounds(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_cpu_timings_do_not_pay_page_faults_of_reallocated_tensors():
    """bench.steady_cpu_allocator: a process that frees and reallocates large tensors (what every
    timed CPU call does) reuses its heap instead of faulting fresh pages in (with glibc's
    defaults this loop faults ~1000 pages a round: measured)."""
    out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "FASTATTN_NO_EXTENSION": "1"})
    assert out.returncode == 0, out.stderr
    policy, faults = out.stdout.split("\n")[:2]
    assert policy.startswith("glibc, mmap above")
    assert float(faults) < 250  # measured 0 in 15 runs (after one warm-up round: 0-103)


def test_a_rows_tuned_configs_survive_the_json(tmp_path):
    """``tuned`` (the autotuned configs a GPU Triton row ran) is written and read back."""
    row = bench.Result("attention", "1x2x64x64x16", "bfloat16", "fwd", "fastattn-triton", ms=0.5,
                       tuned={"attn_fwd_kernel": "128x64 w8s3"})
    path = str(tmp_path / "run.json")
    bench.write_json(path, [row, bench.Result("attention", "x", "bfloat16", "fwd", "naive")], {})
    results, _env = bench.load_json(path)
    assert results[0].tuned == {"attn_fwd_kernel": "128x64 w8s3"} and results[1].tuned is None
