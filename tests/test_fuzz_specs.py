"""Fuzzing the front end: random spec documents, valid and invalid, through load -> validate ->
plan -> render. Nothing may escape but SpecError (PlanError and NotAvailableError are
SpecErrors); spec text never reaches generated code as code; a few valid specs compile.

Bounded for CI: derandomized (the same examples every run) with a fixed example count. Set
FA4GEN_FUZZ_EXAMPLES=<n> and FA4GEN_FUZZ_RANDOM=1 to search longer and differently.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fa4gen.builder import render_spec, write_package
from fa4gen.plan import PlanError, plan_kernels
from fa4gen.spec import SpecError, load_spec, spec_from_dict

EXAMPLES = int(os.environ.get("FA4GEN_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("FA4GEN_FUZZ_RANDOM") != "1",
    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
MARKER = "F4G_MARK"
HOSTILE = [
    '"', "'", '"""', "'''", "\n", "\r\n", "\\", "\x00", "\u2028", "#", "{{ 7*7 }}", "{% raw %}", "{#",
    "__import__('os').system('echo pwned')", '")\nimport os\nos.system("x")\n#', "'''\nraise SystemExit\n'''",
    "*/", "<script>", "${HOME}", "\t", "😀", "\\N{BULLET}", "%s%n", "`rm -rf /`",
]

# --- strategies -----------------------------------------------------------------------------------

hostile_text = st.lists(st.sampled_from(HOSTILE) | st.text(max_size=8), min_size=1, max_size=6).map("".join)
garbage = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | hostile_text | st.sampled_from(["auto", "sm90", "bf16", "causal", "none"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | hostile_text, inner, max_size=3),
    max_leaves=6,
)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))
head_dims = st.sampled_from([16, 32, 64, 96, 128, 192, 256]) | st.integers(0, 40).map(lambda i: 8 * i)
masks = st.one_of(
    st.just({"kind": "none"}),
    st.just({"kind": "causal"}),
    st.fixed_dictionaries({"kind": st.just("sliding_window"), "left": st.none() | st.integers(0, 9000),
                           "right": st.none() | st.integers(0, 9000)}),
    st.fixed_dictionaries({"kind": st.just("chunked"), "chunk_size": st.integers(1, 10000)}),
)
auto_or = lambda s: st.just("auto") | s  # noqa: E731
pipelines = st.fixed_dictionaries({}, optional={
    "ping_pong": auto_or(st.booleans()),
    "poly_exp": st.fixed_dictionaries({}, optional={"share": st.floats(0, 1), "degree": st.integers(1, 5)}),
    "rescale_threshold": auto_or(st.floats(0, 30)),
    "two_cta": st.booleans(),
    "tile_m": auto_or(st.sampled_from([64, 128, 192, 256])),
    "tile_n": auto_or(st.integers(1, 16).map(lambda i: 16 * i)),
    "kv_stages": auto_or(st.integers(1, 8)),
    "q_stages": auto_or(st.integers(1, 2)),
})
valid_docs = st.fixed_dictionaries(
    {"name": names, "targets": st.sampled_from([["sm90"], ["sm90", "sm100"], ["sm100"]]),
     "dtype": st.sampled_from(["bf16", "fp16"]), "head_dim": st.sampled_from([64, 96, 128, 192, 256])},
    optional={
        "description": hostile_text.map(lambda t: t[:400]),
        "head_dim_v": head_dims, "mask": masks, "softcap": st.floats(0, 100),
        "allow_gqa": st.booleans(), "varlen": st.booleans(), "return_lse": st.booleans(),
        "backward": st.booleans(), "deterministic": st.booleans(), "pipeline": pipelines,
    },
)


@st.composite
def documents(draw):
    """A valid-looking document with a few corruptions: values swapped for garbage (also inside
    mask/pipeline), required keys dropped, unknown keys added, hostile names."""
    doc = draw(valid_docs)
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["garbage", "drop", "unknown", "nested", "name"]))
        if action == "garbage" and doc:
            doc[draw(st.sampled_from(sorted(doc)))] = draw(garbage)
        elif action == "drop" and doc:
            doc.pop(draw(st.sampled_from(sorted(doc))))
        elif action == "unknown":
            doc[draw(st.text(min_size=1, max_size=10) | hostile_text)] = draw(garbage)
        elif action == "nested":
            where = draw(st.sampled_from(["mask", "pipeline"]))
            inner = doc.get(where)
            inner = dict(inner) if isinstance(inner, dict) else {}
            key = draw(st.sampled_from(["kind", "left", "chunk_size", "poly_exp", "tile_n", "share", "x"]))
            inner[key] = draw(garbage)
            doc[where] = inner
        elif action == "name":
            doc["name"] = draw(hostile_text | st.text(max_size=70))
    return doc


def _front_end(doc, label="<fuzz>"):
    """validate -> plan -> render; returns the rendered files, or None for a clean refusal."""
    try:
        spec = spec_from_dict(doc, source=label)
        pkg, plans, _ = render_spec(spec, label)
    except SpecError as err:  # PlanError and NotAvailableError included
        assert err.lines() and all(isinstance(line, str) for line in err.lines())
        return None
    for plan in plans:
        assert plan.arch in spec.targets
    return pkg.files


