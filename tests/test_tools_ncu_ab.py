"""tools/ncu_ab.sh / tools/ncu_ab.py, the Nsight-cycle A/B of source trees, on the CPU: `pack` writes a tree of
fa4gen/ + templates/ only, `run` profiles every cell once per tree per round (a stand-in for tools/ncu_cell.sh that
records which fa4gen each run imported), alternates the trees' order between rounds, and the summary divides each
tree's mean cycles by the working tree's."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "ncu_ab.sh"
sys.path.insert(0, str(ROOT / "tools"))
import ncu_ab  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")


def _page(ours: int, fa4: int) -> str:
    """A details page as `ncu --page details` prints it: fa4gen's main kernel, then flash-attn-4's."""
    def kernel(name: str, active: int) -> str:
        return (f"  kernel_cutlass_kernel_{name} (16, 16, 8)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0\n"
                "    Section: GPU Speed Of Light Throughput\n"
                f"    Elapsed Cycles                cycle    {active + 30000:,}\n"
                f"    SM Active Cycles              cycle {active:,}.25\n")
    return "[507] python3.12@127.0.0.1\n" + kernel("fa4gen_pkg_bench_bwd_d128_causal_0123abcdbwd_sm90", ours) + kernel(
        "flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object", fa4)


def test_summary_divides_by_the_working_tree(tmp_path):
    for tree, ours in (("work", 1_000_000), ("main", 1_020_000)):
        for rnd, fa4 in ((1, 960_000), (2, 962_000)):
            (tmp_path / f"{tree}__128_2048_y__r{rnd}_details.txt").write_text(_page(ours + rnd * 1000, fa4))
    (tmp_path / "unrelated_details.txt").write_text(_page(1, 1))  # not a TREE__CELL__rN name: ignored
    text = ncu_ab.summary(tmp_path)
    rows = {tuple(c.strip() for c in ln.strip("|").split("|")[:3]): ln for ln in text.splitlines() if ln.startswith("| 128")}
    work = rows[("128_2048_y", "fa4gen", "work")]
    main = rows[("128_2048_y", "fa4gen", "main")]
    assert "1,001,000 / 1,002,000" in work and "| 1,001,500 | 1.0000 |" in work
    assert f"| {1_021_500 / 1_001_500:.4f} |" in main  # main's kernel takes 2% more cycles
    fa4 = rows[("128_2048_y", "flash-attn-4", "main")]
    assert "960,000 / 962,000" in fa4 and "| 1.0000 |" in fa4  # the control: the same readings in both trees
    assert "2 round(s)" in text


def test_summary_reports_missing_rounds_and_empty_folders(tmp_path):
    assert "no TREE__CELL__rN_details.txt" in ncu_ab.summary(tmp_path)
    (tmp_path / "work__64_2048_n__r1_details.txt").write_text(_page(2_000_000, 2_100_000))
    (tmp_path / "main__64_2048_n__r2_details.txt").write_text(_page(2_010_000, 2_100_000))
    text = ncu_ab.summary(tmp_path)
    assert "| 64_2048_n | fa4gen | work | 2,000,000 / - |" in text
    assert "| 64_2048_n | fa4gen | main | - / 2,010,000 | 2,010,000 | 1.0050 |" in text
    # a page without the Speed Of Light rows (a profile cut short): its kernel reads "-", not a wrong number
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "work__64_2048_n__r1_details.txt").write_text(
        "  kernel_cutlass_kernel_fa4gen_x (1, 1, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0\n")
    assert "| 64_2048_n | fa4gen | work | - | - | - | - | - |" in ncu_ab.summary(bare)


# a stand-in for tools/ncu_cell.sh: logs its name, arguments and the fa4gen it imports; writes a details page whose
# fa4gen cycles depend on that tree
STUB = """#!/usr/bin/env bash
set -e
where=$(cd /tmp && python3 -c 'import fa4gen, os; print(os.path.dirname(fa4gen.__file__))')
echo "$1 ${*:2} $NCU_CELL_SECTIONS $where" >> "$NCU_AB_LOG"
ours=1000000; [[ $where == $NCU_AB_WORK/* ]] && ours=1010000
printf '  kernel_cutlass_kernel_fa4gen_x (1, 1, 1)x(384, 1, 1), Context 1\\n    Elapsed Cycles  cycle  %s\\n    SM Active Cycles  cycle  %s\\n' \\
  "$ours" "$ours" > "$OUT/$1_details.txt"
"""


def _env(tmp_path: Path, **extra) -> dict:
    stub = tmp_path / "cell.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return dict(os.environ, NCU_AB_TREES=str(tmp_path / "trees"), NCU_AB_CELL=str(stub),
                NCU_AB_LOG=str(tmp_path / "log.txt"), NCU_AB_WORK=str(tmp_path / "work"), PYTHONPATH=str(ROOT),
                **extra)


def _sh(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def test_pack_then_run_alternates_the_trees(tmp_path):
    env = _env(tmp_path, OUT=str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    done = _sh(env, "pack", "ref", "HEAD")
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / "trees" / "ref.tgz") as tar:
        names = tar.getnames()
    assert any(n.startswith("fa4gen/") for n in names) and any(n.startswith("templates/sm90/") for n in names)
    assert not any(n.startswith(("templates/sm100", "fa4gen/golden", "tests/", "docs/")) for n in names)
    done = _sh(env, "run", "2", "--", "128,2048,y", "64,512,n,--fwd")
    assert done.returncode == 0, done.stderr
    assert "tree work: fa4gen from " + str(ROOT / "fa4gen") in done.stdout
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert f"tree ref: fa4gen from {tmp_path}/work/trees/ref/fa4gen (packed from {head})" in done.stdout
    log = [ln.split() for ln in (tmp_path / "log.txt").read_text().splitlines()]
    # round 1: work then ref for each cell; round 2 reversed
    assert [ln[0] for ln in log] == ["work__128_2048_y__r1", "ref__128_2048_y__r1", "work__64_512_n_fwd__r1",
                                     "ref__64_512_n_fwd__r1", "ref__128_2048_y__r2", "work__128_2048_y__r2",
                                     "ref__64_512_n_fwd__r2", "work__64_512_n_fwd__r2"]
    assert log[2][1:5] == ["64", "512", "n", "--fwd"]
    assert all(ln[-2] == "light" for ln in log)  # NCU_CELL_SECTIONS: the cycle sections only
    assert log[1][-1] == f"{tmp_path}/work/trees/ref/fa4gen" and log[0][-1] == str(ROOT / "fa4gen")
    assert "| 128_2048_y | fa4gen | ref | 1,010,000 / 1,010,000 | 1,010,000 | 1.0100 |" in done.stdout
    with tarfile.open(tmp_path / "out" / "ncu_ab.tgz") as tar:
        assert "out/ncu_ab.md" in tar.getnames()


def test_run_with_trees_takes_only_those(tmp_path):
    env = _env(tmp_path)
    for name in ("p1", "p2"):
        assert _sh(env, "pack", name, "HEAD").returncode == 0
    (tmp_path / "out").mkdir()
    env["OUT"] = str(tmp_path / "out")
    for _ in range(2):  # the second run's archive beside the first's
        done = _sh(env, "run", "1", "--trees", "p2", "--", "64,2048,y")
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ncu_ab.tgz", "ncu_ab_2.tgz"]
    assert [ln.split()[0] for ln in (tmp_path / "log.txt").read_text().splitlines()] == [
        "work__64_2048_y__r1", "p2__64_2048_y__r1"] * 2
    done = _sh(env, "run", "1", "--trees", "p3", "--", "64,2048,y")
    assert done.returncode == 2 and "no " in done.stderr and "p3.tgz" in done.stderr


def test_bad_arguments_stop_with_a_usage_error(tmp_path):
    env = _env(tmp_path)
    for args, message in ((["pack", "work", "HEAD"], "NAME 'work'"), (["pack", "a b", "HEAD"], "NAME 'a b'"),
                          (["pack", "x", "no-such-ref"], "REF 'no-such-ref' is no commit"),
                          (["run", "2", "--"], "usage: tools/ncu_ab.sh run"),
                          (["run", "--", "128;2048;y"], "CELL '128;2048;y'"), ([], "here:")):
        done = _sh(env, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr + done.stdout, (args, done.stderr)
