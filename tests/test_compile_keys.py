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
