"""Render stage: deterministic output, golden staleness of generated/, provenance, feature gating in the
generated text, and injection safety of the Jinja filters.

CLI runs go through `python -m fa4gen` in a subprocess; staleness runs happen in a tmp copy of
specs/ and generated/ (the templates are always the repo's).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import tokenize
from pathlib import Path

import jinja2
import pytest
from conftest import fa4gen_cli

from fa4gen import __version__
from fa4gen.builder import plan_spec, render_spec
from fa4gen.plan import plan_kernels
from fa4gen.render import _ident, _py, _pystr, make_environment, render_package
from fa4gen.spec import load_spec, spec_digest, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
SPEC_FILES = sorted((ROOT / "specs").glob("*.yaml"))
GENERATED = ROOT / "generated"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A tmp project with copies of the repo's specs/ and generated/."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    shutil.copytree(GENERATED, tmp_path / "generated", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _rendered(path: Path) -> dict[str, str]:
    pkg, _, _ = render_spec(load_spec(path), f"specs/{path.name}")
    return pkg.files


def _row_status(stdout: str, name: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(name + " ") and " sm90 " in line]


def _modules(spec) -> list[str]:
    """The kernel modules of a spec's package: one per plan (target x direction)."""
    return [f"{plan.module}.py" for plan in plan_spec(spec)[0]]


SM90_KERNELS = sum(plan.arch == "sm90" for path in SPEC_FILES for plan in plan_spec(load_spec(path))[0])


# --- determinism and the committed goldens -----------------------------------------------------


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_render_is_byte_identical_and_matches_committed(path: Path):
    first, second = _rendered(path), _rendered(path)
    assert first == second
    spec = load_spec(path)
    on_disk = {p.name: p.read_bytes() for p in (GENERATED / spec.name).iterdir() if p.is_file()}
    assert sorted(on_disk) == sorted(first)
    for rel, text in first.items():
        assert on_disk[rel] == text.encode("utf-8"), f"generated/{spec.name}/{rel} differs from a fresh render"


