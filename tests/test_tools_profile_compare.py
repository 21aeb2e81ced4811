"""tools/profile_compare.py (the A/B table of tools/bwd_profile.py runs) on made-up profiles: which kernel is the
main one, the ratios, and a case missing from one run."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_compare  # noqa: E402  (tools/ is not a package)

# kernel names as torch.profiler gives them, cut to 90 characters by bwd_profile.py
OURS_MAIN = "kernel_cutlass_kernel_fa4gen_prebuildbench_varlen_bwd_d64_fullbwd_sm90__f497e3290a445ab4Fl"
OURS_PRE = "kernel_cutlass_kernel_tiles_fa4gendevicebwdPreprocessVarlen_object_at__tensorptrbf16gmemal"
OURS_POST = "kernel_cutlass_kernel_fa4gendevicesm90ConvertChunks_object_at__tensorptrf32gmemalign16odiv"
FA4_MAIN = "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__te"
FA4_PRE = "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess_o"
FA4_POST = "kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPostprocess"
ADD = "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat1"


def _run(folder: Path, cases: dict) -> Path:
    folder.mkdir()
    rows = [dict(d=d, seqlen=s, causal=c == "y",
                 fa4gen={OURS_MAIN: ours, OURS_PRE: 40.0, OURS_POST: 50.0, ADD: 140.0},
                 fa4={FA4_MAIN: fa4, FA4_PRE: 70.0, FA4_POST: 50.0, ADD: 140.0})
            for (d, s, c), (ours, fa4) in cases.items()]
    (folder / "bwd_profile.json").write_text(json.dumps(rows))
    return folder


def test_main_kernel_is_the_generated_backward_not_its_pre_or_postprocess():
    assert profile_compare.main_kernel({OURS_PRE: 1.0, OURS_MAIN: 2.0, OURS_POST: 3.0, ADD: 4.0}) == 2.0
    assert profile_compare.main_kernel({FA4_PRE: 1.0, FA4_MAIN: 5.0, FA4_POST: 3.0}) == 5.0
    assert profile_compare.main_kernel({ADD: 4.0}) is None
    with pytest.raises(ValueError, match="more than one main backward kernel"):
        profile_compare.main_kernel({OURS_MAIN: 1.0, FA4_MAIN: 2.0})


def test_ratios_per_case_and_cases_missing_from_a_run_left_out(tmp_path, capsys):
    a, b = (64, "v512-512", "n"), (128, "v512-512", "y")
    new = [_run(tmp_path / "n1", {a: (420.0, 400.0), b: (250.0, 240.0)}),
           _run(tmp_path / "n2", {a: (410.0, 400.0)})]
    ref = [_run(tmp_path / "r1", {a: (430.0, 410.0), b: (260.0, 240.0)})]
    table = profile_compare.compare([profile_compare.load(p) for p in new], [profile_compare.load(p) for p in ref])
    assert [row["case"] for row in table] == [a]  # b is not in every run
    row = table[0]
    assert row["new_main"] == [420.0, 410.0] and row["ref_main"] == [430.0]
    assert row["main_ratio"] == pytest.approx(415.0 / 430.0)
    # each process's kernel divided by its own flash-attn-4 kernel first
    assert row["rel_ratio"] == pytest.approx(((420 / 400 + 410 / 400) / 2) / (430 / 410))
    assert row["total_ratio"] == pytest.approx(((420 + 230) + (410 + 230)) / 2 / (430 + 230))
    assert row["fa4_spread"] == pytest.approx(410 / 400 - 1)
    out = tmp_path / "ab.md"
    assert profile_compare.main([f"{new[0]},{new[1]}", str(ref[0]), "--markdown", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text() and "| 64, v512-512, n | 420.0 / 410.0 | 430.0 |" in printed


def test_ab_bench_runs_bwd_profile_in_abba_order_and_prints_the_table(tmp_path):
    """tools/ab_bench.sh with AB_SCRIPT=bwd_profile.py: each round runs the script once per side (the reference
    with .ab/ref first on PYTHONPATH, its own cache folder), ABBA, then tools/profile_compare.py's table over
    all the runs. A stand-in bwd_profile.py records who ran it and writes a profile (no GPU)."""
    import os
    import shutil
    import subprocess

    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    (root / ".ab" / "ref" / "fa4gen").mkdir(parents=True)
    (root / ".ab" / "ref" / "COMMIT").write_text("0" * 40 + "\n")
    repo = Path(__file__).resolve().parents[1]
    for name in ("ab_bench.sh", "profile_compare.py"):
        shutil.copy(repo / "tools" / name, root / "tools" / name)
    # `python3 -c "import fa4gen.render as r; print(r.TEMPLATES_DIR)"` runs per side: a stand-in package
    for base in (root, root / ".ab" / "ref"):
        (base / "fa4gen").mkdir(exist_ok=True)
        (base / "fa4gen" / "__init__.py").write_text("")
        (base / "fa4gen" / "render.py").write_text(f"TEMPLATES_DIR = {str(base)!r}\n")
    (root / "tools" / "bwd_profile.py").write_text(f'''
import json, os, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True)
ref = os.environ["FA4GEN_CACHE_DIR"].endswith("_ref")
ours = 430.0 if ref else 420.0
rows = [dict(d=64, seqlen="v512-512", causal=False, fa4gen={{{OURS_MAIN!r}: ours, {OURS_PRE!r}: 40.0}},
             fa4={{{FA4_MAIN!r}: 400.0}})]
(out / "bwd_profile.json").write_text(json.dumps(rows))
with open(Path(os.environ["LOG"]), "a") as f:
    f.write(("ref" if ref else "new") + " " + " ".join(sys.argv[1:sys.argv.index("--out")]) + "\\n")
''')
    log = tmp_path / "order.log"
    env = {**os.environ, "AB_SCRIPT": "bwd_profile.py", "LOG": str(log), "PYTHONPATH": str(root)}
    env.pop("OUT", None)
    res = subprocess.run(["bash", str(root / "tools" / "ab_bench.sh"), "run", "2", "--", "--cases", "64:v512-512:n"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert log.read_text().split("\n")[:4] == ["new --cases 64:v512-512:n", "ref --cases 64:v512-512:n",
                                               "ref --cases 64:v512-512:n", "new --cases 64:v512-512:n"]
    assert "| 64, v512-512, n | 420.0 / 420.0 | 430.0 / 430.0 | 0.9767 |" in res.stdout
    assert (root / "out" / "ab" / "ab.md").is_file()


def test_cases_with_a_value_head_dim_are_keyed_apart_from_the_square_head_dim(tmp_path):
    """bwd_profile.py rows carry dv; a (192, 128) case and a 192 case of the same length are two cases."""
    folder = tmp_path / "run"
    folder.mkdir()
    rows = [dict(d=192, dv=dv, seqlen=16384, causal=True, fa4gen={OURS_MAIN: us}, fa4={FA4_MAIN: 100.0})
            for dv, us in ((128, 90.0), (192, 120.0))] + [dict(d=64, seqlen=512, causal=False,  # rows before dv
                                                                fa4gen={OURS_MAIN: 5.0}, fa4={FA4_MAIN: 5.0})]
    (folder / "bwd_profile.json").write_text(json.dumps(rows))
    cases = profile_compare.load(folder)
    assert cases[("192x128", "16384", "y")]["fa4gen"] == (90.0, 90.0)  # (main kernel, whole backward) µs
    assert cases[(192, "16384", "y")]["fa4gen"] == (120.0, 120.0)
    assert (64, "512", "n") in cases


def test_bwd_profile_cases_parse_head_dim_pairs_and_name_a_bad_case():
    import bwd_profile  # (imports torch and fa4gen; its timing needs the GPU machine, its parsing does not)

    assert bwd_profile._cases("192x128:16384:y, 64:v128-1024:n,128:2048:n") == [
        (192, 128, "16384", True), (64, 64, "v128-1024", False), (128, 128, "2048", False)]
    for bad in ("192x128:16384", "d128:2048:n", "128:2k:n", "128:2048:yes", "192x128:v128-1024:y", "128:v128:y"):
        with pytest.raises(SystemExit, match=r"--cases: .*" + bad.split(":")[0]):
            bwd_profile._cases(bad)
