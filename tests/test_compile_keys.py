"""The cache key of a generated kernel covers exactly the device helpers it imports (transitively)."""

from pathlib import Path

import fa4gen.compile.generated as gen

ROOT = Path(__file__).resolve().parents[1]


def test_key_follows_used_helpers_only(monkeypatch):
    source = (ROOT / "generated" / "llama3_8b" / "fwd_sm90.py").read_text()
    used = gen.used_helper_sources(source)
    assert {"softmax.py", "mask.py", "polyexp.py", "layout.py", "sm90.py", "fake.py"} <= set(used)
    base = gen.kernel_cache_key(source, "sm_90a")
    real = gen.device_helper_sources

    def with_edit(name):
        def fake():
            helpers = dict(real())
            helpers[name] = helpers.get(name, "") + "\n# edited\n"
            return helpers
        return fake

    monkeypatch.setattr(gen, "device_helper_sources", with_edit("polyexp.py"))  # imported by softmax.py
    assert gen.kernel_cache_key(source, "sm_90a") != base
    monkeypatch.setattr(gen, "device_helper_sources", with_edit("unrelated_family.py"))
    assert gen.kernel_cache_key(source, "sm_90a") == base
    monkeypatch.setattr(gen, "device_helper_sources", real)
    assert gen.kernel_cache_key(source, "sm_100a") != base
    assert gen.kernel_cache_key(source + "\n", "sm_90a") != base


# --- a stale kernel must never be stored under a new key (session 13 review) ----------------------

import warnings  # noqa: E402

import pytest  # noqa: E402


@pytest.mark.parametrize("spelling", [
    "from . import polyexp",
    "from fa4gen.device import (\n    polyexp,\n)",
    "import fa4gen.device.polyexp as p",
    "from fa4gen.device.polyexp import exp2_poly",
])
def test_every_import_spelling_puts_the_helper_in_the_key(spelling):
    # a regex of one spelling let the others through: editing polyexp.py then kept the key
    assert "polyexp.py" in gen.used_helper_sources(spelling + "\n")


def test_cute_dsl_settings_that_change_code_are_in_the_key(monkeypatch):
    source = (ROOT / "generated" / "llama3_8b" / "fwd_sm90.py").read_text()
    for var in [k for k in __import__("os").environ if k.startswith("CUTE_DSL_")]:
        monkeypatch.delenv(var)
    base = gen.kernel_cache_key(source, "sm_90a")
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", "/tmp/x")  # where files go: not the code
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # keyed on its own
    assert gen.kernel_cache_key(source, "sm_90a") == base
    for var in ("CUTE_DSL_LINEINFO", "CUTE_DSL_DEBUG", "CUTE_DSL_ENABLE_ASSERTIONS"):
        monkeypatch.setenv(var, "1")
        assert gen.kernel_cache_key(source, "sm_90a") != base, var
        monkeypatch.delenv(var)