def _python(files):
    return {rel: text for rel, text in files.items() if rel.endswith(".py")}


# --- properties -----------------------------------------------------------------------------------


@FUZZ
@given(documents())
def test_random_documents_never_crash_the_front_end(doc):
    files = _front_end(doc)
    if files is not None:
        for rel, text in _python(files).items():
            ast.parse(text, filename=rel)


@FUZZ
@given(documents(), st.sampled_from([".yaml", ".json"]))
def test_random_documents_from_files_never_crash_the_loader(doc, suffix):
    try:
        text = yaml.safe_dump(doc) if suffix == ".yaml" else json.dumps(doc)
    except (TypeError, ValueError, yaml.YAMLError):
        assume(False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"spec{suffix}"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            spec = load_spec(path)
        except SpecError:
            return
        assert spec.name == doc["name"]


@FUZZ
@given(st.text(max_size=300) | hostile_text, st.sampled_from([".yaml", ".toml", ".json"]))
def test_random_text_files_never_crash_the_loader(text, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"spec{suffix}"
        path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
        try:
            load_spec(path)
        except SpecError:
            pass


@pytest.mark.parametrize("text", [
    "!!python/object/apply:os.system ['echo pwned']\n",
    "name: !!python/name:os.system\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\n",
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "name: x\ntargets: *d\ndtype: bf16\nhead_dim: 64\ndescription: *d\n",
    "name: x\nname: y\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\n",
    "\ufeffname: x\n",
    "- just\n- a list\n",
])
def test_hostile_yaml_is_refused_cleanly(tmp_path, text):
    path = tmp_path / "spec.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError):
        load_spec(path)


@FUZZ
@given(valid_docs, hostile_text, hostile_text)
def test_spec_strings_never_become_code(doc, description, label):
    """The description and the spec path are data: the description is absent from every rendered
    .py, and neither changes any module's syntax tree."""
    doc = {**doc, "targets": ["sm90"], "varlen": False, "backward": False, "deterministic": False}
    hostile = (MARKER + description)[:500]
    files = _front_end({**doc, "description": hostile}, label=label)
    assume(files is not None)
    plain = _front_end({**doc, "description": "plain"}, label="specs/plain.yaml")
    for rel, text in _python(files).items():
        assert MARKER not in text and hostile not in text, rel
        assert ast.dump(ast.parse(text)) == ast.dump(ast.parse(plain[rel])), rel
    assert json.loads(files["spec.lock.json"])["spec"]["description"] == hostile


@FUZZ
@given(valid_docs)
def test_valid_specs_plan_or_refuse_with_located_problems(doc):
    try:
        spec = spec_from_dict(doc)
    except SpecError:
        assume(False)
    for arch in spec.targets:
        try:
            plans = plan_kernels(spec, arch)
        except PlanError as err:
            assert all(p.location and p.message for p in err.problems)
            continue
        for plan in plans:
            assert plan.tile_n % 16 == 0 and plan.head_dim == spec.head_dim
            assert not math.isnan(plan.rescale_threshold)


# --- a few valid specs compile for sm_90a on the CPU ---------------------------------------------

compilable_docs = st.fixed_dictionaries({
    "name": names.map(lambda n: f"fz_{n}"[:60]), "targets": st.just(["sm90"]),
    "dtype": st.sampled_from(["bf16", "fp16"]), "head_dim": st.sampled_from([64, 96, 128, 256]),
    "mask": masks, "softcap": st.sampled_from([0.0, 30.0]), "return_lse": st.booleans(),
    "pipeline": st.fixed_dictionaries({
        "ping_pong": st.booleans(), "poly_exp": st.fixed_dictionaries({"share": st.sampled_from([0.0, 0.25, 1.0])}),
        "tile_n": auto_or(st.sampled_from([64, 96, 128])), "q_stages": auto_or(st.sampled_from([1, 2])),
    }),
})


@pytest.fixture(scope="module")
def compile_env(tmp_path_factory):
    pytest.importorskip("cutlass")
    from fa4gen.compile.sass import find_nvdisasm

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (needed for the SASS summary)")
    root = tmp_path_factory.mktemp("fuzz-compile")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FA4GEN_CACHE_DIR", str(root / "cache"))
        yield root


@pytest.mark.compile
@settings(max_examples=3, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much])
@given(doc=compilable_docs)
def test_a_sample_of_valid_specs_compiles_for_sm90a(compile_env, doc):
    from fa4gen.golden import compile_and_sass, load_variant

    try:
        spec = spec_from_dict(doc)
        pkg, plans, _ = render_spec(spec, "<fuzz>")
    except SpecError:
        assume(False)
    write_package(pkg, compile_env / "out")
    variant = load_variant(compile_env / "out" / spec.name)
    for plan in variant.plans:
        result = compile_and_sass(variant, plan)
        assert result.status == "pass", f"{doc}: {result.detail}"
