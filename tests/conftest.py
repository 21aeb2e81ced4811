"""Shared test helpers: the CLI in a subprocess, a tool script as a module, a backward's SASS compiled on the
CPU, and a per-module on-disk kernel cache."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fa4gen_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m fa4gen ARGS` in `cwd` with this checkout on the path and the compile log silenced."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "FA4GEN_QUIET": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "fa4gen", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=120
    )


def load_tool(name: str):
    """tools/<name>.py loaded as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def trace_in_kernel(check, arch: str, threads: int = 32) -> None:
    """Run `check` (plain Python over device helpers, asserting as it goes) while tracing a one-CTA kernel
    of `threads` threads compiled for `arch` on the CPU (the helpers see DSL values, as in a kernel)."""
    import cutlass.cute as cute

    from fa4gen.compile.aot import target_arch

    @cute.kernel
    def kernel():
        check()

    @cute.jit
    def host():
        kernel().launch(grid=(1, 1, 1), block=(threads, 1, 1))

    with target_arch(arch):
        cute.compile(host)


def backward_main_sass(spec_dict: dict, folder: Path, prefix: str):
    """(plan, SASS of the main kernel) of the sm90 backward of `spec_dict`, compiled on the CPU into `folder`."""
    from fa4gen.builder import compile_for_sass, plan_spec
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict(spec_dict)
    plans, _ = plan_spec(spec, archs=["sm90"])
    bwd = next(p for p in plans if p.direction == "bwd" and not p.mha_only)  # (allow_gqa: the GQA kernel)
    ((_, report, text),) = compile_for_sass(spec, [bwd], folder, prefix)
    assert report.status == "compiled", report.detail
    main = [part for part in text.split(".section\t.text.")[1:] if "FlashBwd" in part.split("\n", 1)[0]]
    assert len(main) == 1
    return bwd, main[0]


def backward_block_loops(plan, sass: str) -> list[list[str]]:
    """The per-query-block loops of an SM90 backward main kernel's SASS (from `backward_main_sass`): those issuing
    exactly one block's HGMMAs (S, dP, dV, dQ, dK over their k-steps), shortest first: with a causal mask the
    mask-free run, then the masked one."""
    from fa4gen.compile.sass import loops

    per_block = (plan.head_dim + plan.head_dim_v + plan.tile_n + 2 * plan.tile_m) // 16
    return sorted((body for body in loops(sass) if sum("HGMMA" in line for line in body) == per_block), key=len)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A fresh FA4GEN_CACHE_DIR for the whole test module."""
    root = tmp_path_factory.mktemp("fa4gen-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FA4GEN_CACHE_DIR", str(root))
        yield root


def precompile_selected(request, package_of, directions=("fwd", "bwd"), param: str = "name") -> None:
    """On a Hopper GPU: compile the kernels of every package that this test module's selected tests name
    (their `param` parameter; `package_of(name)` gives the package) before the first of them runs, in one pool
    of compile processes (fa4gen.api.runtime.precompile_ops: one per CPU as memory allows), so each test's
    first call loads its kernels from the disk cache instead of compiling them one at a time in the test process.
    Elsewhere nothing: the GPU tests skip."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return
    from fa4gen.api.runtime import precompile_ops

    names = sorted({item.callspec.params[param] for item in request.session.items
                    if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
                    and param in item.callspec.params})
    ops = [package_of(name)._forward for name in names]
    precompile_ops([(op, "sm90") for op in ops], directions=directions)
