"""tools/ptx_livethrough.py on a hand-written PTX body: the MMA loop found by its back edge, the registers carried
through it untouched (and not those the loop redefines, reads only before it, or that die before it), vector
destinations, predicated stores, a branch to a label outside the listing, and the exit status without such a loop."""

from conftest import load_tool

ptx_live = load_tool("ptx_livethrough")

WGMMA = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1, %f2}, %rd3, %rd4, p, 1, 1, 1;"
PTX = f"""
	ld.param.b64 	%rd1, [param_0];
	ld.param.b32 	%r1, [param_1];
	mov.u32 	%r2, %tid.x;
	and.b32 	%r3, %r2, 31;
	add.s32 	%r4, %r1, 16;
	mov.b32 	%r5, 0;
	ld.shared.v2.b32 	{{%r8, %r9}}, [%r4];
$L__BB0_1:
	add.s32 	%r5, %r5, 1;
	add.s32 	%r6, %r4, %r5;
	{WGMMA}
	{WGMMA}
	@%p1 st.shared.b32 	[%r6], %r3;
	setp.ne.b32 	%p1, %r5, 10;
	@%p1 bra 	$L__BB0_1;
	add.s64 	%rd2, %rd1, 8;
	st.global.b32 	[%rd2], %r5;
	st.global.b32 	[%rd2+4], %r9;
	@%p3 bra 	$L__BB0_9;
"""


def test_live_through_registers_of_the_mma_loop():
    lines = PTX.splitlines()
    loop = ptx_live.mma_loop(lines, 2)
    assert loop is not None and lines[loop[0]].startswith("$L__BB0_1") and "bra" in lines[loop[1]]
    through, invariant = ptx_live.live_through(lines, loop)
    # %rd1 and %r9 cross the loop untouched; %r5 is redefined in it, %r1 / %r2 die before it, %r3 / %r4 are only read
    # inside it (loop-invariant inputs, not live after)
    assert set(through) == {"%rd1", "%r9"}
    assert {"%r3", "%r4"} <= invariant and "%r5" not in invariant
    assert lines[through["%r9"]].strip().startswith("ld.shared.v2")


def test_defs_and_uses_of_one_line():
    assert ptx_live.defs_uses("\tadd.s32 \t%r6, %r4, %r5;") == ({"%r6"}, {"%r4", "%r5"})
    assert ptx_live.defs_uses("\t@%p1 st.shared.b32 \t[%r6], %r3;") == (set(), {"%p1", "%r6", "%r3"})
    assert ptx_live.defs_uses("\tld.shared.v2.b32 \t{%r8, %r9}, [%r4];") == ({"%r8", "%r9"}, {"%r4"})
    assert ptx_live.defs_uses("$L__BB0_1:") == (set(), set())
    assert ptx_live.defs_uses("\t// add.s32 %r1, %r2, 1;") == (set(), set())


def test_no_mma_loop_is_an_error(tmp_path, capsys):
    path = tmp_path / "k.ptx"
    path.write_text(PTX)
    assert ptx_live.main([str(path), "--min-mma", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 registers live through it (1 of them 64-bit)" in out and "%rd1" in out
    assert ptx_live.main([str(path), "--min-mma", "3"]) == 1
    assert "no loop with 3 or more wgmma.mma_async" in capsys.readouterr().err
