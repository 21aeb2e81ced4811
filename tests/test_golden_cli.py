"""`fa4gen test`: argument handling, which checks run where (forward and backward kernels), the table
and the exit status, the backward's checks run on the CPU with a stand-in for the package (their GPU
run is tests/test_gpu_backward.py's business and `fa4gen test` on the H200), and an end-to-end CPU run
on a package outside the repository (compile + SASS + emulator, and the backward's compile + SASS)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from fa4gen.cli.main import main
from fa4gen.golden import CheckResult, backward_numerics, compile_and_sass, load_variant, run_variant
from fa4gen.golden import runner as golden_runner
from fa4gen.golden import tolerance
from fa4gen.reference import attention_ref, mask_semantics

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "generated"


def _fake_check(status="pass"):
    def check(variant, plan, **_):
        return CheckResult(variant.name, plan["arch"], "fake", status, "fake check")
    return check


@pytest.fixture
def fast_checks(monkeypatch):
    """Replace the compile and emulator checks with instant ones (the table logic is under test)."""
    calls = []

    def compile_check(variant, plan):
        calls.append(("compile", variant.name, plan["arch"]))
        return CheckResult(variant.name, plan["arch"], "compile + SASS", "pass", "fake")

    def emulator_check(variant, plan):
        calls.append(("emulator", variant.name, plan["arch"]))
        return CheckResult(variant.name, plan["arch"], "emulator vs reference", "pass", "fake")

    def gpu_check(variant, plan):
        calls.append(("gpu", variant.name, plan["arch"]))
        return [CheckResult(variant.name, plan["arch"], "kernel vs reference", "pass", "fake")]

    def gpu_bwd_check(variant, plan):
        calls.append(("gpu bwd", variant.name, plan["arch"]))
        return [CheckResult(variant.name, plan["arch"], "bwd grads vs reference", "pass", "fake")]

    monkeypatch.setattr(golden_runner, "compile_and_sass", compile_check)
    monkeypatch.setattr(golden_runner, "emulator_vs_reference", emulator_check)
    monkeypatch.setattr(golden_runner, "kernel_numerics", gpu_check)
    monkeypatch.setattr(golden_runner, "backward_numerics", gpu_bwd_check)
    monkeypatch.setattr("fa4gen.golden.has_hopper", lambda: False)
    return calls


def _table_rows(stdout: str) -> list[dict[str, str]]:
    """The rows of `fa4gen test`'s table (its stdout: the table, then the summary line), cut at the
    header's column starts."""
    header, *rows, summary = stdout.splitlines()
    assert header.startswith("variant ") and " passed, " in summary
    names = header.split()
    starts = [header.index(n) for n in names]
    bounds = list(zip(starts, [*starts[1:], None]))
    return [{n: row[a:b].strip() for n, (a, b) in zip(names, bounds)} for row in rows]


def _invoke(*args, cwd=ROOT):
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(main, ["test", *args], catch_exceptions=False)
    finally:
        os.chdir(old)


def test_needs_an_argument():
    result = _invoke()
    assert result.exit_code == 2
    assert "name spec files or generated package folders, or pass --all" in result.stderr


def test_unknown_paths_and_unbuilt_specs_exit_2(tmp_path):
    spec = tmp_path / "fresh.yaml"
    spec.write_text("name: fresh_spec\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\n")
    result = _invoke(str(tmp_path / "missing.yaml"), str(spec), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert any("missing.yaml" in line and "not found" in line for line in lines)
    missing = f"{tmp_path / 'out' / 'fresh_spec'} is not a generated package; run `fa4gen build"
    assert any(missing in line for line in lines)
    assert "Traceback" not in result.output


def test_all_with_no_packages_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    result = _invoke("--all", "--out", str(tmp_path / "empty"))
    assert result.exit_code == 2
    assert "no generated packages found" in result.stderr


def test_cpu_runs_compile_and_emulator_per_target(fast_checks):
    result = _invoke("specs/deepseek_mla.yaml", str(GENERATED / "vit_encoder"))
    assert result.exit_code == 0, result.output
    # every built kernel of each variant is compiled, and every forward plan emulated (there is no
    # emulator of the backward); targets whose family is not available yet appear as skipped rows
    expected, skipped = [], 0
    for name in ("deepseek_mla", "vit_encoder"):
        lock = json.loads((GENERATED / name / "spec.lock.json").read_text())
        for plan in lock["plans"]:
            expected.append(("compile", name, plan["arch"]))
            if plan["direction"] == "fwd":
                expected.append(("emulator", name, plan["arch"]))
        skipped += len(lock.get("unavailable_targets", {}))
    assert expected[-1] == ("compile", "vit_encoder", "sm90")  # vit_encoder's backward: compile + SASS only
    assert fast_checks == expected
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0][:5] == ["variant", "arch", "check", "result", "time"]
    assert result.stdout.splitlines()[-1].startswith(f"{len(expected)} passed, 0 failed, {skipped} skipped")