def test_build_check_passes_on_repo():
    result = fa4gen_cli("build", "--check", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "stale" not in result.stdout.replace("up to date", "")
    kernels = sum(len(_modules(spec)) for spec in map(load_spec, SPEC_FILES))  # one row per kernel
    assert result.stdout.count("up to date") == kernels


def test_build_check_in_copy_is_clean(work: Path):
    result = fa4gen_cli("build", "--check", "--out", str(work / "generated"), cwd=work)
    assert result.returncode == 0, result.stderr


def test_edited_generated_file_is_stale_and_build_fixes_it(work: Path):
    target = work / "generated" / "llama3_8b" / "fwd_sm90.py"
    original = target.read_bytes()
    edited = original.replace(b"TILE_N = 128\n", b"TILE_N = 64\n")
    assert edited != original
    target.write_bytes(edited)

    check = fa4gen_cli("build", "--check", "--out", str(work / "generated"), *map(str, sorted(work.glob("specs/*.yaml"))),
                       cwd=work)
    assert check.returncode == 1
    assert "llama3_8b/fwd_sm90.py" in check.stderr
    assert "-TILE_N = 64" in check.stderr and "+TILE_N = 128" in check.stderr
    assert "generated/ is stale" in check.stderr
    assert _row_status(check.stdout, "llama3_8b")[0].split()[3] == "stale"
    assert target.read_bytes() == edited, "--check must not write"

    build = fa4gen_cli("build", "--out", str(work / "generated"), cwd=work)
    assert build.returncode == 0, build.stderr
    assert [row.split()[2] for row in _row_status(build.stdout, "llama3_8b")] == [
        "fwd_sm90", "fwd_sm90_long", "bwd_sm90_gqa", "bwd_sm90_mha", "bwd_sm90"]
    assert all("wrote 1 file(s)" in row for row in _row_status(build.stdout, "llama3_8b"))
    assert target.read_bytes() == original
    again = fa4gen_cli("build", "--out", str(work / "generated"), cwd=work)
    assert again.returncode == 0
    rows = [line for line in again.stdout.splitlines()[1:] if " sm90 " in line]
    assert len(rows) == SM90_KERNELS and all("unchanged" in line for line in rows)
    assert fa4gen_cli("build", "--check", "--out", str(work / "generated"), cwd=work).returncode == 0


def test_missing_and_extra_files_are_stale(work: Path):
    pkg = work / "generated" / "vit_encoder"
    (pkg / "spec.lock.json").unlink()
    (pkg / "leftover.py").write_text("x = 1\n")
    check = fa4gen_cli("build", "--check", "--out", "generated", cwd=work)
    assert check.returncode == 1
    assert "vit_encoder/spec.lock.json" in check.stderr
    assert "leftover.py is not produced by the spec any more" in check.stderr
    build = fa4gen_cli("build", "--out", "generated", cwd=work)
    assert build.returncode == 0
    assert not (pkg / "leftover.py").exists()
    assert (pkg / "spec.lock.json").read_bytes() == (GENERATED / "vit_encoder" / "spec.lock.json").read_bytes()


def test_spec_change_changes_kernel_and_reverts(work: Path):
    spec_path = work / "specs" / "llama3_8b.yaml"
    original_spec = spec_path.read_text()
    spec_path.write_text(original_spec + "pipeline:\n  tile_n: 64\n")
    check = fa4gen_cli("build", "--check", "--out", "generated", "specs/llama3_8b.yaml", cwd=work)
    assert check.returncode == 1
    assert "llama3_8b/fwd_sm90.py" in check.stderr and "+TILE_N = 64" in check.stderr
    build = fa4gen_cli("build", "--out", "generated", "specs/llama3_8b.yaml", cwd=work)
    assert build.returncode == 0
    kernel = (work / "generated" / "llama3_8b" / "fwd_sm90.py").read_text()
    assert "\nTILE_N = 64\n" in kernel
    lock = json.loads((work / "generated" / "llama3_8b" / "spec.lock.json").read_text())
    fwds = [plan for plan in lock["plans"] if plan["direction"] == "fwd"]  # persistent + its long-call twin
    assert [fwd["tile_n"] for fwd in fwds] == [64, 64] and lock["spec"]["pipeline"]["tile_n"] == 64
    # the header's spec sha256 follows the spec
    new_sha = spec_digest(load_spec(spec_path))
    assert f"spec sha256 {new_sha}" in kernel.splitlines()[0]
    # removing the field again restores the committed bytes
    spec_path.write_text(original_spec)
    assert fa4gen_cli("build", "--out", "generated", "specs/llama3_8b.yaml", cwd=work).returncode == 0
    for f in ("__init__.py", "fwd_sm90.py", "bwd_sm90.py", "spec.lock.json"):
        assert (work / "generated" / "llama3_8b" / f).read_bytes() == (GENERATED / "llama3_8b" / f).read_bytes()


def test_crlf_generated_file_is_stale(work: Path):
    target = work / "generated" / "llama3_8b" / "__init__.py"
    target.write_bytes(target.read_bytes().replace(b"\n", b"\r\n"))
    check = fa4gen_cli("build", "--check", "--out", "generated", cwd=work)
    assert check.returncode == 1
    assert "llama3_8b/__init__.py" in check.stderr


def test_orphan_package_is_stale(work: Path):
    (work / "specs" / "vit_encoder.yaml").unlink()
    check = fa4gen_cli("build", "--check", "--out", "generated", cwd=work)
    assert check.returncode == 1
    assert "vit_encoder" in check.stderr


# --- provenance and well-formedness of committed files -----------------------------------------

PACKAGE_FILES = [
    pytest.param(path, rel, id=f"{path.stem}/{rel}")
    for path in SPEC_FILES
    for rel in ("__init__.py", *_modules(load_spec(path)), "spec.lock.json")
]


@pytest.mark.parametrize("path,rel", PACKAGE_FILES)
def test_provenance(path: Path, rel: str):
    spec = load_spec(path)
    file = GENERATED / spec.name / rel
    text = file.read_text()
    sha = spec_digest(spec)
    if rel.endswith(".json"):
        lock = json.loads(text)
        assert lock["generator"] == f"fa4gen {__version__}"
        assert lock["spec_sha256"] == sha and lock["spec_path"] == f"specs/{path.name}"
        for other, digest in lock["files"].items():
            assert hashlib.sha256((file.parent / other).read_bytes()).hexdigest() == digest
        return
    lines = text.splitlines()
    assert lines[0] == f'# Generated by fa4gen {__version__} from "specs/{path.name}" (spec sha256 {sha}).'
    assert lines[2].startswith("# DO NOT EDIT")
    compile(text, str(file), "exec")


def test_generated_root_init_compiles():
    text = (GENERATED / "__init__.py").read_text()
    compile(text, "generated/__init__.py", "exec")
    assert "DO NOT EDIT" in text


# --- features turned off leave no trace in the generated text ----------------------------------

MASKS = {
    "none": {"kind": "none"},
    "causal": {"kind": "causal"},
    "window": {"kind": "sliding_window", "left": 255, "right": 0},
    "chunked": {"kind": "chunked", "chunk_size": 512},
}
VARIANTS = [
    pytest.param(mask, softcap, ping_pong, share, return_lse,
                 id=f"{mask}-cap{softcap:g}-pp{int(ping_pong)}-poly{share:g}-lse{int(return_lse)}")
    for mask, softcap, ping_pong, share, return_lse in itertools.product(
        MASKS, [0.0, 30.0], [False, True], [0.0, 0.25], [False, True]
    )
]


@pytest.mark.parametrize("mask,softcap,ping_pong,share,return_lse", VARIANTS)
def test_variant_text_matches_features(mask, softcap, ping_pong, share, return_lse):
    spec = spec_from_dict({
        "name": "variant", "targets": ["sm90"], "dtype": "bf16", "head_dim": 128, "mask": MASKS[mask],
        "softcap": softcap, "return_lse": return_lse,
        "pipeline": {"ping_pong": ping_pong, "poly_exp": {"share": share}},
    })
    pkg, (plan, *long), _ = render_spec(spec, "specs/variant.yaml")
    kernel, api = pkg.files["fwd_sm90.py"], pkg.files["__init__.py"]
    # at d128 the default forward is persistent (masked: over units of two query tiles), with a one-CTA-per-tile
    # twin for long calls
    # (its CTA count a run-time argument: the API passes the GPU's SM count)
    assert plan.scheduler == "persistent" and "num_ctas: Int32" in kernel and "PERSISTENT_CTAS" not in kernel
    assert "num_ctas" not in pkg.files["fwd_sm90_long.py"]
    assert ("schedule.paired_tile(" in kernel) == (mask != "none")
    # a sliding window orders the tiles its start cuts apart from the rest (schedule.window_ramp), a chunked mask the
    # last, partial chunk's (schedule.chunk_ramp, the ramp at a pair's end), in every role
    assert kernel.count("ramp=ramp, full_div=full_div") == (2 if mask in ("window", "chunked") else 0)
    assert kernel.count("ramp_high=True") == (2 if mask == "chunked" else 0)
    assert ("schedule.window_ramp(window_left" in kernel) == (mask == "window")
    assert ("schedule.chunk_ramp(chunk" in kernel) == (mask == "chunked")
    assert [p.module for p in long] == ["fwd_sm90_long"] and "fwd_sm90_long.py" in pkg.files
    for text in (kernel, api):
        ast.parse(text)
    has_mask = mask != "none"
    assert ("mask." in kernel) == has_mask
    assert ("from fa4gen.device import mask" in kernel) == has_mask
    assert ("window_left" in kernel + api) == (mask == "window")
    assert ("window=" in api) == (mask == "window")
    assert ("chunk_size" in api) == (mask == "chunked")
    assert ("softcap" in kernel + api) == (softcap > 0)
    assert ("PINGPONG_BARRIER" in kernel) == ping_pong
    assert ("mLSE" in kernel) == return_lse
    assert f"\nPOLY_EVERY = {plan.poly_every}\n" in kernel
    assert (plan.poly_every == 0) == (share == 0.0)
    assert f"\nPOLY_COEFFS = {_py(plan.poly_coeffs)}\n" in kernel
    assert eval(_py(plan.poly_coeffs)) == plan.poly_coeffs  # noqa: S307 - numbers only
    assert f"\nTILE_N = {plan.tile_n}\n" in kernel and f"\nHEAD_DIM = {plan.head_dim}\n" in kernel
    if mask == "window":
        assert f"({plan.window_left}, {plan.window_right})" in api


@pytest.mark.parametrize("name", ["vit_encoder"])
def test_committed_maskless_variant_has_no_mask_code(name):
    modules = ["__init__.py", *_modules(load_spec(ROOT / "specs" / f"{name}.yaml"))]
    assert "bwd_sm90.py" in modules  # the backward kernel is held to the same rule
    text = "".join((GENERATED / name / rel).read_text() for rel in modules)
    assert "mask." not in text and "window_left" not in text and "softcap" not in text


@pytest.mark.parametrize("overlap", [False, True])
def test_intra_wg_overlap_switch(overlap):
    spec = spec_from_dict({"name": "ov", "targets": ["sm90"], "dtype": "bf16", "head_dim": 128,
                           "pipeline": {"intra_wg_overlap": overlap}})
    pkg, (plan, long), _ = render_spec(spec, "specs/ov.yaml")
    for module in ("fwd_sm90.py", "fwd_sm90_long.py"):  # persistent (short calls) and one CTA per tile
        kernel = pkg.files[module]
        ast.parse(kernel)
        # Unmasked spec: the first (ragged) key block has its own copy of the block body, the rest run
        # mask-free; the overlapped loop also peels the last P·V, so both layouts hold two copies of each.
        copies = 2
        assert kernel.count("softmax.online_softmax_step(") == copies
        assert kernel.count("cute.gemm(tiled_mma_qk") == copies and kernel.count("cute.gemm(tiled_mma_pv") == copies
        assert kernel.count("softmax.mask_columns(") == 1
        assert ("warpgroup.wait_group(1)" in kernel) == overlap
    assert plan.intra_wg_overlap is overlap and long.intra_wg_overlap is overlap


def test_committed_poly_exp_spec():
    plans = plan_kernels(load_spec(ROOT / "specs" / "fa4_pipeline.yaml"), "sm90")  # persistent + its twin
    assert [plan.poly_every for plan in plans] == [7, 7]
    assert "\nPOLY_EVERY = 7\n" in (GENERATED / "fa4_pipeline" / "fwd_sm90.py").read_text()
    assert "\nPOLY_EVERY = 0\n" in (GENERATED / "llama3_8b" / "fwd_sm90.py").read_text()


# --- filters and injection safety --------------------------------------------------------------


@pytest.mark.parametrize("value,text", [
    (True, "True"), (False, "False"), (0, "0"), (-1, "-1"), (1.5, "1.5"), (1e-300, "1e-300"),
    ((1.0,), "(1.0,)"), ((1, 2.5), "(1, 2.5)"), ((), "()"),
])
def test_py_filter_renders_literals(value, text):
    assert _py(value) == text
    assert ast.literal_eval(text) == value


@pytest.mark.parametrize("value", ["x", "os.system('x')", "", None, [1, 2], {"a": 1}, b"1", ("ok", 1)])
def test_py_filter_rejects_non_numbers(value):
    with pytest.raises(TypeError, match="refusing to render"):
        _py(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), (1.0, float("nan"))])
