"""The CUDA half of the compile gate (fastattn/aot/cuda.py): its readers, without running nvcc
(``make check-cuda`` runs the real build)."""

from __future__ import annotations

import os

from fastattn.aot import cuda
from fastattn.aot.report import Row

LOG = """\
ptxas info    : Compiling entry function '_Z3fooILi1EEvv' for 'sm_80'
ptxas info    : Function properties for _Z3fooILi1EEvv
    8 bytes stack frame, 8 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 256 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3fooILi1EEvv' for 'sm_90a'
ptxas info    : Function properties for _Z3fooILi1EEvv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 90 registers, used 1 barriers, 512 bytes smem, 400 bytes cmem[0]
"""


def test_ptxas_report_is_taken_from_the_sm90a_build_only():
    from fastattn.aot.report import parse_ptxas

    got = parse_ptxas(cuda.ptxas_for_arch(LOG, "sm_90a"))
    assert got == {"_Z3fooILi1EEvv": {"regs": 90, "spill_stores": 0, "spill_loads": 0, "smem": 512}}
    got80 = parse_ptxas(cuda.ptxas_for_arch(LOG, "sm_80"))
    assert got80["_Z3fooILi1EEvv"]["spill_loads"] == 20


def test_setup_flags_are_the_ones_setup_py_builds_with():
    flags = cuda.setup_nvcc_flags()
    for flag in ("--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr", "-O3"):
        assert flag in flags
    with open(os.path.join(cuda.ROOT, "setup.py")) as f:
        text = f.read()
    # setup.py takes its nvcc flags from the same constant (loaded from fastattn/extending.py)
    assert "nvcc = list(flags.DEFAULT_CUDA_CFLAGS)" in text and '"fastattn", "extending.py"' in text


def test_attention_symbols_carry_their_dynamic_shared_memory():
    pretty = ("void fastattn::cuda::(anonymous namespace)::attn_fwd_kernel<c10::Half, "
              "fastattn::cuda::(anonymous namespace)::FwdCfg<128, 128, 64, true>, 98304>"
              "(fastattn::cuda::(anonymous namespace)::AttnParams)")
    base, args, smem = cuda.split_name("_ZN...", pretty)
    assert (base, args, smem) == ("attn_fwd_kernel", "Half,FwdCfg<128,128,64,1>", 98304)
    base, args, smem = cuda.split_name("_Z", "void fastattn::cuda::(anonymous namespace)::"
                                       "softmax_fwd_warp_kernel<float, 4, 8>(FwdParams)")
    assert (base, args, smem) == ("softmax_fwd_warp_kernel", "float,4,8", 0)


def test_attention_kernels_must_use_ldmatrix_cp_async_and_mma():
    rule = cuda.rule_for("attn_fwd_kernel")
    assert set(rule.required) == {"ldmatrix", "cp.async", "mma"}
    row = Row(kernel="attn_fwd_kernel", case="", features=("mma",), required=rule.required)
    assert row.status == "FAIL" and "ldmatrix" in row.problems[0]
    assert cuda.rule_for("rope_kernel").spill_budget == 0
    assert all(r.reason for r in cuda.KERNEL_RULES if r.spill_budget), "a budget needs a reason"


def test_ffn_activation_kernels_must_not_use_tanh_approx():
    """--use_fast_math makes tanhf MUFU.TANH (relative error ~2^-11): float32 FFN gradients came
    out 2-8x less accurate than torch's on the first GPU run. The gate reads the opcode with its
    modifiers, so MUFU.TANH is told apart from the MUFU.EX2 that exp needs."""
    from fastattn.aot.report import sass_features
    sass = ("        /*0120*/                   MUFU.TANH R5, R4 ;\n"
            "        /*0130*/                   MUFU.EX2 R6, R4 ;\n"
            "        /*0140*/              @!P0 LDSM.16.M88.4 R8, [R2] ;\n")
    assert sass_features(sass) == ("ldmatrix", "tanh.approx")
    assert sass_features(sass.replace("MUFU.TANH", "MUFU.RCP")) == ("ldmatrix",)
    for kernel in ("act_fwd_kernel", "act_bwd_kernel"):
        rule = cuda.rule_for(kernel)
        row = Row(kernel=kernel, case="", features=sass_features(sass), forbidden=rule.forbidden)
        assert row.status == "FAIL" and "tanh.approx" in row.problems[0]
    assert "tanh.approx" not in cuda.rule_for("softmax_fwd_block_kernel").forbidden