def test_all_covers_every_generated_package(fast_checks):
    result = _invoke("--all")
    assert result.exit_code == 0, result.output
    tested = sorted({name for _, name, _ in fast_checks})
    assert tested == sorted(p.name for p in GENERATED.iterdir() if (p / "spec.lock.json").exists())


def test_gpu_runs_the_kernel_and_other_targets_compile(fast_checks, monkeypatch):
    """With a Hopper GPU the sm90 forward and backward run; other targets' kernels compile (and a
    forward is emulated)."""
    variant = load_variant(GENERATED / "llama3_8b")
    # (the persistent forward, its long-call twin, the head-loop GQA backward, MHA calls' backward, the backward)
    fwd, _twin, _loop, _mha, bwd = variant.plans
    assert (fwd["direction"], bwd["direction"]) == ("fwd", "bwd")
    fakes = [dict(p, arch="sm100", cute_arch="sm_100a") for p in (fwd, bwd)]
    variant.lock = {**variant.lock, "plans": [fwd, bwd, *fakes]}
    results = run_variant(variant, gpu=True)
    assert fast_checks == [("gpu", "llama3_8b", "sm90"), ("gpu bwd", "llama3_8b", "sm90"),
                           ("compile", "llama3_8b", "sm100"), ("emulator", "llama3_8b", "sm100"),
                           ("compile", "llama3_8b", "sm100")]
    assert [r.check for r in results] == ["kernel vs reference", "bwd grads vs reference", "compile + SASS",
                                          "emulator vs reference", "compile + SASS"]


def test_every_kernel_gets_a_check(fast_checks):
    """A kernel of a direction the golden suite has no check for is a failed row, never a silent skip."""
    variant = load_variant(GENERATED / "vit_encoder")
    odd = dict(variant.plans[0], direction="fwd2", module="fwd2_sm90")
    variant.lock = {**variant.lock, "plans": [*variant.plans, odd]}
    for gpu in (False, True):
        (row,) = [r for r in run_variant(variant, gpu=gpu) if r.check == "fwd2 kernel"]
        assert row.failed and row.detail == "no golden check for 'fwd2' kernels"


def test_a_crashing_backward_check_is_a_failed_row(fast_checks, monkeypatch):
    def boom(variant, plan):
        raise RuntimeError("backward exploded")

    monkeypatch.setattr(golden_runner, "backward_numerics", boom)
    results = run_variant(load_variant(GENERATED / "vit_encoder"), gpu=True)
    # (vit_encoder has three forwards: the persistent one, its one-CTA-per-tile twin for long calls and its 128-row
    # twin for the lengths that pad 192-row tiles worst)
    assert [(r.check, r.status) for r in results] == [("kernel vs reference", "pass")] * 3 + [("bwd kernel numerics", "FAIL")]
    assert results[-1].detail == "RuntimeError: backward exploded"


def test_a_failing_check_exits_1_after_the_whole_table(fast_checks, monkeypatch):
    monkeypatch.setattr(golden_runner, "emulator_vs_reference", _fake_check("FAIL"))
    result = _invoke(str(GENERATED / "llama3_8b"), str(GENERATED / "vit_encoder"))
    assert result.exit_code == 1
    # failed: the emulator row of each forward (persistent + its long-call twin; vit_encoder's 128-row twin too)
    assert result.stdout.count(" FAIL ") == 5
    # passed: every kernel's compile + SASS (the forwards + bwd per variant, + llama3_8b's backwards for MHA calls
    # and the head-loop GQA one)
    assert "9 passed, 5 failed, 0 skipped" in result.stdout


def test_a_crashing_check_is_a_failed_row_not_a_crash(fast_checks, monkeypatch):
    def boom(variant, plan):
        raise RuntimeError("emulator exploded")

    monkeypatch.setattr(golden_runner, "emulator_vs_reference", boom)
    result = _invoke(str(GENERATED / "vit_encoder"))
    assert result.exit_code == 1
    assert "RuntimeError: emulator exploded" in result.stdout