def test_py_filter_rejects_non_finite(value):
    with pytest.raises(ValueError):
        _py(value)


@pytest.mark.parametrize("value", ["a b", "1x", "os.system('x')", "x\nimport os", "", "x-y", 'x"', None, 3])
def test_ident_filter_rejects_non_identifiers(value):
    with pytest.raises(ValueError, match="identifier"):
        _ident(value)


@pytest.mark.parametrize("value", ["llama3_8b", "FlashFwdSm90", "sm_90a", "BFloat16"])
def test_ident_filter_passes_identifiers(value):
    assert _ident(value) == value


@pytest.mark.parametrize("value", ["import", "None", "lambda"])
def test_ident_filter_rejects_keywords(value):
    with pytest.raises(ValueError):
        _ident(value)


def test_pystr_is_a_safe_literal():
    nasty = 'a"""\nimport os\nos.system("x")\u2028\\'
    text = _pystr(nasty)
    assert "\n" not in text and '"""' not in text
    assert ast.literal_eval(text) == nasty


def test_environment_is_strict_and_filters_apply():
    env = make_environment()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ missing }}").render()
    with pytest.raises(TypeError):
        env.from_string("{{ x|py }}").render(x="__import__('os')")
    with pytest.raises(ValueError):
        env.from_string("{{ x|ident }}").render(x="a;b")
    assert env.from_string("{{ x|py }}").render(x=(1.0, 2)) == "(1.0, 2)"


