"""tools/prebuild.py compiles a benchmark's kernels ahead of time in parallel processes: what it stores must be
what the timed run's first call looks up, i.e. the cache entry of the module `fa4gen.build(spec_dict)` writes
(same rendered source, same key), or the prebuild saves nothing."""

import sys
from pathlib import Path

import pytest
from conftest import ROOT

SPEC = dict(name="prebuild_probe", targets=["sm90"], dtype="bf16", head_dim=64, head_dim_v=64,
            mask={"kind": "causal"}, softcap=0.0, pipeline={"tile_m": "auto"})


def _tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import prebuild
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return prebuild


def test_jobs_cover_every_kernel_of_each_spec_once(tmp_path, cache_root):
    from fa4gen import build
    from fa4gen.builder import plan_spec
    from fa4gen.spec import spec_from_dict

    tool = _tool()
    modules = [p.module for p in plan_spec(spec_from_dict(SPEC, source="<dict>"))[0]]
    # the repeated dict once, the renamed spec again, and one of the same name with another head dim in a
    # folder of its own (not over the first one's modules)
    other = {**SPEC, "head_dim": 128, "head_dim_v": 128}
    jobs = tool.jobs_of([SPEC, dict(SPEC), {**SPEC, "name": "prebuild_probe2"}, other], tmp_path)
    assert [j.plan.module for j in jobs[:2 * len(modules)]] == modules * 2
    assert [j.label for j in jobs] == ["prebuild_probe"] * len(modules) + ["prebuild_probe2"] * len(modules) + [
        "prebuild_probe"] * (len(jobs) - 2 * len(modules))
    assert len({j.pkg_dir for j in jobs}) == 3
    # each module's text is what fa4gen.build renders for that dict (so the cache key is the same)
    built = Path(build(SPEC).__file__).parent
    for job in jobs[:len(modules)]:
        assert (job.pkg_dir / f"{job.plan.module}.py").read_text() == (built / f"{job.plan.module}.py").read_text()


@pytest.mark.compile
def test_prebuilt_kernels_are_what_the_built_package_loads(cache_root):
    from fa4gen import build
    from fa4gen.compile.cache import DiskCache
    from fa4gen.compile.generated import compile_generated

    lines = []
    results = _tool().prebuild([SPEC], workers=2, log=lines.append)
    assert results and all(status == "compiled" for _, _, status, _ in results), results
    assert lines[0] == f"prebuild: fa4gen from {ROOT / 'fa4gen'}"
    assert lines[1].startswith(f"prebuild: {len(results)} kernels of 1 specs") and lines[-1].startswith("prebuild: done")
    pkg = build(SPEC)  # renders and imports the package; its kernels compile at their first call
    pkg_dir = Path(pkg.__file__).parent
    from fa4gen.builder import plan_spec
    from fa4gen.spec import spec_from_dict

    for plan in plan_spec(spec_from_dict(SPEC, source="<dict>"))[0]:
        res = compile_generated(pkg_dir / f"{plan.module}.py", f"{pkg.__name__}.{plan.module}", plan.to_dict(),
                                cache=DiskCache())
        assert res.cache_hit, plan.module  # the first call would load, not compile


def test_bench_run_specs_are_the_rows_specs():
    """bench_fwd.py --prebuild compiles run_specs(args): each row's forward, backward and deterministic
    backward (the same row_specs the timed loop builds), GQA backwards with --gqa."""
    from types import SimpleNamespace

    from conftest import load_tool

    bench = load_tool("bench_fwd")
    args = SimpleNamespace(dims="128,192x128", masks="none,causal", bwd=True, deterministic=True, bwd_swap_ab=False,
                           softcap=0.0, gqa=4, tile_m="auto", tile_n="auto", window=None, fwd_lse=False,
                           kv_stages="auto", pipeline={}, chunk=None)
    specs = bench.run_specs(args)
    assert len(specs) == 2 * 2 * 3
    assert [s["name"] for s in specs[:3]] == ["bench_d128_full", "bench_bwd_d128_full_gqa", "bench_bwd_det_d128_full_gqa"]
    assert all(s["allow_gqa"] for s in specs if s.get("backward"))
    assert [s["name"] for s in bench.run_specs(SimpleNamespace(**{**vars(args), "bwd": False, "gqa": 1}))] == [
        "bench_d128_full", "bench_d128_causal", "bench_d192x128_full", "bench_d192x128_causal"]


def test_bench_window_rows_are_gemma_style_specs_with_exact_flops():
    """--window L turns the causal rows into sliding windows (L keys left, none right) that validate as fa4gen
    specs, --fwd-lse makes them training specs (backward: true), and the FLOPs count the window's pairs."""
    from types import SimpleNamespace

    from conftest import load_tool

    from fa4gen.spec import spec_from_dict

    bench = load_tool("bench_fwd")
    args = SimpleNamespace(dims="256", masks="none,causal", bwd=False, deterministic=False, bwd_swap_ab=False,
                           softcap=50.0, gqa=2, tile_m="auto", tile_n="auto", window=4095, fwd_lse=True,
                           kv_stages="auto", pipeline={}, chunk=None)
    full, win = bench.run_specs(args)
    assert full["mask"] == {"kind": "none"} and full["backward"] is True
    assert win["mask"] == {"kind": "sliding_window", "left": 4095, "right": 0} and win["name"].endswith("_w4095_lse")
    spec = spec_from_dict(win, source="<dict>")
    assert spec.mask.left == 4095 and spec.softcap == 50.0
    assert bench._causal_keys(4096, 4095) == 4096 * 4096 / 2  # the window covers the whole row: causal's count
    assert bench._causal_keys(8, 2) == (1 + 2 + 3) + 5 * 3  # rows 0-2 see 1-3 keys, rows 3-7 three each
    assert bench._causal_keys(8, None) == 32
    # with --bwd the backward rows get the window too (the full rows none), named apart from the causal ones
    rows = bench.run_specs(SimpleNamespace(**{**vars(args), "bwd": True, "deterministic": True}))
    bwd_full, det_full, bwd_win, det_win = (r for r in rows if r["name"].startswith("bench_bwd"))
    assert bwd_full["mask"] == det_full["mask"] == {"kind": "none"} and "_w" not in bwd_full["name"]
    assert bwd_win["mask"] == det_win["mask"] == {"kind": "sliding_window", "left": 4095, "right": 0}
    assert bwd_win["name"].endswith("_w4095") and det_win["deterministic"] and not bwd_win["deterministic"]
    assert spec_from_dict(bwd_win, source="<dict>").mask.left == 4095
    # --chunk: the causal row a chunked mask (flash-attn-4 stays causal, a clock reference)
    args.window, args.chunk = None, 2048
    _, chunked = bench.run_specs(args)
    assert chunked["mask"] == {"kind": "chunked", "chunk_size": 2048} and chunked["name"].endswith("_c2048_lse")
    assert spec_from_dict(chunked, source="<dict>").mask.chunk_size == 2048
    assert bench._causal_keys(8, None, 3) == 2 * (1 + 2 + 3) + (1 + 2)  # two whole chunks of 3, one of 2
    assert bench._causal_keys(6, None, 8) == 6 * 7 / 2  # one partial chunk: the exact causal count
