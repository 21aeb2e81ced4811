"""Shared by tests/test_launch_signature.py and tests/test_gpu_specs_cpu.py: a package's launches captured on the
CPU (its kernels never run) and checked against the generated modules' `fake_arguments()`, the signature
`fa4gen.compile` compiles."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def fake_arguments(package_dir: Path, module: str) -> list:
    """The generated module's fake_arguments(), the stream left out."""
    path = Path(package_dir) / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"fa4gen_sigcheck_{Path(package_dir).name}_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [a for a in mod.fake_arguments() if type(a).__name__ != "_FakeStream"]


def _torch_dtype(element_type) -> torch.dtype:
    return {"BFloat16": torch.bfloat16, "Float16": torch.float16, "Float32": torch.float32,
            "Int32": torch.int32, "Int64": torch.int64}[element_type.__name__]


def check_signature(args: list, fakes: list, where: str) -> None:
    assert len(args) == len(fakes), f"{where}: {len(args)} arguments launched, the kernel takes {len(fakes)}"
    seen: dict[int, tuple[object, int]] = {}  # id(symbol) -> (symbol, value): one value per symbol

    def symbolic(sym, value: int, what: str) -> None:
        assert value % sym.divisibility == 0, f"{what}: {value} is not a multiple of {sym.divisibility}"
        kept = seen.setdefault(id(sym), (sym, value))
        assert kept[1] == value, f"{what}: {value}, where the same symbol was {kept[1]} in an earlier argument"

    for i, (arg, fake) in enumerate(zip(args, fakes)):
        what = f"{where}: argument {i}"
        kind = type(fake).__name__
        if kind == "_FakeTensor":
            assert isinstance(arg, torch.Tensor), f"{what}: the kernel takes a tensor, got {type(arg).__name__}"
            assert arg.dim() == len(fake.shape), f"{what}: rank {arg.dim()}, the kernel's {len(fake.shape)}"
            assert arg.dtype == _torch_dtype(fake.element_type), f"{what}: {arg.dtype}, the kernel's {fake.element_type}"
            for n, (size, sym) in enumerate(zip(arg.shape, fake.shape)):
                if isinstance(sym, int):
                    assert size == sym, f"{what}: extent {n} is {size}, the kernel's {sym}"
                else:
                    symbolic(sym, size, f"{what} extent {n}")
            for n, (stride, sym) in enumerate(zip(arg.stride(), fake.stride)):
                if isinstance(sym, int):
                    assert stride == sym, f"{what}: stride {n} is {stride}, the kernel's {sym}"
                else:
                    assert stride % sym.divisibility == 0, f"{what}: stride {n} = {stride} not a multiple of {sym.divisibility}"
        elif kind == "Float32":
            assert isinstance(arg, (float, int)) and not isinstance(arg, bool), f"{what}: float expected, got {arg!r}"
        elif kind == "Int32":
            assert isinstance(arg, int) and not isinstance(arg, bool), f"{what}: int expected, got {arg!r}"
            assert -(2**31) <= arg < 2**31, f"{what}: {arg} does not fit Int32"
        else:
            raise AssertionError(f"{what}: an argument kind this test does not know: {kind}")


def capture(op, monkeypatch, arch: str) -> list:
    """Launches of `op` as (module, args), the kernels never run (outputs stay as allocated)."""
    launched: list = []
    monkeypatch.setattr(op, "_check_devices", lambda device, named: None)
    monkeypatch.setattr(op, "arch_for", lambda device: arch)
    monkeypatch.setattr(op, "_launch", lambda fn, device, args: fn(*args))
    monkeypatch.setattr(op, "function", lambda plan: (lambda *args: launched.append((plan["module"], list(args)))))
    return launched


def call(pkg, plan: dict, grad: bool):
    """One call of the package on CPU tensors: GQA heads unless the kernel runs MHA calls only; packed
    sequences for a varlen spec (two of 150 / 173 query rows)."""
    first = pkg._forward.first_plan()
    dtype = getattr(torch, first["torch_dtype"])
    h = 4
    h_kv = 2 if first["allow_gqa"] and not plan.get("mha_only") else h
    d, dv = first["head_dim"], first["head_dim_v"]
    gen = torch.Generator().manual_seed(0)

    def mk(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(grad)

    kwargs = {}
    if first.get("varlen"):
        lens_q, lens_k = (150, 173), (160, 190)
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 150, 323], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 160, 350], dtype=torch.int32),
                      max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        q, k, v = mk(323, h, d), mk(350, h_kv, d), mk(350, h_kv, dv)
    else:
        q, k, v = mk(2, 300, h, d), mk(2, 333, h_kv, d), mk(2, 333, h_kv, dv)
    if first["causal"] and not first.get("varlen"):
        k, v = mk(2, 300, h_kv, d), mk(2, 300, h_kv, dv)  # keep every query row seeing a key
    out = pkg.attention(q, k, v, **kwargs)
    if grad:
        out.backward(torch.ones_like(out))


def check_launches(pkg, arch: str, module: str, monkeypatch) -> None:
    """Pin `module`, call the package once (with a backward for a backward kernel), and check every launch."""
    op = pkg._forward
    plan = next(p for p in op.kernel_plans(arch) if p["module"] == module)
    launched = capture(op, monkeypatch, arch)
    with op.pinned(module):
        call(pkg, plan, grad=plan["direction"] == "bwd")
    assert module in [m for m, _ in launched], f"{op.name}.{module} was not launched: {[m for m, _ in launched]}"
    for launched_module, args in launched:
        check_signature(args, fake_arguments(op.dir, launched_module), f"{op.name}.{launched_module}")
