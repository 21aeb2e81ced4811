"""Compile stage, end to end on the CPU: a tiny Hopper WGMMA GEMM through compile_kernel.

One CTA of one warpgroup computes a 64x64 tile of C = A·Bᵀ (fp16 in, fp32 out, K = 64),
with A's row count symbolic. It is compiled for sm_90a with no GPU, cached, inspected
(HGMMA in the SASS, registers from the cubin), reloaded from the cache, and rebuilt after
the cached object is corrupted. The SASS summarizer is also tested on hand-written text.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fa4gen.compile import aot
from fa4gen.compile.cache import DiskCache, FA4GenCacheWarning, cache_key
from fa4gen.compile.elf import cubin_arch, extract_cubins, kernel_resources
from fa4gen.compile.sass import NvdisasmNotFoundError, disassemble, find_nvdisasm, summarize_sass

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402
from cutlass.tensor_utils.layout import LayoutEnum  # noqa: E402

TILE_MNK = (64, 64, 64)
THREADS = 128


@cute.kernel
def _gemm_tile_kernel(
    mA: cute.Tensor,
    mB: cute.Tensor,
    mC: cute.Tensor,
    tiled_mma: cute.TiledMma,
    sA_layout: cute.ComposedLayout,
    sB_layout: cute.ComposedLayout,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    smem = SmemAllocator()
    sA = smem.allocate_tensor(cutlass.Float16, sA_layout.outer, 1024, swizzle=sA_layout.inner)
    sB = smem.allocate_tensor(cutlass.Float16, sB_layout.outer, 1024, swizzle=sB_layout.inner)
    gA = cute.local_tile(mA, (TILE_MNK[0], TILE_MNK[2]), (bidx, 0))
    gC = cute.local_tile(mC, (TILE_MNK[0], TILE_MNK[1]), (bidx, 0))
    # Plain loads into the swizzled smem tiles; the test is about the MMA, not the copy.
    for i in cutlass.range(tidx, TILE_MNK[0] * TILE_MNK[2], THREADS):
        row, col = i // TILE_MNK[2], i % TILE_MNK[2]
        sA[row, col, 0] = gA[row, col]
        sB[row, col, 0] = mB[row, col]
    # Generic-proxy smem writes must be visible to the async proxy WGMMA reads through.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()

    thr_mma = tiled_mma.get_slice(tidx)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    tCgC = thr_mma.partition_C(gC)
    tCrC = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
    # C = A·Bᵀ over the K blocks of one tile
    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
    warpgroup.fence()
    for k_block in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, tCrC, tCrA[None, None, k_block, 0], tCrB[None, None, k_block, 0], tCrC)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    for i in cutlass.range_constexpr(cute.size(tCrC)):
        tCgC[i] = tCrC[i]


@cute.jit
def _gemm_tile(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.Float16,
        cutlass.Float16,
        OperandMajorMode.K,
        OperandMajorMode.K,
        cutlass.Float32,
        (1, 1, 1),
        tiler_mn=TILE_MNK[:2],
    )
    sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, TILE_MNK, cutlass.Float16, 1)
    sB_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, TILE_MNK, cutlass.Float16, 1)
    _gemm_tile_kernel(mA, mB, mC, tiled_mma, sA_layout, sB_layout).launch(
        grid=(cute.ceil_div(mA.shape[0], TILE_MNK[0]), 1, 1), block=(THREADS, 1, 1), stream=stream
    )


@cute.kernel
def _add_kernel(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    if i < mA.shape[0]:
        mC[i] = mA[i] + mB[i]


@cute.jit
def _add(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
    _add_kernel(mA, mB, mC).launch(
        grid=(cute.ceil_div(mA.shape[0], THREADS), 1, 1), block=(THREADS, 1, 1), stream=stream
    )


def _build_gemm():
    m = cute.sym_int()
    a = make_fake_compact_tensor(cutlass.Float16, (m, 64), stride_order=(1, 0), assumed_align=16)
    b = make_fake_compact_tensor(cutlass.Float16, (64, 64), stride_order=(1, 0), assumed_align=16)
    c = make_fake_compact_tensor(cutlass.Float32, (m, 64), stride_order=(1, 0), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_gemm_tile, a, b, c, stream, options="--enable-tvm-ffi")


def _build_add():
    n = cute.sym_int()
    a, b, c = (make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) for _ in range(3))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_add, a, b, c, stream, options="--enable-tvm-ffi")


def _build_add_exported_only():
    n = cute.sym_int()
    a, b, c = (make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) for _ in range(3))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_add, a, b, c, stream, options="--enable-tvm-ffi", no_jit_engine=True)


def _key(arch: str, tag: str) -> str:
    return cache_key(source=f"test_sass:{tag}", helper_sources={}, arch=arch, options={"tag": tag})


needs_nvdisasm = pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")


needs_cc = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler")


@pytest.mark.compile
@needs_cc
def test_a_miss_without_a_jit_engine_returns_the_exported_kernel(tmp_path, monkeypatch):
    """Compiled with no_jit_engine (what fa4gen's kernels do: the host code is generated once, for the export),
    a miss's function is the exported kernel: the stored shared library loaded as a hit loads it, or, when
    nothing is stored, the object JIT-linked. A build_fn with a JIT engine keeps its own function."""
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    cache, key = DiskCache(), _key("sm_90a", "add_exported_only")
    stored = aot.compile_kernel(build_fn=_build_add_exported_only, arch="sm_90a", name="add", cache=cache, key=key,
                                keep_sass=False)
    assert not stored.cache_hit and type(stored.function).__name__ == "Function"  # tvm_ffi's, from the .so
    assert aot.SHARED_FILE in cache.get(key).meta["files"]
    unstored = aot.compile_kernel(build_fn=_build_add_exported_only, arch="sm_90a", name="add", cache=None,
                                  key=None, keep_sass=False)
    assert getattr(unstored.function, "engine", "none") == "none" and callable(unstored.function)  # JIT-linked
    with_engine = aot.compile_kernel(build_fn=_build_add, arch="sm_90a", name="add", cache=None, key=None,
                                     keep_sass=False)
    assert with_engine.function.engine is not None


@pytest.mark.compile
@needs_cc
def test_cache_hit_loads_the_shared_library_without_cutlass(tmp_path, monkeypatch):
    """A miss stores the object linked as a shared library (and the runtime libraries it needs); a
    fresh process loads a hit through tvm_ffi without importing cutlass. A shared library that does
    not load falls back to JIT-linking the object, with a warning."""
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    cache, key = DiskCache(), _key("sm_90a", "add_shared")
    first = aot.compile_kernel(build_fn=_build_add, arch="sm_90a", name="add", cache=cache, key=key, keep_sass=False)
    entry = cache.get(key)
    assert aot.SHARED_FILE in entry.meta["files"] and entry.meta["runtime_libs"]
    assert all(Path(lib).is_file() for lib in entry.meta["runtime_libs"])
    assert not first.cache_hit
    child = (
        "import sys, time, torch\n"
        "from pathlib import Path\n"
        "from fa4gen.compile import aot\n"
        "from fa4gen.compile.cache import DiskCache\n"
        f"entry = DiskCache(Path({str(tmp_path / 'cache')!r})).get({key!r})\n"
        "t = time.perf_counter(); fn = aot.load_cached(entry); ms = (time.perf_counter() - t) * 1e3\n"
        "print(type(fn).__name__, 'cutlass' in sys.modules, f'{ms:.1f}')\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    kind, imported, ms = out.stdout.split()
    print(f"shared-library load in a fresh process (torch imported): {ms} ms")
    assert (kind, imported) == ("Function", "False")
    # a broken (but recorded) shared library: the object is JIT-linked instead
    cache.put(key, entry.artifact_path.read_bytes(), {**entry.meta}, extras={aot.SHARED_FILE: b"not a library"})
    with pytest.warns(FA4GenCacheWarning, match="shared library does not load"):
        assert callable(aot.load_cached(cache.get(key)))


@pytest.mark.compile
@needs_nvdisasm
def test_compile_cache_hit_and_rebuild(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    cache, key, builds = DiskCache(), _key("sm_90a", "gemm"), []

    def build():
        builds.append(1)
        return _build_gemm()

    start = time.perf_counter()
    first = aot.compile_kernel(build_fn=build, arch="sm_90a", name="gemm_tile", cache=cache, key=key, keep_sass=True)
    print(f"compile_kernel miss: {time.perf_counter() - start:.2f} s (build_fn {first.seconds:.2f} s)")
    assert not first.cache_hit and builds == [1]
    assert cache.root == tmp_path / "cache"
    sass = first.meta["sass"]
    assert sass["total"] > 0 and sass["hgmma"] >= 4  # K = 64 is four k16 WGMMAs
    assert sass["ldl"] == sass["stl"] == 0
    assert first.meta["registers"] > 0 and first.meta["cubin_arch"] == "sm_90a"
    assert first.meta["spill_stores"] == 0 and first.meta["smem_dynamic"] is None
    assert "HGMMA.64x64x16.F32" in first.sass_text
    assert callable(first.function)

    start = time.perf_counter()
    second = aot.compile_kernel(build_fn=build, arch="sm_90a", name="gemm_tile", cache=cache, key=key, keep_sass=True)
    print(f"compile_kernel hit: {time.perf_counter() - start:.2f} s")
    assert second.cache_hit and builds == [1]
    assert callable(second.function)
    assert second.meta["registers"] == first.meta["registers"]
    assert second.meta["sass"] == sass and second.sass_text == first.sass_text

    entry = cache.get(key)
    entry.artifact_path.write_bytes(b"not an object file")
    with pytest.warns(FA4GenCacheWarning, match="rebuilding"):
        assert cache.get(key) is None
    third = aot.compile_kernel(build_fn=build, arch="sm_90a", name="gemm_tile", cache=cache, key=key, keep_sass=False)
    assert not third.cache_hit and builds == [1, 1]
    assert "sass" not in third.meta and third.meta["spill_stores"] is None
    assert cache.get(key).meta["registers"] == first.meta["registers"]

    # A hit that asks for SASS the entry lacks computes it from the stored cubin.
    fourth = aot.compile_kernel(build_fn=build, arch="sm_90a", name="gemm_tile", cache=cache, key=key, keep_sass=True)
    assert fourth.cache_hit and builds == [1, 1]
    assert fourth.meta["sass"]["hgmma"] == sass["hgmma"]
    assert "sass" in cache.get(key).meta

    # An intact entry whose object will not link is rebuilt too.
    cache.put(key, b"garbage", {**fourth.meta})
    with pytest.warns(FA4GenCacheWarning, match="does not load.*rebuilding"):
        fifth = aot.compile_kernel(build_fn=build, arch="sm_90a", name="gemm_tile", cache=cache, key=key, keep_sass=False)
    assert not fifth.cache_hit and builds == [1, 1, 1]


@pytest.mark.compile
@needs_nvdisasm
def test_arch_switch_in_process_and_restore(tmp_path):
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    before = vars(envar).get("_arch")
    results = {
        arch: aot.compile_kernel(build_fn=_build_add, arch=arch, name="add", cache=None, key=None, keep_sass=True)
        for arch in ("sm_100a", "sm_90a")
    }
    assert vars(envar).get("_arch") == before
    assert results["sm_100a"].meta["cubin_arch"] == "sm_100a"
    assert results["sm_90a"].meta["cubin_arch"] == "sm_90a"
    for result in results.values():
        assert result.meta["sass"]["full_opcodes"].get("FADD") == 1
        assert result.meta["registers"] > 0

    obj = tmp_path / "add.o"
    aot.export_object(results["sm_90a"].function, obj)
    (cubin,) = extract_cubins(obj.read_bytes())
    assert cubin_arch(cubin) == "sm_90a"
    (kernel,) = kernel_resources(cubin)["functions"].values()
    assert kernel["entry"] and kernel["reqntid"] == [THREADS, 1, 1]
    assert summarize_sass(disassemble(cubin)).total == results["sm_90a"].meta["sass"]["total"]


def test_compile_kernel_rejects_bad_arch():
    with pytest.raises(ValueError, match="sm_90a"):
        aot.compile_kernel(build_fn=lambda: None, arch="hopper", name="x", cache=None, key=None, keep_sass=False)


def test_disassemble_without_nvdisasm(monkeypatch):
    monkeypatch.setattr("fa4gen.compile.sass.find_nvdisasm", lambda: None)
    with pytest.raises(NvdisasmNotFoundError, match="nvidia-cuda-nvdisasm"):
        disassemble(b"\x7fELF")


_SASS = """
//--------------------- .text.kernel_a --------------------------
\t.section\t.text.kernel_a,"ax",@progbits
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
        /*0010*/               @P0 MUFU.EX2 R4, R4 ;
        /*0020*/              @!PT MUFU.EX2 R5, R5 ;
        /*0030*/                   MUFU.RCP R6, R6 ;
        /*0040*/                   FFMA R2, R3, R4, R5 ;
        /*0050*/                   FFMA2 R2, R3.F32x2.HI_LO, R4.F32, R6 ;
        /*0060*/             @!UP0 UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT ;
        /*0070*/                   UTCQMMA.2CTA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT ;
        /*0080*/                   UTCHMMA.2CTA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT ;
        /*0090*/                   LDTM.x16 R8, tmem[UR4] ;
        /*00a0*/                   STTM.x16 tmem[UR4], R8 ;
        /*00b0*/                   UTMALDG.2D [UR8], [UR4] ;
        /*00c0*/                   UTMASTG.2D [UR4], [UR8] ;
        /*00d0*/                   SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4+0x10], RZ ;
        /*00e0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00f0*/                   STL [R1], R2 ;
        /*0100*/                   LDL R2, [R1] ;
        /*0110*/                   HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ, !UPT ;
