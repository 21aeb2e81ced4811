"""tools/fa4_sass_cpu.py: flash-attn-4's SM90 kernels compiled on the CPU and their loops listed (the reference's
key-block loop next to ours between GPU sessions)."""

import re
import tarfile

import pytest
from conftest import ROOT, load_tool

WHEELS = ROOT / ".device" / "anchors"


def test_fa4_sass_cpu_names_the_missing_wheels(tmp_path):
    tool = load_tool("fa4_sass_cpu")
    with pytest.raises(SystemExit, match="flash_attn_4, quack_kernels and einops wheels in .*pack.sh --anchors"):
        tool.main(["--fa4-wheel", str(tmp_path)])


@pytest.mark.compile
@pytest.mark.skipif(not any(WHEELS.glob("flash_attn_4-*.whl")), reason="no flash-attn-4 wheel in .device/anchors")
def test_fa4_sass_cpu_lists_flash_attn_4s_backward_loop(tmp_path, capsys):
    """d128 without a mask: flash-attn-4's SM90 backward has one key-block loop of 34 MMAs (Sᵀ, dPᵀ, dV, dK, dQ
    over an 80-row step) and 40 exp2 per thread, as ours; the cubins are kept where --keep says."""
    pytest.importorskip("cutlass")
    tool = load_tool("fa4_sass_cpu")
    assert tool.main(["--dim", "128", "--keep", str(tmp_path / "keep"), "--ops", "4", "--cycles", "--ptx"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90")
    assert re.search(r"loop:\s+\d+ instructions\s+34 MMA\s+40 MUFU.EX2\s+0 LDL/STL", out), out
    # --cycles: the same loop's static issue cycles and its 40-long MUFU.EX2 stream (session 60: 465 / 960)
    assert re.search(r"loop:\s+\d+ instructions\s+\d+ issue cycles\s+40 MUFU.EX2 over \d+ cycles", out), out
    kept = sorted(p for p in (tmp_path / "keep").iterdir() if p.suffix == ".cubin")
    assert kept
    # --ptx keeps the PTX beside them (for tools/ptx_livethrough.py)
    assert any(p.suffix == ".ptx" and "bwd_sm90" in p.name for p in (tmp_path / "keep").iterdir())
    # --cubins lists the kept cubins without compiling, and a host object by the cubin it embeds
    main_cubin = next(p for p in kept if "bwd_sm90" in p.name)
    wrapped = tmp_path / "artifact.o"
    wrapped.write_bytes(b"not an ELF header" + main_cubin.read_bytes())
    assert tool.main(["--cubins", str(main_cubin), str(wrapped)]) == 0
    listed = capsys.readouterr().out
    assert listed.count("loop:") >= 2 and listed.count("34 MMA   40 MUFU.EX2") == 2, listed
    # a tar of them (tools/gpu_cubins.sh's form) lists the same, and --bodies writes each loop's instructions
    with tarfile.open(tmp_path / "cubins.tar", "w") as tar:
        tar.add(main_cubin, arcname="./" + main_cubin.name)
    assert tool.main(["--cubins", str(tmp_path / "cubins.tar"), "--bodies", str(tmp_path / "loops")]) == 0
    listed = capsys.readouterr().out
    assert listed.count("34 MMA   40 MUFU.EX2") == 1, listed
    bodies = sorted((tmp_path / "loops").glob("*.loop*.sass"))
    assert bodies and all(len(b.stem) < 90 for b in bodies)
    text = max(bodies, key=lambda b: b.stat().st_size).read_text().splitlines()
    assert sum("HGMMA" in line for line in text) == 34 and all("# stall" in line for line in text if "HGMMA" in line)
    assert not any(line.lstrip().startswith("/*") for line in text)  # no addresses: two loops diff line by line


def test_fa4_sass_cpu_refuses_a_malformed_head_dim(tmp_path, capsys):
    tool = load_tool("fa4_sass_cpu")
    with pytest.raises(SystemExit):
        tool.main(["--dim", "192x", "--fa4-wheel", str(tmp_path)])
    assert "--dim: expected a head dim such as 128 or DxDV such as 192x128, got '192x'" in capsys.readouterr().err


def test_fa4_sass_cpu_cubins_names_a_missing_file(tmp_path, capsys):
    tool = load_tool("fa4_sass_cpu")
    with pytest.raises(SystemExit):
        tool.main(["--cubins", str(tmp_path / "none.cubin")])
    assert "--cubins: no such file" in capsys.readouterr().err