def test_a_plan_with_a_bad_algorithm_fails_the_emulator_check(tmp_path, monkeypatch, fast_checks):
    """The real emulator check on a package whose plan asks for a degree-1 polynomial everywhere."""
    from fa4gen.golden import checks

    monkeypatch.setattr(golden_runner, "emulator_vs_reference", checks.emulator_vs_reference)
    pkg = tmp_path / "vit_copy"
    shutil.copytree(GENERATED / "vit_encoder", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    lock = json.loads((pkg / "spec.lock.json").read_text())
    fwds = [plan for plan in lock["plans"] if plan["direction"] == "fwd"]
    assert len(fwds) == 3  # the persistent forward, its long-call twin and its 128-row twin
    for fwd in fwds:
        fwd.update(poly_every=1, poly_coeffs=[1.0, 0.9218067623528994])
    (pkg / "spec.lock.json").write_text(json.dumps(lock))
    result = _invoke(str(pkg))
    assert result.exit_code == 1
    row = next(line for line in result.stdout.splitlines() if "emulator vs reference" in line)
    assert " FAIL " in row and "budget" in row


# --- the backward's checks -------------------------------------------------------------------------


def _compiled(opcodes: dict, **fields):
    """What compile_generated returns, with a SASS summary of these counts."""
    sass = {"hgmma": 40, "utmaldg": 4, "ldl": 0, "stl": 0, **fields, "opcodes": opcodes}
    return SimpleNamespace(meta={"sass": sass, "registers": 168}, cache_hit=True, seconds=0.0)


@pytest.mark.parametrize("opcodes,fields,problem", [
    ({"HGMMA": 40, "UTMALDG": 4, "UBLKRED": 20}, {}, None),
    ({"HGMMA": 40, "UTMALDG": 4, "UTMAREDG": 20}, {}, "no UBLKRED"),  # dQ not summed by the bulk reduce
    ({"UTMALDG": 4, "UBLKRED": 20}, {"hgmma": 0}, "no HGMMA"),
    ({"HGMMA": 40, "UTMALDG": 4, "UBLKRED": 20}, {"stl": 3}, "3 STL (spills)"),
])
def test_backward_compile_check_wants_hgmma_tma_reduce_and_no_spills(monkeypatch, opcodes, fields, problem):
    import fa4gen.compile.generated as generated
    import fa4gen.compile.sass as sass

    monkeypatch.setattr(sass, "find_nvdisasm", lambda: "/bin/true")
    monkeypatch.setattr(generated, "compile_generated", lambda *a, **kw: _compiled(opcodes, **fields))
    variant = load_variant(GENERATED / "llama3_8b")
    fwd, bwd = variant.plans[0], variant.plans[-1]  # (a long-call twin forward sits between)
    row = compile_and_sass(variant, bwd)
    assert (row.check, row.failed) == ("bwd compile + SASS", problem is not None)
    assert f"UBLKRED {opcodes.get('UBLKRED', 0)}" in row.detail
    if problem:
        assert row.detail.startswith(problem)
    # the forward has no TMA reduce to look for
    forward_row = compile_and_sass(variant, fwd)
    assert forward_row.check == "compile + SASS" and "UBLKRED" not in forward_row.detail
    assert forward_row.failed == bool(fields)  # the same HGMMA / spill problems


class _NoisyBackward(torch.autograd.Function):
    """Identity whose backward adds noise: gradients that differ from one backward pass to the next."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g + 1e-3 * torch.randn_like(g)


def _stand_in(plan, *, causal=None, nan_dk=False, noisy=False):
    """A CPU stand-in for a generated package's attention(): the low-precision reference, through autograd
    (a kernel exactly as far from the exact gradients as the budget's own yardstick, i.e. inside it), or
    broken on purpose: the wrong mask, NaN in dk, noise in dq."""

    def attention(q, k, v, *, return_lse=False, window=None, chunk_size=None):
        sem = mask_semantics(plan, window=window, chunk_size=chunk_size)
        if causal is not None:
            sem["causal"] = causal
        if nan_dk:
            k = k.view_as(k)
            k.register_hook(lambda g: torch.full_like(g, math.nan))
        if noisy:
            q = _NoisyBackward.apply(q)
        out, lse = attention_ref(q, k, v, upcast=False, **sem)
        return (out, lse) if return_lse else out

    return SimpleNamespace(attention=attention)


def _backward_rows(name, **broken):
    variant = load_variant(GENERATED / name)
    (plan,) = [p for p in variant.plans if p["module"] == "bwd_sm90"]  # (the fp32-workspace GQA one)
    variant._module = _stand_in(plan, **broken)
    return backward_numerics(variant, plan, device="cpu", repeat_shape=(1, 70, 90, 2, 1))


def test_backward_numerics_pass_a_correct_backward():
    """llama3_8b: causal, GQA, bf16. vit_encoder: no mask, MHA, fp16, deterministic (so also repeated)."""
    (grads,) = _backward_rows("llama3_8b")
    assert (grads.check, grads.status) == ("bwd grads vs reference", "pass"), grads.detail
    assert grads.detail.startswith("4 cases; worst d")
    grads, repeat = _backward_rows("vit_encoder")
    assert (grads.check, grads.status) == ("bwd grads vs reference", "pass"), grads.detail
    assert (repeat.check, repeat.status) == ("bwd bitwise repeat", "pass"), repeat.detail
    assert repeat.detail == f"10 runs bitwise identical (dq, dk, dv) at shape={(1, 70, 90, 2, 2)}"


def test_backward_numerics_of_the_mha_backward_run_mha_cases():
    """llama3_8b (allow_gqa) also holds the backward its MHA calls run: its row is named apart, and its cases
    keep as many K/V heads as query heads (that kernel runs no other call)."""
    seen = []
    variant = load_variant(GENERATED / "llama3_8b")
    (plan,) = [p for p in variant.plans if p.get("mha_only")]
    stand_in = _stand_in(plan)
    real = stand_in.attention

    def attention(q, k, v, **kw):
        seen.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kw)

    stand_in.attention = attention
    variant._module = stand_in
    (grads,) = backward_numerics(variant, plan, device="cpu")
    assert (grads.check, grads.status) == ("bwd mha grads vs reference", "pass"), grads.detail
    assert len(seen) == 4 and all(h == h_kv for h, h_kv in seen)


def test_backward_numerics_catch_wrong_gradients():
    (grads,) = _backward_rows("llama3_8b", causal=False)  # the mask forgotten in the backward
    assert grads.failed and "budget" in grads.detail
    (grads,) = _backward_rows("llama3_8b", nan_dk=True)
    assert grads.failed and ": dk: NaN/inf (or unwritten) elements" in grads.detail


def test_backward_numerics_catch_a_nondeterministic_backward():
    _, repeat = _backward_rows("vit_encoder", noisy=True)
    assert repeat.failed and repeat.detail.startswith("dq of run 1 differs from run 0")


def test_grad_tolerance_is_the_2x_rule_with_an_atol():
    exact = torch.zeros(8, dtype=torch.float64)
    low = exact.clone()
    low[0] = 0.01
    budget = 2 * 0.01 + tolerance.GRAD_ATOL
    ok = tolerance.grad_against_reference("dq", exact + budget * 0.99, exact, low, softcap=False)
    assert ok.ok and ok.worst == pytest.approx(0.99)
    assert not tolerance.grad_against_reference("dq", exact + budget * 1.01, exact, low, softcap=False).ok
    # softcap's tanh.approx gets GRAD_SOFTCAP_ATOL more
    assert tolerance.grad_against_reference("dq", exact + budget * 1.01, exact, low, softcap=True).ok
    assert not tolerance.grad_against_reference("dv", None, exact, low, softcap=False).ok
    inf = exact.clone()
    inf[3] = math.inf
    assert not tolerance.grad_against_reference("dk", inf, exact, low, softcap=False).ok


def test_grad_tolerance_allows_one_input_dtype_ulp_at_the_largest_gradient():
    # a bf16 gradient of exactly-rounded fp32 values is within half an ulp; the rule adds one ulp at
    # max |exact| (3.5 -> 2^-6 in bf16) to the 2x rule, and not more; the dtype is the low-precision
    # gradient's (the input dtype)
    exact = torch.tensor([3.5, 0.25, -1.0, 0.0], dtype=torch.float32)
    low = exact.clone().to(torch.bfloat16)
    low[1] += 2.0**-9
    budget = 2 * 2.0**-9 + tolerance.GRAD_ATOL + 2.0**-6
    assert tolerance.grad_budget(exact, low, torch.bfloat16, softcap=False) == pytest.approx(budget)
    near = exact.to(torch.float64)
    near[0] += budget * 0.99
    assert tolerance.grad_against_reference("dq", near, exact, low, softcap=False).ok
    near[0] = 3.5 + budget * 1.01
    assert not tolerance.grad_against_reference("dq", near, exact, low, softcap=False).ok
    # fp16 has 3 more mantissa bits: 2^-9 at 3.5
    fp16 = tolerance.grad_budget(exact, low.to(torch.float16), torch.float16, softcap=False)
    assert fp16 == pytest.approx(budget - 2.0**-6 + 2.0**-9)


# --- packages that are not what their lock says (session 13 review) ------------------------------

def _copy_package(tmp_path, name="mistral_7b"):
    dst = tmp_path / "pk" / name
    shutil.copytree(GENERATED / name, dst)
    return dst


def _edit_lock(pkg, edit):
    lock_path = pkg / "spec.lock.json"
    lock = json.loads(lock_path.read_text())
    edit(lock)
    lock_path.write_text(json.dumps(lock))


def test_a_stale_package_of_a_spec_is_refused(tmp_path, fast_checks):
    """`fa4gen test SPEC` tested the package of an older version of SPEC and passed."""
    out = tmp_path / "out"
    shutil.copytree(GENERATED / "mistral_7b", out / "mistral_7b")
    spec = tmp_path / "mistral_7b.yaml"
    spec.write_text((ROOT / "specs" / "mistral_7b.yaml").read_text().replace("dtype: bf16", "dtype: fp16"))
    result = _invoke(str(spec), "--out", str(out))
    assert result.exit_code == 2 and not fast_checks
    assert "was built from another version of this spec; run `fa4gen build" in result.stderr


@pytest.mark.parametrize("edit, message", [
    # the plan's window edited: the emulator and the reference were both built from it and agreed
    (lambda lock: lock["plans"][0].update(window_left=10, window_right=300), "but the lock's spec asks for"),
    (lambda lock: lock.update(plans=[]), "lists no kernel plans"),
    (lambda lock: lock.update(plans=[{}]), "lists no kernel plans (or damaged ones)"),
    (lambda lock: lock.update(plans="ab"), "lists no kernel plans"),
    (lambda lock: lock.update(unavailable_targets=["sm100"]), "is not a mapping"),
    (lambda lock: lock["spec"].update(description="edited"), "does not match its spec_sha256"),
    (lambda lock: lock["spec"].update(head_dim=24), "the lock's spec no longer validates"),
])
def test_a_lock_that_does_not_describe_its_package_is_refused(tmp_path, fast_checks, edit, message):
    pkg = _copy_package(tmp_path)
    _edit_lock(pkg, edit)
    result = _invoke(str(pkg))
    assert result.exit_code == 2 and not fast_checks, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_an_edited_module_is_refused(tmp_path, fast_checks):
    pkg = _copy_package(tmp_path)
    (pkg / "fwd_sm90.py").write_text((pkg / "fwd_sm90.py").read_text() + "\n# edited\n")
    result = _invoke(str(pkg))
    assert result.exit_code == 2 and "fwd_sm90.py differs from the file the lock describes" in result.stderr


def test_damaged_packages_are_named_and_the_others_still_run(tmp_path, fast_checks):
    root = tmp_path / "pk"
    good = _copy_package(tmp_path, "vit_encoder")
    bad = _copy_package(tmp_path, "mistral_7b")
    (bad / "spec.lock.json").write_text("{")
    result = _invoke("--all", "--out", str(root))
    assert result.exit_code == 2  # after the good package's table
    assert "not a readable fa4gen lock file" in result.stderr
    assert {c[1] for c in fast_checks} == {"vit_encoder"} and " passed, " in result.stdout
    (good / "__init__.py").unlink()
    result = _invoke(str(good))
    assert result.exit_code == 2 and "__init__.py is missing" in result.stderr
    result = _invoke(str(bad / "spec.lock.json"))
    assert result.exit_code == 2 and "name the package folder" in result.stderr


def test_every_unbuilt_spec_of_a_folder_is_named(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("aaa", "bbb"):
        (specs / f"{name}.yaml").write_text(f"name: {name}\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\n")
    result = _invoke(str(specs), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert all(f"{tmp_path / 'out' / n} is not a generated package" in result.stderr for n in ("aaa", "bbb"))


def test_cpu_summary_says_which_numerics_did_not_run(fast_checks):
    result = _invoke("--cpu", str(GENERATED / "vit_encoder"))
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1].endswith("kernel numerics of 4 kernel(s) not run (no Hopper GPU used)")