.L_x_0:
        /*0120*/                   BRA `(.L_x_0);
        /*0130*/                   NOP;
"""


def test_summarize_sass_counts():
    s = summarize_sass(_SASS)
    assert s.kernels == ("kernel_a",)
    assert s.total == 20
    assert (s.mufu_ex2, s.ffma, s.ffma2, s.utchmma, s.ldtm, s.sttm) == (2, 1, 1, 3, 1, 1)
    assert (s.utmaldg, s.utmastg, s.bar, s.ldl, s.stl, s.hgmma) == (1, 1, 2, 1, 1, 1)
    assert s.opcodes["MUFU"] == 3 and s.full_opcodes["MUFU.EX2"] == 2 and s.full_opcodes["MUFU.RCP"] == 1
    assert s.full_opcodes["UTCHMMA.2CTA"] == 1 and s.opcodes["UTCHMMA"] == 2
    assert list(s.opcodes)[0] == "MUFU"  # sorted by count
    d = s.to_dict()
    assert d["kernels"] == ["kernel_a"] and d["opcodes"] == s.opcodes
    assert type(s).from_dict(d) == s


def test_summarize_empty():
    s = summarize_sass("")
    assert s.total == 0 and s.opcodes == {} and s.kernels == ()


def _line(addr: int, text: str) -> str:
    """One instruction line as nvdisasm lists it (for hand-made listings)."""
    return f"        /*{addr:04x}*/                   {text} ;"


def test_spills_in_mma_loops_counts_only_the_main_loop():
    """The backward's golden SASS rule: spills around the loops are tolerated, none inside a loop
    whose body issues one iteration's MMAs (out-of-line wait loops that branch back across the main
    loop hold a different MMA count and are not main loops)."""
    from fa4gen.compile.sass import mma_loops, spills_in_mma_loops

    sass = "\n".join([
        _line(0x00, "STL [R1], R3"),  # before the loop: tolerated
        ".L_x_1:",
        _line(0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"),
        _line(0x20, "LDL R5, [R1]"),  # inside: counted
        _line(0x30, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24"),
        _line(0x40, "@P0 BRA `(.L_x_1)"),
        _line(0x50, "LDL R6, [R1]"),  # after: tolerated
        _line(0x60, "EXIT"),
    ])
    assert len(mma_loops(sass, 2)) == 1 and mma_loops(sass, 3) == []
    assert spills_in_mma_loops(sass, 2) == 1
    assert spills_in_mma_loops(sass.replace("LDL R5, [R1]", "IADD3 R5, R5, 1, RZ"), 2) == 0


