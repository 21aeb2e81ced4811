"""tools/ncu_compare.py reads Nsight Compute's source-page CSV export (one block per kernel) and its details-page
text on any machine; hand-written two-kernel exports check the parsing, the per-opcode sums and the cycle table."""

import pytest
from conftest import load_tool

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"L1 Wavefronts Shared","L1 Wavefronts Shared Ideal","stall_barrier","stall_long_sb",'
          '"stall_barrier (Not Issued)"')


def _tool():
    return load_tool("ncu_compare")


def _block(name, rows):
    return "\n".join([f'"Kernel Name","{name}"', HEADER] + [",".join(f'"{c}"' for c in r) for r in rows])


def test_ncu_compare_sums_per_opcode_and_per_iteration():
    tool = _tool()
    text = "==PROF== noise\n" + _block("ours", [
        ("0x10", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ", "30", "100", "800", "800", "30", "0", "9"),
        ("0x20", "      UMOV UR17, 0x40000040", "2", "100", "0", "0", "0", "2", "0"),
        ("0x30", "@P0   STS.64 [R219], R152", "8", "50", "400", "200", "0", "8", "0"),
        ("0x40", "      EXIT", "0", "1", "0", "0", "0", "0", "0"),
    ]) + "\n" + _block("theirs", [
        ("0x10", "      HGMMA.64x80x16.F32.BF16 R24, gdesc[UR8], RZ", "5", "80", "640", "640", "5", "0", "0"),
    ])
    (ours, rows), (theirs, _) = tool.kernels(text)
    assert (ours, theirs, len(rows)) == ("ours", "theirs", 4)
    assert [tool.opcode(r["Source"]) for r in rows] == ["HGMMA", "UMOV", "STS", "EXIT"]
    out = tool.report(ours, rows, top=10)
    assert "instructions executed 251, stall samples 40" in out
    assert "STS" in out and "smem wavefronts 400 (ideal 200)" in out
    # per iteration: the 100x HGMMA and UMOV, and the STS run half as often (a per-warpgroup branch)
    assert "one hot-loop iteration per warp: 2 instructions: HGMMA 1, UMOV 1, STS 0" in out
    assert "barrier 75.0%, long_sb 25.0%" in out
    # the 100x HGMMA and UMOV form one group (32 of 40 samples), the 50x STS another, the 1x EXIT a third
    assert tool.by_count(rows) == [(100.0, (2, 32.0, 200.0)), (50.0, (1, 8.0, 50.0)), (1.0, (1, 0.0, 1.0))]
    assert "x100           2 instructions   80.0% of stall samples,  79.7% of instructions executed" in out


DETAILS = """[507] python3.12@127.0.0.1
  kernel_cutlass_kernel_ours_FlashBwdSm90_1 (8, 16, 16)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    SM Frequency                    Ghz         1.75
    Elapsed Cycles                cycle    1,076,365
    DRAM Throughput                   %        25.57
    Duration                         us       609.86
    L2 Cache Throughput               %        78.40
    SM Active Cycles              cycle 1,046,385.94
    Compute (SM) Throughput           %        63.31
    Section: Launch Statistics
    Block Size                                                   384
    Registers Per Thread             register/thread             168
  theirs_bwd (16, 16, 8)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    SM Frequency                    Ghz         1.69
    Elapsed Cycles                cycle    1,046,954
    Duration                         ms         0.61
    DRAM Throughput                   %        32.21
"""


def test_ncu_compare_details_reads_cycles_and_clocks(tmp_path, capsys):
    """The details page: per kernel its fields (a unit-less row skipped, a duration in ms turned into µs), and the
    table's cycles over the first kernel's — the comparison that holds when the two ran at different clocks."""
    tool = _tool()
    found = tool.details(DETAILS)
    assert [name for name, _ in found] == ["kernel_cutlass_kernel_ours_FlashBwdSm90_1", "theirs_bwd"]
    assert found[0][1] == {"sm_ghz": 1.75, "cycles": 1076365.0, "dram_pct": 25.57, "duration": 609.86,
                           "l2_pct": 78.4, "compute_pct": 63.31, "registers": 168.0, "active_cycles": 1046385.94}
    assert found[1][1] == {"sm_ghz": 1.69, "cycles": 1046954.0, "duration": 610.0, "dram_pct": 32.21}
    table = tool.details_table(found)
    # SM-active cycles (their row's value follows the unit after one space) and the idle share they imply
    assert "| ours_FlashBwdSm90_1 | 609.86 | 1.75 | 1,076,365 | 1.000 | 1,046,386 | 2.8% | 25.6 | 78.4 | 63.3 | 168 |" in table
    assert "| theirs_bwd | 610.00 | 1.69 | 1,046,954 | 0.973 | - | - | 32.2 | - | - | - |" in table
    path = tmp_path / "details.txt"
    path.write_text(DETAILS)
    assert tool.main(["--details", str(path)]) == 0
    assert "0.973" in capsys.readouterr().out
    # the same file xz-compressed, as docs/perf keeps exports
    import lzma
    packed = tmp_path / "details.txt.xz"
    packed.write_bytes(lzma.compress(DETAILS.encode("utf-8")))
    assert tool.main(["--details", str(packed)]) == 0
    assert "| 2.8% |" in capsys.readouterr().out
    # no kernel in the file, or no file at all: a usage error naming what was expected
    empty = tmp_path / "empty.txt"
    empty.write_text("==PROF== nothing profiled\n")
    with pytest.raises(SystemExit) as err:
        tool.main(["--details", str(empty)])
    assert err.value.code == 2 and "expected `ncu -i" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        tool.main([])
    assert err.value.code == 2 and "give a source-page CSV export" in capsys.readouterr().err


def test_ncu_compare_stall_ops_sums_one_reason_by_opcode(tmp_path, capsys):
    """--stall-ops REASON: that reason's samples by opcode, as shares of all the kernel's samples; an unknown reason
    is a usage error naming the reasons the export has."""
    tool = _tool()
    rows = tool.kernels(_block("ours", [
        ("0x10", "      MUFU.EX2 R4, R4", "10", "100", "0", "0", "6", "4", "0"),
        ("0x20", "      MUFU.EX2 R5, R5", "10", "100", "0", "0", "2", "8", "0"),
        ("0x30", "@P0   STS.64 [R219], R152", "20", "50", "0", "0", "1", "19", "0"),
    ]))[0][1]
    line = tool.stall_ops(rows, "long_sb")
    assert line == "  long_sb stalls 77.5% of samples, by opcode: STS 47.50%, MUFU 30.00%"
    assert tool.stall_ops(rows, "barrier") == "  barrier stalls 22.5% of samples, by opcode: MUFU 20.00%, STS 2.50%"
    with pytest.raises(SystemExit, match="no stall reason 'wait'.*barrier, long_sb"):
        tool.stall_ops(rows, "wait")
    path = tmp_path / "src.csv"
    path.write_text(_block("ours", [("0x10", "      MUFU.EX2 R4, R4", "10", "100", "0", "0", "6", "4", "0")]))
    assert tool.main([str(path), "--stall-ops", "barrier"]) == 0
    assert "barrier stalls 60.0% of samples, by opcode: MUFU 60.00%" in capsys.readouterr().out


def test_ncu_compare_puts_each_opcodes_stall_samples_side_by_side(capsys, tmp_path):
    tool = _tool()
    text = _block("kernel_cutlass_kernel_ours", [
        ("0x10", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ", "30", "100", "0", "0", "30", "0", "0"),
        ("0x20", "      F2FP.BF16.F32.PACK_AB R120, R25, R24", "10", "100", "0", "0", "0", "10", "0"),
    ]) + "\n" + _block("theirs", [
        ("0x10", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ", "28", "100", "0", "0", "28", "0", "0"),
        ("0x20", "      F2FP.BF16.F32.PACK_AB R148, R25, R24", "2", "100", "0", "0", "0", "2", "0"),
        ("0x30", "      BRA 0x10", "4", "100", "0", "0", "0", "4", "0"),
    ])
    table = tool.opcode_deltas(tool.kernels(text), top=10)
    lines = table.splitlines()
    # shares of the first kernel's 40 samples; F2FP differs most (+20.0%), then BRA (-10.0%), then HGMMA (+5.0%)
    assert lines[0] == "k1 = ours" and lines[1] == "k2 = theirs"
    assert lines[5] == "| (all) | 100.0% | 85.0% | +15.0% |"
    assert lines[6:] == ["| F2FP | 25.0% | 5.0% | +20.0% |", "| BRA | 0.0% | 10.0% | -10.0% |",
                         "| HGMMA | 75.0% | 70.0% | +5.0% |"]
    # the command prints it after the per-kernel reports, and only with two kernels or more
    path = tmp_path / "two.csv"
    path.write_text(text)
    assert tool.main([str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("| HGMMA | 75.0% | 70.0% | +5.0% |")
    path.write_text(text.split("\n\"Kernel Name\",\"theirs\"")[0])
    assert tool.main([str(path)]) == 0
    assert "by opcode, as shares" not in capsys.readouterr().out
