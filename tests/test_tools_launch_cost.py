"""The measurement scripts under tools/ on the CPU: each one compiles, and the parts that read fa4gen's
runtime state work against it (session 26 lost a GPU call to tools/launch_cost.py unpacking the call cache's
entries by position after a field was added; it reads them by name now, checked here)."""

import importlib
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fa4gen

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"


@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("*.py")))
def test_every_tool_compiles(script, tmp_path):
    py_compile.compile(str(TOOLS / script), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.fixture
def tools_path(monkeypatch, tmp_path):
    """tools/ importable, packages built into a cache of the test's own; the modules it imported, and the
    packages it built (their ops stubbed), are dropped afterwards."""
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if (name in ("launch_cost", "host_overhead_cpu", "compile_time_cpu", "bwd_host_probe", "compare_fa4")
                or name.startswith("fa4gen_pkg_")):
            del sys.modules[name]


@pytest.mark.parametrize("backward", [False, True])
def test_launch_cost_reads_the_cached_launch(tools_path, backward):
    """compiled_call gives what the replay launches: the kernel, its run-time arguments, the LSE shape (a
    package with a backward always writes the LSE, into its scratch buffer when the call does not return it)."""
    launch_cost = importlib.import_module("launch_cost")
    from host_overhead_cpu import _stub

    pkg = fa4gen.build(dict(launch_cost.SPEC, name=f"tools_cpu_{int(backward)}", backward=backward))
    op = pkg._forward
    _stub(op)
    launched = []
    op._launch = lambda fn, device, args: launched.append((fn, args))
    q = torch.randn(1, 128, 1, 128, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    with torch.no_grad():
        pkg.attention(q, q, q, out=o)
    fn, args, lse_shape = launch_cost.compiled_call(op, q, o)
    (first_fn, first_args), = launched
    n_tensors = 5 if backward else 4
    assert fn is first_fn and args == first_args[n_tensors:]
    assert lse_shape == ((1, 1, 128) if backward else None)


def test_host_overhead_alloc_ab_runs():
    """In a process of its own: the script stubs the launch of generated/'s committed package in place."""
    root = TOOLS.parent
    r = subprocess.run([sys.executable, str(TOOLS / "host_overhead_cpu.py"), "--calls", "50", "--alloc-ab"],
                       cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "output like q (empty_like)" in r.stdout and "output from its shape (torch.empty)" in r.stdout


def test_compile_time_cpu_names_the_missing_wheels(tools_path, tmp_path):
    """tools/compile_time_cpu.py without flash-attn-4's wheels says which folder it looked in and what makes them,
    instead of failing inside the child process."""
    compile_time_cpu = importlib.import_module("compile_time_cpu")
    with pytest.raises(SystemExit, match="flash_attn_4, quack_kernels and einops wheels in .*pack.sh --anchors"):
        compile_time_cpu.unpack_fa4(tmp_path, tmp_path / "site")
    with pytest.raises(SystemExit):
        compile_time_cpu.main(["--rounds", "0"])


def test_compile_time_cpu_reads_the_pass_timing_report(tools_path, monkeypatch):
    """--pass-timing: a child's stderr carries MLIR's timing report; run_child keeps the slowest passes, the
    report's Total first, and ignores every other line."""
    import subprocess
    from types import SimpleNamespace

    compile_time_cpu = importlib.import_module("compile_time_cpu")
    stderr = "\n".join([
        "===-------------------------------------------------------------------------===",
        "  Total Execution Time: 2.2530 seconds",
        "  ----Wall Time----  ----Name----",
        "    0.1810 (  8.0%)  ArithIntRangeOpts",
        "    1.2210 ( 54.2%)  CudaToBinaryPass",
        "    0.0050 (  0.2%)  'gpu.module' Pipeline",
        "    0.1890 (  8.4%)  StrengthReductionPass",
        "    2.2530 (100.0%)  Total",
        "some warning (1.0%) that is not a pass",
    ])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(
        returncode=0, stdout='RESULT {"first_compile_s": 3.4}\n', stderr=stderr))
    out = compile_time_cpu.run_child("pass", {}, passes=2)
    assert out == {"first_compile_s": 3.4, "passes": [["Total", 2.253], ["CudaToBinaryPass", 1.221],
                                                      ["StrengthReductionPass", 0.189]]}
    assert "passes" not in compile_time_cpu.run_child("pass", {})


def test_compare_fa4_imports_flash_attn_4_from_its_wheels(tools_path, tmp_path, monkeypatch):
    """tools/compare_fa4.py without flash-attn-4 installed unpacks its wheels (stand-ins here: a module in each)
    into a folder first on sys.path and replaces quack.autotuner, which imports triton, with a stand-in."""
    import zipfile

    wheels = {"flash_attn_4": "flash_attn", "quack_kernels": "quack", "einops": "einops"}
    for dist, module in wheels.items():
        with zipfile.ZipFile(tmp_path / f"{dist}-0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{module}/__init__.py", f"WHEEL = {module!r}\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    for module in ("flash_attn", "quack", "einops", "quack.autotuner"):
        sys.modules.pop(module, None)
    compare_fa4 = importlib.import_module("compare_fa4")
    compare_fa4._use_fa4_wheels(tmp_path)
    assert importlib.import_module("flash_attn").WHEEL == "flash_attn"
    autotuner = importlib.import_module("quack.autotuner")
    assert autotuner.autotune(configs=[])(len) is len


def test_compare_fa4_cycles_column_sums_loop_cycles(tools_path):
    """tools/compare_fa4.py --cycles: each MMA loop's instructions, static issue cycles and MUFU.EX2 stream cycles
    from a control listing (fa4gen.compile.sass.disassemble_with_control's format), smallest loop first."""
    compare_fa4 = importlib.import_module("compare_fa4")

    def line(addr, text, stall):
        return f"        /*{addr:04x}*/                   {text} ; /* stall {stall} */"

    control = "\n".join([
        ".L_x_1:", line(0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT", 1),
        line(0x20, "MUFU.EX2 R4, R4", 8), line(0x30, "FADD R5, R6, -R7", 1), line(0x40, "MUFU.EX2 R8, R8", 1),
        line(0x50, "@P0 BRA `(.L_x_1)", 5),
        ".L_x_2:", line(0x60, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], R24", 2), line(0x70, "@P1 BRA `(.L_x_2)", 3),
        line(0x80, "EXIT", 0),
    ])
    assert compare_fa4.loop_issue_cycles(control) == "2/5/0, 5/16/10"
    assert compare_fa4.loop_issue_cycles(None) == "no SASS"


@pytest.mark.parametrize("package", ["llama3_8b", "qwen2_7b_packed"])
def test_host_overhead_cpu_times_the_backward_call(tools_path, package, capsys):
    """tools/host_overhead_cpu.py --backward runs a committed package's backward call (dense, and packed with
    unchecked sequences) with the launch stubbed, and prints its time and the functions with the most own time."""
    host_overhead_cpu = importlib.import_module("host_overhead_cpu")
    op = importlib.import_module(f"generated.{package}")._forward
    try:
        assert host_overhead_cpu.main(["--package", package, "--backward", "--calls", "20"]) == 0
    finally:  # the committed package stays in sys.modules for later tests: its op unstubbed again
        for name in ("arch_for", "_check_devices", "function", "_launch"):
            op.__dict__.pop(name, None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{package}: backward call: ") and ("packed" in lines[0]) == ("packed" in package)
    assert any("runtime.py" in line and "(backward)" in line for line in lines[1:])


@pytest.mark.parametrize("package", ["llama3_8b", "qwen2_7b_packed"])
def test_host_overhead_cpu_times_the_signature_caches(tools_path, package, capsys):
    """tools/host_overhead_cpu.py --cache-ab: repeated calls (batched, and packed with max_seqlen_q) with the
    signature caches against the full checks, without and with grad (both packages have a backward); the
    cached calls really skip the checks (the caches hold the signature afterwards)."""
    host_overhead_cpu = importlib.import_module("host_overhead_cpu")
    op = importlib.import_module(f"generated.{package}")._forward
    try:
        assert host_overhead_cpu.main(["--package", package, "--cache-ab", "--calls", "20"]) == 0
        assert len(op._calls) == 1 and len(op._grad_calls) == 1
    finally:  # the committed package stays in sys.modules for later tests: its op unstubbed, its caches empty
        for name in ("arch_for", "_check_devices", "function", "_launch"):
            op.__dict__.pop(name, None)
        op._calls.clear()
        op._grad_calls.clear()
    lines = capsys.readouterr().out.splitlines()
    kind = "packed" if "packed" in package else "batched"
    assert [line.split(":")[0] for line in lines] == [f"{package} ({kind}), no grad", f"{package} ({kind}), with grad"]
    assert all("with the signature cache" in line and "with the full checks" in line for line in lines)


@pytest.mark.parametrize("varlen", [False, True])
def test_bwd_host_probe_times_every_piece(tools_path, monkeypatch, varlen):
    """tools/bwd_host_probe.py's rows on stubbed launches (CPU tensors, no sync): the step, the forward, the
    backward through autograd and called directly with what the autograd node saved, the compiled call on the
    arguments that call launched, and the packed path's own pieces."""
    probe = importlib.import_module("bwd_host_probe")
    from host_overhead_cpu import _stub

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    pkg = fa4gen.build(dict(importlib.import_module("launch_cost").SPEC, name=f"tools_probe_{int(varlen)}",
                            backward=True, varlen=varlen))
    _stub(pkg._forward)
    lead = (128,) if varlen else (1, 128)
    q, k, v = (torch.randn(*lead, 1, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(*lead, 1, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 32, 64, 96, 128], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=32, max_seqlen_k=32) if varlen else {}
    monkeypatch.setattr(probe, "host_us", lambda fn, n=40, rounds=7: (fn(), 1.0)[1])
    rows = probe._pieces(pkg, q, k, v, dout, kw)
    want = {"step", "forward_with_grad", "backward_autograd", "backward_direct", "compiled_backward_call", "zero_dlse"}
    assert set(rows) == want | ({"ten_batch1_views"} if varlen else set())


def test_the_tiny_training_cases_run_a_step(tools_path):
    """tools/launch_cost.py's tiny training calls (shared with tools/bwd_host_probe.py) on CPU tensors with the
    launches stubbed: each fa4gen case runs forward and backward through autograd, gradients shaped like its
    inputs; without flash-attn-4 the reason is returned instead of its cases."""
    launch_cost = importlib.import_module("launch_cost")
    from host_overhead_cpu import _stub

    cases, fa4_missing = launch_cost.tiny_training_cases(device="cpu")
    assert fa4_missing is None or fa4_missing.startswith("unavailable")
    for name in ("fa4gen_dense", "fa4gen_packed"):
        c = cases[name]
        _stub(c.pkg._forward)
        grads = torch.autograd.grad(c.call(*c.inputs), c.inputs, c.dout)
        assert [g.shape for g in grads] == [t.shape for t in c.inputs], name


def test_first_call_child_imports_the_fa4gen_pythonpath_names_first(tools_path, tmp_path, monkeypatch):
    """tools/cold_first_call_ab.py puts a reference tree first on PYTHONPATH: the child `first_call` starts (run
    from its cache folder, with `child_env`) must import that tree's fa4gen, not the project's (before session 44
    it ran from the project root, where `python -c`'s working-directory entry shadowed the reference), and
    without PYTHONPATH it must still find the project's."""
    import launch_cost

    ref = tmp_path / "ref" / "fa4gen"
    ref.mkdir(parents=True)
    (ref / "__init__.py").write_text("")
    cache = tmp_path / "cache"
    cache.mkdir()
    code = "import fa4gen; print(fa4gen.__file__)"
    for pythonpath, want in ((str(tmp_path / "ref"), ref / "__init__.py"), (None, ROOT / "fa4gen" / "__init__.py")):
        if pythonpath is None:
            monkeypatch.delenv("PYTHONPATH", raising=False)
        else:
            monkeypatch.setenv("PYTHONPATH", pythonpath)
        r = subprocess.run([sys.executable, "-c", code], env=launch_cost.child_env(str(cache)), cwd=cache,
                           capture_output=True, text=True, check=True)
        assert Path(r.stdout.strip()).resolve() == want.resolve()
    assert launch_cost._child_values("FA4GEN_FROM /a b/fa4gen/__init__.py\nFIRST_CALL_S 1.5\n") == {
        "FA4GEN_FROM": "/a b/fa4gen/__init__.py", "FIRST_CALL_S": "1.5"}