def test_loops_can_leave_out_the_jump_back_of_an_out_of_line_wait():
    """A consumer wait that polls first (fa4gen/device/sm90.py TryFirstTmaPipeline) moves the hinted retry of a
    missed mbarrier wait out of line, after the loop; its jump back into the loop body closes a backward-branch
    region that `loops` reports (the listing between them, no iteration): `wait_returns=False` leaves it out and
    keeps the loop itself, whose closing branch is conditional."""
    from fa4gen.compile.sass import loops, wait_return

    sass = "\n".join([
        ".L_x_1:",
        _line(0x10, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ+0x10], R15"),
        _line(0x20, "@!P0 BRA `(.L_x_9)"),
        ".L_x_2:",
        _line(0x30, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"),
        _line(0x40, "@P1 BRA `(.L_x_1)"),
        _line(0x50, "EXIT"),
        ".L_x_9:",
        _line(0x60, "@!P0 NANOSLEEP.SYNCS 0x989680"),
        _line(0x70, "@!P0 SYNCS.PHASECHK.TRANS64 P0, [R8+URZ+0x10], R15"),
        _line(0x80, "@!P0 BRA `(.L_x_9)"),
        _line(0x90, "BRA `(.L_x_2)"),
    ])
    found = loops(sass)
    assert [wait_return(b) for b in found] == [False, False, True]  # the loop, the retry, the jump back
    kept = loops(sass, wait_returns=False)
    assert len(kept) == 2 and kept[0] == found[0] and not any(wait_return(b) for b in kept)


def test_sass_loops_tool_counts_opcodes_per_loop():
    """tools/sass_loops.py --ops: opcodes without modifiers or predicates, per listed loop."""
    from conftest import load_tool

    tool = load_tool("sass_loops")

    sass = "\n".join([
        ".L_x_1:",
        _line(0x10, "UMOV UR17, 0x40000040"),
        _line(0x20, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT"),
        _line(0x30, "@!P0 NANOSLEEP.SYNCS 0x989680"),
        _line(0x40, "UMOV UR19, 0x40000040"),
        _line(0x50, "@P0 BRA `(.L_x_1)"),
        _line(0x60, "EXIT"),
    ])
    assert tool.loop_rows(sass) == [(5, 1, 0, 0)]
    (ops,) = tool.loop_ops(sass)
    assert ops == {"UMOV": 2, "HGMMA": 1, "NANOSLEEP": 1, "BRA": 1}
    assert tool.loop_ops(sass, min_mma=2) == []


def _hex_pair(addr: int, text: str, stall: int, other_bits: int = 0x000FE00000000800) -> list[str]:
    """One instruction as `nvdisasm -hex` lists it: the low encoding word on the instruction's line, the high word
    (stall count in bits 41-44, here among other control bits) on a comment line of its own."""
    high = (other_bits & ~(0xF << 41)) | (stall << 41)
    return [f"        /*{addr:04x}*/                   {text} ;                  /* 0x000000b800b87308 */",
            f"                                                                 /* 0x{high:016x} */"]


def test_stall_counts_come_from_the_high_word_and_sum_per_loop():
    """fa4gen.compile.sass.with_stall_counts reads bits 41-44 of each instruction's second encoding word (the stall
    count of the Volta-and-later control field; session 60 read 8 on back-to-back MUFU.EX2); tools/sass_loops.py
    --cycles sums them per loop and over its MUFU.EX2 stream."""
    from conftest import load_tool

    from fa4gen.compile.sass import issue_cycles, loops, with_stall_counts

    listing = "\n".join([
        ".L_x_1:",
        *_hex_pair(0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT", 1),
        *_hex_pair(0x20, "FFMA R4, R4, UR4, -R5", 1),
        *_hex_pair(0x30, "MUFU.EX2 R4, R4", 8),
        *_hex_pair(0x40, "MUFU.EX2 R6, R6", 1),
        *_hex_pair(0x50, "F2FP.BF16.F32.PACK_AB R8, R6, R4", 7),
        *_hex_pair(0x60, "MUFU.EX2 R7, R7", 15),
        *_hex_pair(0x70, "@P0 BRA `(.L_x_1)", 5),
        *_hex_pair(0x80, "EXIT", 0),
    ])
    text = with_stall_counts(listing)
    assert "0x000fe" not in text and text.count("/* stall ") == 8  # one line per instruction, the words dropped
    assert "MUFU.EX2 R4, R4 ; /* stall 8 */" in text
    (body,) = loops(text)
    assert issue_cycles(body) == 1 + 1 + 8 + 1 + 7 + 15 + 5
    tool = load_tool("sass_loops")
    assert tool.loop_rows(text) == [(7, 1, 3, 0)]  # the listing still reads as disassemble's
    (line,) = tool.loop_cycles(text)
    assert "38 issue cycles" in line and "3 MUFU.EX2 over 31 cycles / 4 instructions" in line
    (by_op,) = tool.loop_op_cycles(text)  # per base opcode, predicates and modifiers dropped
    assert by_op == {"HGMMA": 1, "FFMA": 1, "MUFU": 8 + 1 + 15, "F2FP": 7, "BRA": 5}
    line, ops_line = tool.loop_cycles(text, ops=2)
    assert "38 issue cycles" in line and ops_line.split("cycles: ")[1] == "MUFU 24, F2FP 7"


@pytest.mark.compile
@needs_nvdisasm
def test_disassemble_with_control_lists_every_instruction_once(tmp_path, monkeypatch):
    """The control listing of a real sm_90a cubin holds the same instructions as the plain one, each with a stall
    count in 0..15, some of them nonzero."""
    import re

    from fa4gen.compile.sass import disassemble_with_control, instruction_lines

    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    result = aot.compile_kernel(build_fn=_build_gemm, arch="sm_90a", name="gemm_tile", cache=DiskCache(),
                                key=_key("sm_90a", "control"), keep_sass=False)
    (cubin,) = extract_cubins(DiskCache().get(result.key).artifact_path.read_bytes())
    plain, control = disassemble(cubin), disassemble_with_control(cubin)
    stalls = [int(s) for s in re.findall(r"/\* stall (\d+) \*/", control)]
    assert instruction_lines(control) == instruction_lines(plain)
    assert len(stalls) == len(instruction_lines(plain)) and all(0 <= s <= 15 for s in stalls) and max(stalls) > 1
