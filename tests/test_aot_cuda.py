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
              "fastattn::cuda::(anonymous namespace)::FwdCfg<128, 128, 64, true>, false, 98304>"
              "(fastattn::cuda::(anonymous namespace)::AttnParams)")
    base, args, smem = cuda.split_name("_ZN...", pretty)
    assert (base, args, smem) == ("attn_fwd_kernel", "Half,FwdCfg<128,128,64,1>,0", 98304)
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
    # the dense instances may not spill; the packed (varlen) ones a few words, as written
    assert cuda.rule_for("attn_fwd_kernel", "FwdCfg<128,128,64,1,1>,0").spill_budget == 0
    packed = cuda.rule_for("attn_bwd_dq_kernel", "BwdQCfg<128,64,64,1>,1")
    assert 0 < packed.spill_budget <= 64 and set(packed.required) == set(rule.required)
    assert cuda.rule_for("attn_bwd_dkdv_kernel", "BwdKVCfg<64,64,64>,1").spill_budget == 0


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


def test_gate_fails_sass_that_reads_a_uniform_register_never_written():
    """ptxas 12.8 (Triton 3.6's) built a pipelined forward whose P@V wgmma descriptor came from
    UR46:UR47, never written: on an H100 it read out of shared memory's range on some launches
    (2026-11-27). The lines below are that kernel's, shortened; writes by .64 and .WIDE ops
    define pairs, predicated writes count, and an HGMMA's first operand is read, not written."""
    from fastattn.aot.report import undefined_uniform_reads
    faulty = ("  /*0050*/ ULDC.64 UR44, c[0x0][0x240] ;\n"
              "  /*0110*/ UIMAD.WIDE.U32 UR4, UR8, UR44, URZ ;\n"
              "  /*0160*/ UIADD3 UR10, UR5, UR45, URZ ;\n"
              "  /*0170*/ @!UP0 USHF.L.U32 UR17, UR10, 0xb, URZ ;\n"
              "  /*0180*/ @!UP0 IMAD.U32 R3, RZ, RZ, UR17 ;\n"
              "  /*2f20*/ UIADD3 UR46, UP0, UR46, 0x20, URZ ;\n"
              "  /*2f70*/ UIADD3.X UR47, UR47, -0x3ffffff0, URZ, UP0, !UPT ;\n"
              "  /*95b0*/ HGMMA.64x16x16.F32.BF16 R56, R40, gdesc[UR44].tnspB, R56, gsb0 ;\n")
    assert undefined_uniform_reads(faulty) == ("UR8", "UR46", "UR47")
    fixed = "  /*0010*/ S2UR UR8, SR_CTAID.X ;\n" + faulty.replace(
        "UIADD3 UR46, UP0, UR46", "UIADD3 UR46, UP0, UR4").replace("UR47, UR47", "UR47, UR5")
    assert undefined_uniform_reads(fixed) == ()
    # a subroutine call (the CUDA softmax's 64-bit division) returns in registers it writes
    called = ("  /*0150*/ CALL.REL.NOINC 0x7f60 ;\n"
              "  /*0160*/ UIADD3 UR7, UP0, URZ, -UR9, URZ ;\n")
    assert undefined_uniform_reads(called) == ()
    assert undefined_uniform_reads(called.replace("CALL.REL.NOINC 0x7f60", "NOP")) == ("UR9",)
    row = Row(kernel="_attn_fwd_kernel", case="", undefined=undefined_uniform_reads(faulty))
    assert row.status == "FAIL" and "UR46" in row.problems[0]


def test_attention_kernels_must_fold_operand_addresses_into_ldmatrix():
    """Each ldmatrix of the attention kernels once computed its swizzled address (an OR, an XOR,
    a shift-add: 2.3-3.1 integer ops per ldmatrix around the mma); the split of
    cuda_layout.cuh's fragment_offset lets ptxas fold the block's part into the load. The
    lines are the D128 forward's, shortened."""
    from fastattn.aot.report import mma_address_ops
    folded = ("  /*0010*/ LOP3.LUT R13, R113, 0x10, RZ, 0x3c, !PT ;\n"
              "  /*0020*/ LEA R199, R199, UR4, 0x1 ;\n"
              "  /*0030*/ LDSM.16.M88.4 R180, [R199+0x9000] ;\n"
              "  /*0040*/ LDSM.16.M88.4 R92, [R199+0x8000] ;\n"
              "  /*0050*/ LDSM.16.M88.4 R176, [R199+0xa000] ;\n"
              "  /*0060*/ LDSM.16.M88.4 R172, [R199+0xb000] ;\n"
              "  /*0070*/ IMAD.MOV.U32 R23, RZ, RZ, R13 ;\n"
              "  /*0080*/ HMMA.16816.F32.BF16 R148, R40, R180, RZ ;\n"
              "  /*0090*/ HMMA.16816.F32.BF16 R100, R40, R92, RZ ;\n")
    assert mma_address_ops(folded) == 0.5  # the IMAD.MOV is a copy, not address arithmetic
    per_load = folded.replace("  /*0040*/", "  /*0038*/ LOP3.LUT R26, R24, 0x800, R3, 0xfe, !PT ;\n"
                              "  /*003a*/ LEA R160, R26, UR4, 0x1 ;\n"
                              "  /*003c*/ LOP3.LUT R24, R4, 0x4, R27, 0x1e, !PT ;\n"
                              "  /*003e*/ IMAD.SHL.U32 R24, R24, 0x8, RZ ;\n"
                              "  /*0040*/")
    per_load = per_load.replace("  /*0050*/", "  /*0048*/ LOP3.LUT R26, R3, R24, RZ, 0xfc, !PT ;\n"
                                "  /*004a*/ LEA R124, R26, UR4, 0x1 ;\n  /*0050*/")
    assert mma_address_ops(per_load) == 2.0
    assert mma_address_ops("  /*0010*/ LDSM.16.M88.4 R180, [R199] ;\n") is None  # no mma
    for kernel in ("attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"):
        rule = cuda.rule_for(kernel)
        ok, bad = (Row(kernel=kernel, case="", addr_ops=mma_address_ops(sass), max_addr_ops=rule.max_addr_ops)
                   for sass in (folded, per_load))
        assert ok.status == "ok" and bad.status == "FAIL" and "per ldmatrix" in bad.problems[0]
    assert cuda.rule_for("softmax_fwd_block_kernel").max_addr_ops is None
