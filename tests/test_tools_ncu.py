"""tools/ncu_compare.py reads Nsight Compute's source-page CSV export (one block per kernel) on any
machine; a hand-written two-kernel export checks its parsing and per-opcode sums."""

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