def test_helpers_edited_after_this_process_read_them_keep_the_key_and_are_not_stored(monkeypatch, tmp_path):
    """The key describes the helpers this process runs (its snapshot), and what compiles after an edit on
    disk is not stored: it was traced from the imported helpers, not from the file's new text."""
    calls = []
    monkeypatch.setattr(gen, "compile_kernel", lambda **kw: calls.append(kw) or kw)
    monkeypatch.setattr(gen, "_HELPER_SNAPSHOT", None)
    monkeypatch.setattr(gen, "_WARNED_STALE", set())
    kernel = tmp_path / "fwd_sm90.py"
    kernel.write_text((ROOT / "generated" / "llama3_8b" / "fwd_sm90.py").read_text())
    plan = {"cute_arch": "sm_90a", "name": "k", "module": "fwd_sm90", "class_name": "FlashFwdSm90"}
    from fa4gen.compile.cache import DiskCache

    cache = DiskCache(tmp_path / "cache")
    gen.compile_generated(kernel, "pkg.fwd_sm90", plan, cache=cache)
    real = gen.device_helper_sources
    monkeypatch.setattr(gen, "device_helper_sources",
                        lambda: {**real(), "softmax.py": real()["softmax.py"] + "\n# edited\n"})
    with pytest.warns(UserWarning, match=r"changed on disk since this process imported them \(softmax.py\)"):
        gen.compile_generated(kernel, "pkg.fwd_sm90", plan, cache=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per helper
        gen.compile_generated(kernel, "pkg.fwd_sm90", plan, cache=cache)
    assert calls[0]["key"] == calls[1]["key"] == calls[2]["key"]
    assert calls[0]["store"] and not calls[1]["store"] and not calls[2]["store"]


@pytest.mark.compile
def test_a_module_already_imported_under_the_name_is_not_what_compiles(tmp_path):
    """A package rebuilt in a running process (or reloaded after `fa4gen build`) keeps its old kernel module
    in sys.modules under the same name; the miss for the new text traced that old module and stored its
    kernel under the new text's key — a causal spec then ran full attention in every later process. The
    module compiled is executed from the text the key hashed."""
    pytest.importorskip("cutlass")
    from fa4gen.builder import render_spec
    from fa4gen.spec import spec_from_dict

    def module_text(mask):
        spec = spec_from_dict({"name": "stale_mod", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64,
                               "mask": {"kind": mask}, "pipeline": {"tile_m": 128}})
        pkg, plans, _ = render_spec(spec, "t")
        return pkg.files["fwd_sm90.py"], plans[0].to_dict()

    full, _ = module_text("none")
    causal, causal_plan = module_text("causal")
    path = tmp_path / "fwd_sm90.py"
    path.write_text(full)
    stale = gen.import_from_path("stale_pkg_t.fwd_sm90", path)  # the old module, as a running process has it
    assert not getattr(stale, "MASK", {}).get("causal")
    path.write_text(causal)  # rebuilt with a causal mask
    from fa4gen.compile.cache import DiskCache

    got = gen.compile_generated(path, "stale_pkg_t.fwd_sm90", causal_plan, cache=DiskCache(tmp_path / "c"), keep_sass=True)
    other = tmp_path / "other.py"
    other.write_text(causal)
    want = gen.compile_generated(other, "fresh_pkg_t.fwd_sm90", causal_plan, cache=None, keep_sass=True)
    counts = lambda r: {k: v for k, v in r.meta["sass"].items() if k != "kernels"}  # noqa: E731 (names differ)
    assert counts(got) == counts(want) and got.meta["registers"] == want.meta["registers"]
    traced = [m for n, m in __import__("sys").modules.items() if n.startswith("stale_pkg_t.fwd_sm90__")]
    assert traced and all(getattr(m, "MASK", {}).get("causal") for m in traced)


# --- the parse of each text is remembered across processes (a cache hit's time was mostly that parse) -------

@pytest.fixture
def fresh_memo(monkeypatch, tmp_path):
    """An empty cache folder and no imports memo in this process (as a new process starts)."""
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gen, "_IMPORTS_MEMO", None)
    monkeypatch.setattr(gen, "_IMPORTS_MEMO_DIRTY", False)
    return tmp_path / "cache" / gen.IMPORTS_MEMO_FILE


def _new_process(monkeypatch):
    monkeypatch.setattr(gen, "_IMPORTS_MEMO", None)


def test_imports_memo_serves_a_later_process_without_parsing(fresh_memo, monkeypatch):
    source = (ROOT / "generated" / "llama3_8b" / "fwd_sm90.py").read_text()
    first = gen.used_helper_sources(source)
    assert fresh_memo.is_file()
    _new_process(monkeypatch)

    def no_parse(*a, **k):
        raise AssertionError("parsed although the memo had the text")

    monkeypatch.setattr(gen.ast, "parse", no_parse)
    assert gen.used_helper_sources(source) == first
    assert gen.kernel_cache_key(source, "sm_90a", gen.used_helper_sources(source)) == gen.kernel_cache_key(
        source, "sm_90a", first)
    # a text it has not seen is parsed (and the parse is what decides)
    monkeypatch.undo()
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(fresh_memo.parent))
    assert "polyexp.py" in gen.used_helper_sources("from fa4gen.device import (\n    polyexp,\n)\n# new text\n")


@pytest.mark.parametrize("content", [
    "not json",
    '{"version": "0-py2.7", "imports": {}}',
    '{"version": "%s", "imports": []}',
    '{"version": "%s", "imports": {"%s": ["mask; import os"]}}',
])
def test_a_bad_or_foreign_memo_is_ignored(fresh_memo, monkeypatch, content):
    """A memo of another version, or one that does not read as the format, never decides a key: the texts are
    parsed again (an entry naming a non-identifier is dropped) and the file is rewritten."""
    source = "from . import polyexp\n"
    digest = gen.hashlib.sha256(source.encode()).hexdigest()
    fresh_memo.parent.mkdir(parents=True)
    fresh_memo.write_text(content.replace("%s", gen._IMPORTS_MEMO_VERSION, 1).replace("%s", digest))
    assert set(gen.used_helper_sources(source)) == {"__init__.py", "polyexp.py"}
    assert gen.json.loads(fresh_memo.read_text())["version"] == gen._IMPORTS_MEMO_VERSION


def test_an_unwritable_cache_folder_only_costs_the_parse(fresh_memo, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be created
    assert "polyexp.py" in gen.used_helper_sources("import fa4gen.device.polyexp as p\n")
