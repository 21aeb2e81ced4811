"""Tests for the spec stage: models, cross-field rules, loaders, error messages, schema, digest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the package is used from the source tree, not installed
    sys.path.insert(0, str(ROOT))

from fa4gen.spec import (  # noqa: E402
    DOCUMENT,
    SPEC_SUFFIXES,
    AttentionSpec,
    ChunkedMask,
    SlidingWindowMask,
    SpecError,
    discover_specs,
    load_spec,
    spec_digest,
    spec_from_dict,
    spec_json_schema,
)

SPECS_DIR = ROOT / "specs"
SPEC_FILES = sorted(p for p in SPECS_DIR.iterdir() if p.suffix in SPEC_SUFFIXES)
BASE = {"name": "t", "targets": ["sm90"], "dtype": "bf16", "head_dim": 128}


def problems_of(data: dict) -> dict[str, str]:
    """Validate `data` expecting failure; return {location: message}."""
    with pytest.raises(SpecError) as info:
        spec_from_dict(data, source="t.yaml")
    return {p.location: p.message for p in info.value.problems}


def with_(**changes) -> dict:
    return {**BASE, **changes}


# --- the shipped specs -----------------------------------------------------------------------


def test_specs_dir_has_the_model_specs():
    names = {p.stem for p in SPEC_FILES}
    assert {
        "llama3_8b", "gemma2_9b", "mistral_7b", "vit_encoder", "deepseek_mla", "fa4_pipeline",
        "llama4_chunked",
    } <= names


# the shipped specs that also generate the SM90 backward (issue #4), and the deterministic one among them
BACKWARD_SPECS = {"llama3_8b", "llama32_1b", "gemma2_9b", "vit_encoder", "qwen2_7b_packed", "flux_dit"}
DETERMINISTIC_SPECS = {"vit_encoder"}


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_shipped_spec_validates(path: Path):
    spec = load_spec(path)
    assert spec.name == path.stem
    assert spec.backward is (spec.name in BACKWARD_SPECS)
    assert spec.deterministic is (spec.name in DETERMINISTIC_SPECS)
    assert (spec.pipeline.tile_m, spec.pipeline.tile_n, spec.pipeline.kv_stages) == ("auto",) * 3
    assert path.read_text().startswith("#"), "each spec starts with a comment header"


def test_shipped_spec_contents():
    gemma = load_spec(SPECS_DIR / "gemma2_9b.yaml")
    assert gemma.mask == SlidingWindowMask(left=4095, right=0)
    assert (gemma.head_dim, gemma.softcap) == (256, 50.0)
    qwen = load_spec(SPECS_DIR / "qwen2_7b_packed.yaml")
    assert qwen.varlen and qwen.backward and qwen.mask.kind == "causal" and qwen.head_dim == 128
    mla = load_spec(SPECS_DIR / "deepseek_mla.yaml")
    assert (mla.head_dim, mla.head_dim_v, mla.targets) == (192, 128, ["sm90", "sm100"])
    fa4 = load_spec(SPECS_DIR / "fa4_pipeline.yaml")
    assert fa4.pipeline.ping_pong is True
    assert (fa4.pipeline.poly_exp.share, fa4.pipeline.poly_exp.degree) == (0.15, 3)
    assert load_spec(SPECS_DIR / "llama4_chunked.yaml").mask == ChunkedMask(chunk_size=8192)
    assert load_spec(SPECS_DIR / "llama3_8b.yaml").return_lse is True
    assert load_spec(SPECS_DIR / "vit_encoder.yaml").dtype == "fp16"
    flux = load_spec(SPECS_DIR / "flux_dit.yaml")  # MHA without a mask: the persistent SM90 backward
    assert (flux.head_dim, flux.mask.kind, flux.allow_gqa, flux.deterministic) == (128, "none", False, False)


# --- defaults and resolution -----------------------------------------------------------------


def test_defaults_are_filled_and_model_is_frozen():
    spec = spec_from_dict(BASE)
    assert spec.head_dim_v == 128 and spec.head_dim_v_resolved == 128
    assert spec.mask.kind == "none"
    assert spec.pipeline.rescale_threshold == "auto" and spec.pipeline.ping_pong == "auto"
    with pytest.raises(Exception):
        spec.head_dim = 64  # type: ignore[misc]


# --- cross-field rules -----------------------------------------------------------------------


def test_two_cta_needs_sm100():
    problems = problems_of(with_(pipeline={"two_cta": True}))
    assert problems == {"pipeline.two_cta": "two_cta needs 'sm100' in targets (got ['sm90'])"}
    assert spec_from_dict(with_(targets=["sm100"], pipeline={"two_cta": True})).pipeline.two_cta


@pytest.mark.parametrize("field", ["head_dim", "head_dim_v"])
@pytest.mark.parametrize("value", [0, 100, 264])
def test_head_dims_multiple_of_8_up_to_256(field: str, value: int):
    problems = problems_of(with_(**{field: value}))
    assert "multiple of 8 in [8, 256]" in problems[field]
    assert f"(got {value})" in problems[field]


def test_head_dim_pairs():
    assert spec_from_dict(with_(head_dim=192, head_dim_v=128)).head_dim_v == 128
    message = problems_of(with_(head_dim=128, head_dim_v=64))["head_dim_v"]
    assert "(128, 64)" in message and "(192, 128)" in message and "equal" in message


def test_deterministic_needs_backward():
    message = problems_of(with_(deterministic=True))["deterministic"]
    assert "backward" in message
    assert spec_from_dict(with_(deterministic=True, backward=True)).deterministic


def test_sliding_window_needs_a_bound():
    message = problems_of(with_(mask={"kind": "sliding_window", "left": None, "right": None}))
    assert "left" in message["mask"] and "kind: none" in message["mask"]
    spec = spec_from_dict(with_(mask={"kind": "sliding_window", "left": 127}))
    assert (spec.mask.left, spec.mask.right) == (127, 0)


def test_several_cross_field_problems_are_all_reported():
    problems = problems_of(with_(deterministic=True, pipeline={"two_cta": True}))
    assert set(problems) == {"deterministic", "pipeline.two_cta"}


# --- field errors ----------------------------------------------------------------------------


def test_unknown_field_lists_allowed_fields():
    assert "pipline" in problems_of(with_(pipline={}))
    message = problems_of(with_(mask={"kind": "sliding_window", "lft": 3}))["mask.lft"]
    assert message.startswith("unknown field; allowed fields here: kind, left, right")
    assert "did you mean 'left'" in message


def test_wrong_type_and_wrong_choice():
    assert problems_of(with_(dtype="fp32")) == {
        "dtype": "expected one of 'bf16', 'fp16' (got 'fp32')"
    }
    assert problems_of(with_(targets=["sm90", "sm80"])) == {
        "targets.1": "expected one of 'sm90', 'sm100' (got 'sm80')"
    }
    assert problems_of(with_(head_dim="128")) == {"head_dim": "expected an integer (got '128')"}
    assert "expected a list" in problems_of(with_(targets="sm90"))["targets"]
    assert "{kind: causal}" in problems_of(with_(mask="causal"))["mask"]
    assert "'chunked'" in problems_of(with_(mask={"kind": "blocky"}))["mask.kind"]


def test_out_of_range():
    assert problems_of(with_(pipeline={"poly_exp": {"share": 1.5}})) == {
        "pipeline.poly_exp.share": "must be <= 1 (got 1.5)"
    }
    assert problems_of(with_(mask={"kind": "chunked", "chunk_size": 0})) == {
        "mask.chunk_size": "must be >= 1 (got 0)"
    }
    assert "softcap" in problems_of(with_(softcap=-1.0))
    assert "64" in problems_of(with_(pipeline={"tile_m": 96}))["pipeline.tile_m"]
    assert "[1, 8]" in problems_of(with_(pipeline={"kv_stages": 9}))["pipeline.kv_stages"]
    assert "[1, 2]" in problems_of(with_(pipeline={"q_stages": 3}))["pipeline.q_stages"]
    assert "500" in problems_of(with_(description="x" * 501))["description"]


@pytest.mark.parametrize(
    "data, location",
    [
        (with_(head_dim=True), "head_dim"),
        (with_(mask={"kind": "chunked", "chunk_size": True}), "mask.chunk_size"),
        (with_(pipeline={"tile_n": True}), "pipeline.tile_n"),
        (with_(pipeline={"poly_exp": {"degree": False}}), "pipeline.poly_exp.degree"),
        (with_(softcap=True), "softcap"),
    ],
)
def test_bool_where_number_expected_is_rejected(data: dict, location: str):
    assert "true" in problems_of(data)[location] or "false" in problems_of(data)[location]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_floats_rejected(value: float):
    assert "finite" in problems_of(with_(softcap=value))["softcap"]
    assert "finite" in problems_of(with_(pipeline={"rescale_threshold": value}))[
        "pipeline.rescale_threshold"
    ]


@pytest.mark.parametrize("name", ["Llama", "1abc", "has-dash", "class", "x" * 65, "", "__pycache__", "__init__",
                                  b"class", bytearray(b"import"), 5])
def test_bad_names(name):
    # non-str values are refused before pydantic's lax coercion (bytes -> str) could skip the keyword check
    assert "name" in problems_of(with_(name=name))


def test_targets_nonempty_and_unique():
    assert "empty" in problems_of(with_(targets=[]))["targets"]
    assert "duplicate" in problems_of(with_(targets=["sm90", "sm90"]))["targets.1"]


def test_missing_required_fields_each_reported():
    problems = problems_of({})
    assert set(problems) == {"name", "targets", "dtype", "head_dim"}
    assert all(m == "required field is missing" for m in problems.values())


def test_error_text_is_one_line_per_problem_without_pydantic_urls():
    with pytest.raises(SpecError) as info:
        spec_from_dict(with_(dtype="fp32", head_dim=3), source="x.yaml")
    text = str(info.value)
    assert text.splitlines() == [f"x.yaml: {p.location}: {p.message}" for p in info.value.problems]
    assert "pydantic" not in text and "http" not in text


# --- loading files ---------------------------------------------------------------------------

YAML_TEXT = "name: t\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\nmask: {kind: causal}\n"


def test_yaml_syntax_error_reports_line(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\ntargets: [sm90\ndtype: bf16\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (problem,) = info.value.problems
    assert problem.location == DOCUMENT and "line " in problem.message
    assert info.value.source == str(path)


def test_yaml_duplicate_key_rejected(tmp_path: Path):
    path = tmp_path / "dup.yaml"
    path.write_text(YAML_TEXT + "dtype: fp16\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (problem,) = info.value.problems
    assert "duplicate key 'dtype'" in problem.message and "line 6" in problem.message


def test_toml_and_json_load_like_yaml(tmp_path: Path):
    yaml_path = tmp_path / "s.yaml"
    yaml_path.write_text(YAML_TEXT)
    toml_path = tmp_path / "s.toml"
    toml_path.write_text(
        'name = "t"\ntargets = ["sm90"]\ndtype = "bf16"\nhead_dim = 64\n[mask]\nkind = "causal"\n'
    )
    json_path = tmp_path / "s.json"
    json_path.write_text(json.dumps({**BASE, "head_dim": 64, "mask": {"kind": "causal"}}))
    specs = [load_spec(p) for p in (yaml_path, toml_path, json_path)]
    assert specs[0] == specs[1] == specs[2]


@pytest.mark.parametrize(
    "suffix, text", [(".toml", 'name = "t"\ntargets = [\n'), (".json", '{"name": "t",\n}')]
)
def test_toml_json_syntax_errors_report_line(tmp_path: Path, suffix: str, text: str):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (problem,) = info.value.problems
    assert "line 2" in problem.message or "line 3" in problem.message


@pytest.mark.parametrize(
    "filename, text, expected",
    [
        ("missing.yaml", None, "file not found"),
        ("spec.txt", "name: t\n", "unsupported file type"),
        ("empty.yaml", "  \n", "empty"),
        ("comments.yaml", "# nothing\n", "no content"),
        ("list.yaml", "- a\n- b\n", "expected a mapping"),
        ("list.json", "[1]", "expected a mapping"),
        ("huge.json", '{"head_dim": ' + "9" * 5000 + "}", "JSON error: Exceeds the limit"),  # not a traceback
        # values the YAML/TOML parsers accept but cannot build gave tracebacks (session 13 review)
        ("huge.yaml", "name: t\nhead_dim: " + "9" * 5000 + "\n", "YAML error: Exceeds the limit"),
        ("huge.toml", 'name = "t"\nhead_dim = ' + "9" * 5000 + "\n", "TOML error: Exceeds the limit"),
        ("date.yaml", "name: t\ndescription: 2001-13-45\n", "YAML error: month must be in 1..12"),
        ("tag.yaml", 'name: t\nhead_dim: !!int "abc"\n', "YAML error: invalid literal"),
        ("deep.json", "[" * 100000 + "]" * 100000, "JSON error: nested too deeply"),
    ],
)
def test_document_level_problems(tmp_path: Path, filename: str, text: str | None, expected: str):
    path = tmp_path / filename
    if text is not None:
        path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (problem,) = info.value.problems
    assert problem.location == DOCUMENT and expected in problem.message


def test_discover_specs(tmp_path: Path):
    (tmp_path / "b.yaml").write_text(YAML_TEXT)
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    extra = tmp_path / "other.yml"
    extra.write_text(YAML_TEXT)
    # Sorted, spec suffixes only, and a file named twice is listed once.
    assert discover_specs([tmp_path, extra]) == [tmp_path / "a.json", tmp_path / "b.yaml", extra]
    assert discover_specs([tmp_path / "notes.txt"]) == [tmp_path / "notes.txt"]
    assert discover_specs([SPECS_DIR]) == SPEC_FILES
    with pytest.raises(SpecError, match="not found"):
        discover_specs([tmp_path / "nope"])


# --- schema and digest -----------------------------------------------------------------------


def test_json_schema_is_json_with_all_fields():
    schema = json.loads(json.dumps(spec_json_schema()))
    assert set(schema["properties"]) == set(AttentionSpec.model_fields)
    assert set(schema["required"]) == {"name", "targets", "dtype", "head_dim"}
    assert schema["additionalProperties"] is False


def test_digest_is_stable_and_tracks_changes():
    spec = load_spec(SPECS_DIR / "llama3_8b.yaml")
    digest = spec_digest(spec)
    assert len(digest) == 64 and digest == spec_digest(load_spec(SPECS_DIR / "llama3_8b.yaml"))
    # Spelling out a default does not change the resolved spec, so not the digest either.
    explicit = spec_from_dict({**spec.model_dump(mode="json"), "head_dim_v": 128})
    assert spec_digest(explicit) == digest
    changed = spec_from_dict({**spec.model_dump(mode="json"), "softcap": 30.0})
    assert spec_digest(changed) != digest


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_byte_order_mark_is_not_content(tmp_path: Path, suffix: str):
    # Windows editors write a UTF-8 BOM; json and tomllib refused it with a syntax error at line 1 column 1
    data = {"name": "t", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64, "mask": {"kind": "causal"}}
    text = {
        ".yaml": YAML_TEXT,
        ".toml": 'name = "t"\ntargets = ["sm90"]\ndtype = "bf16"\nhead_dim = 64\nmask = {kind = "causal"}\n',
        ".json": json.dumps(data),
    }[suffix]
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    spec = load_spec(path)
    assert (spec.name, spec.head_dim, spec.mask.kind) == ("t", 64, "causal")


def test_alias_bomb_is_refused_quickly(tmp_path: Path):
    """A YAML alias bomb (10^9 leaves in 600 bytes) in a string field: the error message's repr of the
    value took minutes and gigabytes (session 13 review); a bounded repr keeps it short."""
    import time

    lines = ["name: bomb", "targets: [sm90]", "dtype: bf16", "head_dim: 128", "description:",
             "  - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert time.perf_counter() - start < 2.0
    (problem,) = info.value.problems
    assert problem.location == "description" and len(problem.message) < 200


@pytest.mark.parametrize("softcap, ok", [(0.0, True), (30.0, True), (1e-30, True), (1e30, True),
                                         (3e38, False), (1e-40, False), (1e31, False)])
def test_softcap_range(softcap: float, ok: bool):
    # 3e38 made softcap * log2(e) inf in fp32 (all-NaN output), 1e-40 scale / softcap inf (session 13 review)
    data = {"name": "t", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64, "softcap": softcap}
    if ok:
        assert spec_from_dict(data).softcap == softcap
    else:
        with pytest.raises(SpecError) as info:
            spec_from_dict(data)
        (problem,) = info.value.problems
        assert problem.location == "softcap" and "must be 0 (off) or in [1e-30, 1e+30]" in problem.message


def test_chunk_size_fits_int32():
    data = {"name": "t", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64,
            "mask": {"kind": "chunked", "chunk_size": 2**31}}
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert [p.location for p in info.value.problems] == ["mask.chunk_size"]
    data["mask"]["chunk_size"] = 2**31 - 1
    assert spec_from_dict(data).mask.chunk_size == 2**31 - 1