NASTY = '"""\nimport os\nos.system("x")'


def _all_python(files: dict[str, str]) -> str:
    return "".join(text for rel, text in files.items() if rel.endswith(".py"))


def test_description_never_reaches_python():
    data = load_spec(ROOT / "specs" / "llama3_8b.yaml").model_dump(mode="json")
    data["description"] = NASTY
    spec = spec_from_dict(data)
    pkg, _, _ = render_spec(spec, "specs/llama3_8b.yaml")
    python = _all_python(pkg.files)
    for part in (NASTY, "os.system", "import os"):
        assert part not in python
    for rel, text in pkg.files.items():
        if rel.endswith(".py"):
            ast.parse(text)
    lock = pkg.files["spec.lock.json"]
    assert NASTY not in lock and json.dumps(NASTY) in lock
    assert json.loads(lock)["spec"]["description"] == NASTY


def _code_without_comments(text: str) -> str:
    """The source with every comment token removed (tokens joined by spaces)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)


LABEL = 'specs/evil"\nimport os\nos.system("x")\n""".yaml'


@pytest.mark.parametrize("name", ["mistral_7b", "llama3_8b"])  # forward only; forward and backward
def test_label_is_only_a_json_escaped_comment(name):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    pkg, _, _ = render_spec(spec, LABEL)
    for rel, text in pkg.files.items():
        if not rel.endswith(".py"):
            continue
        tree = ast.parse(text)
        assert "os.system" not in _code_without_comments(text)
        assert not [line for line in text.splitlines() if line.startswith(("import os", "os.system"))]
        first = text.splitlines()[0]
        assert first.startswith("# Generated by fa4gen") and json.dumps(LABEL) in first
        # nothing of the label reaches the code: the module is the same as with a plain label
        plain = render_spec(spec, f"specs/{name}.yaml")[0].files[rel]
        assert ast.dump(tree) == ast.dump(ast.parse(plain))
    assert json.loads(pkg.files["spec.lock.json"])["spec_path"] == LABEL


def test_label_from_a_nasty_file_name_via_cli(tmp_path: Path):
    """End to end: a spec file whose name holds a newline and quotes, built through the CLI."""
    specs = tmp_path / "specs"
    specs.mkdir()
    name = 'evil"\nos.system("x")\n""".yaml'
    shutil.copy(ROOT / "specs" / "vit_encoder.yaml", specs / name)
    result = fa4gen_cli("build", "--out", "out", str(specs / name), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    files = {p.name: p.read_text() for p in (tmp_path / "out" / "vit_encoder").iterdir()}
    for rel, text in files.items():
        if rel.endswith(".py"):
            ast.parse(text)
            assert "os.system" not in _code_without_comments(text)
            assert not [line for line in text.splitlines() if line.startswith(("os.system", '""".yaml'))]
            assert json.dumps(f"specs/{name}") in text.splitlines()[0]
    assert json.loads(files["spec.lock.json"])["spec_path"] == f"specs/{name}"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_render_package_rejects_non_identifier_plan_fields(direction):
    """Through the forward's and the backward's templates alike (llama3_8b has both)."""
    spec = load_spec(ROOT / "specs" / "llama3_8b.yaml")
    plans = plan_kernels(spec, "sm90")
    plan = next(p for p in plans if p.direction == direction)  # (the default forward: the first)
    others = [p for p in plans if p is not plan]
    assert render_package(spec, [plan, *others], spec_label="x", unavailable={}).files  # the unmodified plan renders
    evil = dataclasses.replace(plan, class_name="X:\n    import os")
    with pytest.raises(ValueError, match="identifier"):
        render_package(spec, [evil, *others], spec_label="x", unavailable={})
    evil_num = dataclasses.replace(plan, tile_n="128; import os")
    with pytest.raises(TypeError):
        render_package(spec, [evil_num, *others], spec_label="x", unavailable={})


def test_provenance_header_regex_on_all_python():
    """Each committed kernel module's header names the right spec and this fa4gen version."""
    pattern = re.compile(r'^# Generated by fa4gen (\S+) from "(specs/\w+\.yaml)" \(spec sha256 ([0-9a-f]{64})\)\.$')
    for path in SPEC_FILES:
        spec = load_spec(path)
        for rel in ("__init__.py", *_modules(spec)):
            m = pattern.match((GENERATED / spec.name / rel).read_text().splitlines()[0])
            assert m and m.groups() == (__version__, f"specs/{path.name}", spec_digest(spec))


@pytest.mark.parametrize("mask,varlen,deterministic", [("none", False, False), ("none", True, False),
                                                        ("none", False, True), ("causal", False, False)])
def test_backward_query_block_order(mask, varlen, deterministic):
    """Every role of the backward (loads, consumers, dQ warp) visits the query blocks in one order: with the
    dQ claim and no mask, key block n starts at its diagonal's query tile and wraps around (m_rot), so the
    first store of each dQ chunk does not make every key block of a head wait at query tile 0; otherwise in
    ascending order (a mask's diagonal already staggers the key blocks; determinism keeps its turns)."""
    spec = spec_from_dict({
        "name": "order", "targets": ["sm90"], "dtype": "bf16", "head_dim": 128, "mask": MASKS[mask],
        "backward": True, "allow_gqa": False, "varlen": varlen, "deterministic": deterministic,
    })
    pkg, plans, _ = render_spec(spec, "specs/order.yaml")
    plan = next(p for p in plans if p.direction == "bwd")
    kernel = pkg.files["bwd_sm90.py"]
    ast.parse(kernel)
    staggered = mask == "none" and not deterministic
    assert plan.dq_claim == (not deterministic)
    rotated = "m_block = m_min + (i) + m_rot - (m_max - m_min) * Int32((i) + m_rot >= m_max - m_min)"
    assert kernel.count(rotated) == (3 if staggered else 0)  # the loads, the consumers, the dQ warp
    assert ("m_rot = " in kernel) == staggered
    if staggered:
        assert "pds = i % PDS_STAGES" in kernel and "(m_block - m_min) % PDS_STAGES" not in kernel


def test_mha_backward_twin_is_the_allow_gqa_false_kernel():
    """A spec with allow_gqa and a backward gets bwd_sm90_mha for its MHA calls: the very module an allow_gqa:
    false spec renders as bwd_sm90 (its header names the spec it came from, so that line differs)."""
    spec = load_spec(ROOT / "specs" / "llama3_8b.yaml")
    pkg, _, _ = render_spec(spec, "specs/llama3_8b.yaml")
    alone, _, _ = render_spec(spec.model_copy(update={"allow_gqa": False}), "specs/llama3_8b.yaml")
    assert "bwd_sm90_mha.py" not in alone.files
    twin, mha_kernel, gqa_kernel = (f.splitlines() for f in (pkg.files["bwd_sm90_mha.py"], alone.files["bwd_sm90.py"],
                                                            pkg.files["bwd_sm90.py"]))
    assert twin[0].startswith("# Generated by fa4gen") and twin[1:] == mha_kernel[1:]
    assert twin[1:] != gqa_kernel[1:]  # (and not the GQA kernel)


def test_guarded_steps_call_pipelines_through_module_functions():
    """The persistent 192-row forward's guarded branches (templates/sm90/_steps.j2 `guarded`) call the K/V pipelines
    through fa4gen.device.sm90's functions, so CuTe-DSL does not thread the pipeline objects through each branch's
    yields; everything outside the branches, and every other kernel, keeps the method calls."""
    from fa4gen.render import _module_calls

    assert _module_calls("pipe_v.consumer_wait(v_state)\npipe_k.consumer_release(kv_state)") == (
        "hopper.consumer_wait(pipe_v, v_state)\nhopper.consumer_release(pipe_k, kv_state)")
    text = (ROOT / "generated" / "vit_encoder" / "fwd_sm90.py").read_text()
    guarded = text[text.index("busy_wg = "):text.index("# Epilogue")]
    assert "hopper.consumer_wait(pipe_v, v_state)" in guarded and "hopper.consumer_release(pipe_k, kv_state)" in guarded
    # the handshakes outside the branches (the K wait and turn of each block) keep the method form
    assert "pipe_k.consumer_wait(kv_state)" in guarded
    for other in ("llama3_8b/fwd_sm90.py", "vit_encoder/fwd_sm90_long.py"):
        assert "hopper.consumer_" not in (ROOT / "generated" / other).read_text(), other
