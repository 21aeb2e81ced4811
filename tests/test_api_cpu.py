"""API stage without CUDA: the generated packages' `attention` signatures and input checks,
`fa4gen.build()`, and the exact reference `fa4gen.reference.attention_ref` against a naive loop.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import fa4gen
from fa4gen.reference import attention_ref
from fa4gen.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC_FILES = sorted((ROOT / "specs").glob("*.yaml"))
NAMES = [p.stem for p in SPEC_FILES]


def _package(name: str):
    return importlib.import_module(f"generated.{name}")


# --- generated packages ------------------------------------------------------------------------


def test_import_llama3_8b():
    pkg = _package("llama3_8b")
    assert pkg.SPEC_NAME == "llama3_8b"
    assert callable(pkg.attention)
    assert pkg._forward.plans["sm90"]["head_dim"] == 128


@pytest.mark.parametrize("name", NAMES)
def test_attention_signature(name):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    sig = inspect.signature(_package(name).attention)
    params = sig.parameters
    assert list(params)[:3] == ["q", "k", "v"]
    assert all(params[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ("q", "k", "v"))
    expected_kw = ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "seqused_k", "max_seqlen_k"] if spec.varlen else []
    expected_kw += ["softmax_scale"]
    if spec.mask.kind == "sliding_window":
        expected_kw.append("window")
    if spec.mask.kind == "chunked":
        expected_kw.append("chunk_size")
    expected_kw += ["return_lse", "out"]
    assert list(params)[3:] == expected_kw
    for p in expected_kw:
        assert params[p].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["softmax_scale"].default is None and params["out"].default is None
    assert params["return_lse"].default is False


def test_window_and_chunk_size_only_where_the_mask_has_them():
    assert "window" in inspect.signature(_package("mistral_7b").attention).parameters
    assert "window" in inspect.signature(_package("gemma2_9b").attention).parameters
    assert "chunk_size" in inspect.signature(_package("llama4_chunked").attention).parameters
    for name in ("llama3_8b", "vit_encoder", "deepseek_mla", "fa4_pipeline"):
        params = inspect.signature(_package(name).attention).parameters
        assert "window" not in params and "chunk_size" not in params
    with pytest.raises(TypeError):
        _package("llama3_8b").attention(None, None, None, window=(1, 0))


def _qkv(d=128, dv=None, dtype=torch.bfloat16, requires_grad=False):
    q = torch.randn(1, 8, 4, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(1, 8, 2, d, dtype=dtype)
    v = torch.randn(1, 8, 2, dv or d, dtype=dtype)
    return q, k, v


def test_cpu_tensors_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError) as info:
        _package("llama3_8b").attention(q, k, v)
    msg = str(info.value)
    assert msg.startswith("q:") and "CUDA" in msg and "cpu" in msg


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], None, 3.0])
def test_non_tensor_is_a_type_error(bad):
    _, k, v = _qkv()
    with pytest.raises(TypeError) as info:
        _package("llama3_8b").attention(bad, k, v)
    msg = str(info.value)
    assert msg.startswith("q:") and "torch.Tensor" in msg and type(bad).__name__ in msg


@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_check_tensor_names_the_argument(name):
    from fa4gen.api.runtime import check_tensor

    with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor, got list"):
        check_tensor(name, [1.0], dtype=torch.bfloat16, last_dim=128)
    with pytest.raises(TypeError, match=f"^{name}: expected dtype torch.bfloat16"):
        check_tensor(name, torch.zeros(1, 1, 1, 128, dtype=torch.float16), dtype=torch.bfloat16, last_dim=128)
    # device-independent: a well-formed CPU tensor passes; the CUDA check comes after all of these
    check_tensor(name, torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16), dtype=torch.bfloat16, last_dim=128)


def test_requires_grad_has_no_backward():
    q, k, v = _qkv(requires_grad=True)
    with pytest.raises(RuntimeError, match="has no backward"):
        _package("mistral_7b").attention(q, k, v)
    with torch.no_grad():  # under no_grad the same call gets to the device check
        with pytest.raises(ValueError, match="CUDA"):
            _package("mistral_7b").attention(q, k, v)


def test_lock_plans_match_planner():
    from fa4gen.plan import plan_kernels

    for name in NAMES:
        spec = load_spec(ROOT / "specs" / f"{name}.yaml")
        lock = json.loads((ROOT / "generated" / name / "spec.lock.json").read_text())
        plans = [p for arch in spec.targets for p in plan_kernels(spec, arch)]
        assert lock["plans"] == [json.loads(plan.to_json()) for plan in plans]
        assert _package(name)._forward.plans["sm90"] == lock["plans"][0]


def test_forward_kernel_is_picked_by_seqlen_q():
    """llama32_1b (d64 causal) holds a 128-row and a 192-row forward: the API runs the second from
    LONG_SEQLEN_Q query rows on (the longest sequence when packed); `pinned` forces one (golden checks)."""
    from fa4gen.plan.sm90 import LONG_SEQLEN_Q

    op = _package("llama32_1b")._forward
    pick = lambda s: op.forward_plan("sm90", s)["module"]  # noqa: E731
    assert [pick(s) for s in (1, LONG_SEQLEN_Q - 1, LONG_SEQLEN_Q, 10**6)] == [
        "fwd_sm90", "fwd_sm90", "fwd_sm90_long", "fwd_sm90_long"]
    assert op.plans["sm90"]["tile_m"] == 128 and op.forward_plan("sm90", LONG_SEQLEN_Q)["tile_m"] == 192
    with op.pinned("fwd_sm90_long"):
        assert pick(1) == "fwd_sm90_long"
    assert pick(1) == "fwd_sm90"
    with pytest.raises(ValueError, match="no kernel 'fwd_sm100'"):
        with op.pinned("fwd_sm100"):
            pass
    # one forward: every seqlen runs it
    single = _package("gemma2_9b")._forward  # d256: no room for the persistent forward's O buffer
    assert single.forward_plan("sm90", 10**6)["module"] == "fwd_sm90"
    # llama32_1b's 128-row forward is persistent (one CTA per SM), its 192-row one CTA per tile
    assert [p["scheduler"] for p in (op.plans["sm90"], op.forward_plan("sm90", LONG_SEQLEN_Q))] == ["persistent", "grid_lpt"]


@pytest.mark.parametrize("name", sorted(p.parent.name for p in (ROOT / "generated").glob("*/spec.lock.json")))
def test_kernel_plans_lists_every_kernel_of_the_lock_file(name):
    """`kernel_plans` (what precompile_ops compiles ahead of a GPU suite, what `fa4gen dispatch` lists) holds every
    kernel of each arch the package built, once: a kernel the runtime can pick but this list misses would compile
    only at its first call."""
    op = _package(name)._forward
    lock = json.loads((ROOT / "generated" / name / "spec.lock.json").read_text())
    for arch in op.plans:
        listed = [p["module"] for p in op.kernel_plans(arch)]
        assert len(listed) == len(set(listed))
        assert sorted(listed) == sorted(p["module"] for p in lock["plans"] if p["arch"] == arch)


def test_forward_kernel_is_picked_by_seqlen_q_range():
    """vit_encoder (d64, no mask): its 192-row persistent forward, the 128-row twin for seqlen_q in the plan's
    ranges (1-128, 193-256: ViT-B/16's 197 tokens; ViT-L/14-336's 577 runs 192 rows), the one-CTA-per-tile twin
    from PERSISTENT_MAX_SEQLEN_Q_192 on; `pinned` overrides."""
    from fa4gen.plan.sm90 import PERSISTENT_MAX_SEQLEN_Q, PERSISTENT_MAX_SEQLEN_Q_192

    op = _package("vit_encoder")._forward
    pick = lambda s: op.forward_plan("sm90", s)["module"]  # noqa: E731
    lengths = (1, 128, 129, 192, 193, 197, 256, 257, 512, 576, 577, 640, 641, 1024, PERSISTENT_MAX_SEQLEN_Q,
               PERSISTENT_MAX_SEQLEN_Q_192 - 1, PERSISTENT_MAX_SEQLEN_Q_192)
    twin, default, long = "fwd_sm90_rows128", "fwd_sm90", "fwd_sm90_long"
    assert [pick(s) for s in lengths] == [twin, twin, default, default, twin, twin, twin, default, default, default,
                                          default, default, default, default, default, default, long]
    assert [op.forward_plan("sm90", s)["tile_m"] for s in (197, 257)] == [128, 192]
    assert [p["module"] for p in op.kernel_plans("sm90") if p["direction"] == "fwd"] == [default, long, twin]
    with op.pinned(default):
        assert pick(197) == default
    assert pick(197) == twin


def test_backward_kernel_is_picked_by_head_counts():
    """llama3_8b (allow_gqa) holds two backwards: MHA calls run bwd_sm90_mha (dK/dV stored from the CTA),
    GQA / MQA calls bwd_sm90 (dK/dV summed in fp32 workspaces); `pinned` forces one, and refuses to run the MHA
    kernel on a GQA call. vit_encoder (allow_gqa: false) has only its one backward."""
    op = _package("llama3_8b")._forward
    pick = lambda h, h_kv: op.backward_plan("sm90", h, h_kv)["module"]  # noqa: E731
    assert [pick(32, 32), pick(32, 8), pick(32, 1), pick(1, 1)] == ["bwd_sm90_mha", "bwd_sm90", "bwd_sm90",
                                                                   "bwd_sm90_mha"]
    mha = op.backward_plan("sm90", 8, 8)
    assert mha["mha_only"] and not mha["dkv_accum"] and op.backward_plan("sm90", 8, 2)["dkv_accum"]
    with op.pinned("bwd_sm90"):
        # (a pinned backward leaves the forwards to their own rule)
        assert pick(8, 8) == "bwd_sm90" and op.forward_plan("sm90", 1)["module"] == "fwd_sm90"
    with op.pinned("bwd_sm90_mha"):
        assert pick(8, 8) == "bwd_sm90_mha"
        with pytest.raises(ValueError, match="bwd_sm90_mha is pinned, but it runs only calls with as many k/v heads"):
            pick(8, 2)
    assert pick(8, 8) == "bwd_sm90_mha" and op.backward_plan("sm90", 8, 8) is mha
    single = _package("vit_encoder")._forward
    assert [single.backward_plan("sm90", 4, h_kv)["module"] for h_kv in (4, 2)] == ["bwd_sm90"] * 2
    assert single.backward_plan("sm100", 4, 4) is None


def test_gqa_calls_with_enough_ctas_pick_the_head_loop_backward():
    """llama3_8b (allow_gqa, neither deterministic nor varlen) also holds bwd_sm90_gqa, whose CTA per (key block, kv
    head) runs its group's q heads: GQA / MQA calls of at least min_kv_ctas CTAs (key blocks x kv heads x batch) run
    it, fewer (and packed calls) bwd_sm90, MHA calls bwd_sm90_mha; pinned, it runs MHA calls too (groups of one).
    A packed spec has none."""
    from fa4gen.plan.sm90 import GQA_HEAD_LOOP_MIN_CTAS

    op = _package("llama3_8b")._forward
    loop = op.bwd_gqa_plans["sm90"]
    assert (loop["module"], loop["gqa_head_loop"], loop["dkv_accum"], loop["allow_gqa"]) == (
        "bwd_sm90_gqa", True, False, True)
    assert loop["min_kv_ctas"] == GQA_HEAD_LOOP_MIN_CTAS
    pick = lambda h, h_kv, b=0, s_k=0: op.backward_plan("sm90", h, h_kv, b, s_k)["module"]  # noqa: E731
    n = loop["tile_n"]
    b = -(-GQA_HEAD_LOOP_MIN_CTAS // (4 * 8))  # 4 key blocks x 8 kv heads per batch entry
    assert pick(32, 8, b, 4 * n) == "bwd_sm90_gqa"
    assert pick(32, 8, b, 3 * n + 1) == "bwd_sm90_gqa"  # a partial last key block counts
    assert pick(32, 8, b - 1, 4 * n) == "bwd_sm90"
    assert pick(32, 8, b, 3 * n) == "bwd_sm90"
    assert pick(32, 1, 64 * b, 4 * n) == "bwd_sm90_gqa"  # MQA
    assert pick(32, 8) == "bwd_sm90"  # packed (no batch): never the head loop
    assert pick(32, 32, 10**4, 10**5) == "bwd_sm90_mha"
    with op.pinned("bwd_sm90_gqa"):
        assert pick(8, 8, 1, 1) == "bwd_sm90_gqa" and pick(8, 2) == "bwd_sm90_gqa"
    assert _package("qwen2_7b_packed")._forward.bwd_gqa_plans == {}


def test_persistent_forward_gets_the_gpus_sm_count():
    """vit_encoder (no mask): the persistent forward below PERSISTENT_MAX_SEQLEN_Q_192 query rows (its 128-row twin
    at the lengths that pad 192-row tiles worst), its one-CTA-per-tile twin from there on; the persistent one launches one CTA per SM of the call's GPU (the
    API's last run-time argument: an H100 PCIe's 114, an H20's 78, a MIG slice's), cached per device, and
    off CUDA the plan's compile-time stand-in (132)."""
    from fa4gen.plan.sm90 import PERSISTENT_CTAS, PERSISTENT_MAX_SEQLEN_Q_192

    op = _package("vit_encoder")._forward
    pick = lambda s: (op.forward_plan("sm90", s)["module"], op.forward_plan("sm90", s)["scheduler"])  # noqa: E731
    assert [pick(s) for s in (1, 512, PERSISTENT_MAX_SEQLEN_Q_192 - 1, PERSISTENT_MAX_SEQLEN_Q_192)] == [
        ("fwd_sm90_rows128", "persistent")] + [("fwd_sm90", "persistent")] * 2 + [("fwd_sm90_long", "grid")]
    plan = op.plans["sm90"]
    assert plan["persistent_ctas"] == PERSISTENT_CTAS
    assert op.persistent_ctas(plan, torch.device("cpu")) == PERSISTENT_CTAS
    seen = []

    class Props:
        multi_processor_count = 78

    def props(device):
        seen.append(device)
        return Props()

    op._sm_count_by_device.clear()
    try:
        with mock.patch.object(torch.cuda, "get_device_properties", props):
            assert [op.persistent_ctas(plan, torch.device("cuda", 1)) for _ in range(3)] == [78] * 3
        assert len(seen) == 1  # asked once per device
    finally:
        op._sm_count_by_device.clear()


def test_spread_ctas_walks_every_cta_through_every_query_tile():
    """A persistent forward whose idle warpgroups skip a sequence's last, partial tile: with 132 CTAs and 3 / 6 / 11
    192-row tiles per sequence (seqlen 512 / 1024 / 2048) CTA c met query tile c mod num_m in every iteration, so the
    cheap last tiles all went to the same CTAs; a CTA count coprime to num_m deals them round (131 here)."""
    from fa4gen.api.runtime import spread_ctas

    assert [spread_ctas(132, s, 192, 16384 // s * 32) for s in (512, 1024, 2048)] == [131] * 3
    # nothing to spread: whole tiles (576 = 3 x 192), a last tile with a row for every warpgroup (190, 520), or
    # every tile in one wave
    assert [spread_ctas(132, s, 192, 512) for s in (576, 190, 520)] == [132] * 3
    assert spread_ctas(132, 1024, 192, 22) == 132 and spread_ctas(132, 1024, 192, 23) == 131
    for sms in (78, 114, 132):
        for s in range(65, 4096, 61):
            num_m = -(-s // 192)
            n = spread_ctas(sms, s, 192, 64)
            assert 1 <= n <= sms
            if n != sms:
                assert math.gcd(n, num_m) == 1 and all(math.gcd(m, num_m) != 1 for m in range(n + 1, sms + 1))
                # CTA c's k-th tile is c + k n: over num_m iterations it meets every query tile once
                assert all({(c + k * n) % num_m for k in range(num_m)} == set(range(num_m)) for c in range(n))
    op = _package("vit_encoder")._forward
    plan = op.plans["sm90"]
    assert plan["skip_idle_warpgroups"] and plan["scheduler"] == "persistent"
    assert op.persistent_ctas(plan, torch.device("cpu"), 1024, 512) == 131
    assert op.persistent_ctas(plan, torch.device("cpu"), 1152, 512) == 132  # 6 whole tiles
    assert op.persistent_ctas(plan, torch.device("cpu")) == 132  # no call shape: the SM count


# --- fa4gen.build --------------------------------------------------------------------------------

VALID = {
    "name": "api_probe", "targets": ["sm90"], "dtype": "fp16", "head_dim": 64,
    "mask": {"kind": "chunked", "chunk_size": 256},
}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(root))
    before = set(sys.modules)
    yield root
    for mod in set(sys.modules) - before:
        if mod.startswith("fa4gen_pkg_"):
            del sys.modules[mod]


def test_build_dict_returns_module(cache_dir):
    mod = fa4gen.build(dict(VALID))
    params = inspect.signature(mod.attention).parameters
    assert "chunk_size" in params and "window" not in params
    pkg_dir = Path(mod.__file__).parent
    assert pkg_dir.parent == cache_dir / "packages"
    assert pkg_dir.name.startswith("fa4gen_pkg_api_probe_")
    # d64 with a mask: a 128-row forward and a 192-row one for long calls
    assert sorted(p.name for p in pkg_dir.iterdir() if p.is_file()) == [
        "__init__.py", "fwd_sm90.py", "fwd_sm90_long.py", "spec.lock.json"]
    lock = json.loads((pkg_dir / "spec.lock.json").read_text())
    assert lock["spec"]["mask"] == {"kind": "chunked", "chunk_size": 256}
    assert lock["plans"][0]["chunk_size"] == 256 and lock["plans"][0]["torch_dtype"] == "float16"
    assert fa4gen.build(dict(VALID)) is mod  # same spec -> same package, already imported
    q, k, v = _qkv(d=64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        mod.attention(q, k, v)


def test_short_sliding_window_keeps_the_128_row_forward(cache_dir):
    """A masked d64 spec's 192-row forward runs from LONG_SEQLEN_Q query rows on, except for calls whose sliding
    window spans fewer than LONG_WINDOW_KEYS keys per row (left + right + 1): the 128-row persistent forward then
    runs at every length (sessions 55 and 58's A/Bs). The call's window decides, the spec's when it passes none; varlen
    specs (a 128-row forward that is not persistent) keep the seqlen_q rule alone."""
    from fa4gen.plan.sm90 import LONG_SEQLEN_Q, LONG_WINDOW_KEYS

    spec = dict(VALID, name="window_probe", mask={"kind": "sliding_window", "left": 1024, "right": 0})
    op = fa4gen.build(spec)._forward
    pick = lambda s, w=None: op.forward_plan("sm90", s, w)["module"]  # noqa: E731
    assert op.long_plans["sm90"][0]["min_window_keys"] == LONG_WINDOW_KEYS == 2050
    assert [pick(s) for s in (1, LONG_SEQLEN_Q, 10**6)] == ["fwd_sm90"] * 3  # the spec's window: 1025 keys
    assert pick(LONG_SEQLEN_Q, (LONG_WINDOW_KEYS - 1, 0)) == "fwd_sm90_long"  # exactly LONG_WINDOW_KEYS keys
    assert pick(LONG_SEQLEN_Q, (LONG_WINDOW_KEYS - 2, 0)) == "fwd_sm90"
    assert pick(LONG_SEQLEN_Q, (1200, LONG_WINDOW_KEYS - 1201)) == "fwd_sm90_long"  # both sides count
    assert pick(LONG_SEQLEN_Q, (-1, 0)) == "fwd_sm90_long"  # unbounded left: as causal
    assert pick(LONG_SEQLEN_Q - 1, (-1, 0)) == "fwd_sm90"
    with pytest.raises(ValueError, match=r"^window: expected \(left, right\)"):
        pick(LONG_SEQLEN_Q, (1.5, 0))
    # a causal spec's 192-row plan has no window bound
    causal = dict(VALID, name="causal_probe", mask={"kind": "causal"})
    assert fa4gen.build(causal)._forward.long_plans["sm90"][0]["min_window_keys"] == 0
    packed = fa4gen.build(dict(spec, name="window_probe_packed", varlen=True))._forward
    assert packed.long_plans["sm90"][0]["min_window_keys"] == 0
    assert packed.forward_plan("sm90", LONG_SEQLEN_Q, (16, 0))["module"] == "fwd_sm90_long"


def test_short_chunks_keep_the_128_row_forward(cache_dir):
    """The same rule for a chunked d64 spec: chunks shorter than LONG_CHUNK_KEYS (the causal crossover LONG_SEQLEN_Q:
    a chunked call is causal attention over one chunk at a time) keep the 128-row persistent forward at every
    seqlen_q; the call's chunk_size decides, the spec's when it passes none, and a bad one is refused by name."""
    from fa4gen.plan.sm90 import LONG_CHUNK_KEYS, LONG_SEQLEN_Q

    op = fa4gen.build(dict(VALID, name="chunk_probe", mask={"kind": "chunked", "chunk_size": 1024}))._forward
    pick = lambda s, c=None: op.forward_plan("sm90", s, chunk_size=c)["module"]  # noqa: E731
    (long,) = op.long_plans["sm90"]
    assert long["min_window_keys"] == LONG_CHUNK_KEYS == LONG_SEQLEN_Q
    assert "chunks are shorter than 2560 keys" in long["notes"][-1]
    assert [pick(s) for s in (1, LONG_SEQLEN_Q, 10**6)] == ["fwd_sm90"] * 3  # the spec's chunk: 1024 keys
    assert pick(LONG_SEQLEN_Q, LONG_CHUNK_KEYS) == "fwd_sm90_long"
    assert pick(LONG_SEQLEN_Q, LONG_CHUNK_KEYS - 1) == "fwd_sm90"
    assert pick(LONG_SEQLEN_Q - 1, 8192) == "fwd_sm90"  # below LONG_SEQLEN_Q: the seqlen_q rule first
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"^chunk_size: expected an int in \[1, 2\*\*31\)"):
            pick(LONG_SEQLEN_Q, bad)
    # (the golden table names the rule)
    from fa4gen.golden.checks import check_name

    assert check_name(long, "fwd") == f"seqlen_q>={LONG_SEQLEN_Q} chunk>={LONG_CHUNK_KEYS}keys fwd"


def test_short_chunks_and_windows_keep_the_persistent_forward(cache_dir):
    """A masked d128 spec's persistent forward hands calls from PERSISTENT_MAX_SEQLEN_Q_MASKED query rows on to its
    one-CTA-per-tile twin, except calls whose chunks are shorter than PERSISTENT_CHUNK_KEYS (the causal bound: a
    chunked call is causal attention over one chunk at a time) or whose sliding window spans fewer than
    PERSISTENT_WINDOW_KEYS keys per row: those run the persistent forward at every seqlen_q. The call's chunk / window
    decides, the spec's when it passes none; a causal spec and a packed (varlen: not persistent) one keep the seqlen_q
    rule alone."""
    from fa4gen.golden.checks import check_name
    from fa4gen.plan.sm90 import (PERSISTENT_CHUNK_KEYS, PERSISTENT_MAX_SEQLEN_Q, PERSISTENT_MAX_SEQLEN_Q_MASKED,
                                   PERSISTENT_WINDOW_KEYS)

    base = dict(VALID, dtype="bf16", head_dim=128)
    chunked = fa4gen.build(dict(base, name="chunk_probe_d128", mask={"kind": "chunked", "chunk_size": 1024}))._forward
    (long,) = chunked.long_plans["sm90"]
    assert (long["module"], long["min_seqlen_q"]) == ("fwd_sm90_long", PERSISTENT_MAX_SEQLEN_Q_MASKED)
    assert long["min_window_keys"] == PERSISTENT_CHUNK_KEYS == PERSISTENT_MAX_SEQLEN_Q_MASKED
    assert "chunks are shorter than 8192 keys" in long["notes"][-1]
    bound = PERSISTENT_MAX_SEQLEN_Q_MASKED
    assert check_name(long, "fwd") == f"seqlen_q>={bound} chunk>={PERSISTENT_CHUNK_KEYS}keys fwd"
    pick = lambda op, s, w=None, c=None: op.forward_plan("sm90", s, w, c)["module"]  # noqa: E731
    assert [pick(chunked, s) for s in (1, bound, 10**6)] == ["fwd_sm90"] * 3  # the spec's 1024
    assert pick(chunked, PERSISTENT_MAX_SEQLEN_Q_MASKED, c=PERSISTENT_CHUNK_KEYS) == "fwd_sm90_long"
    assert pick(chunked, PERSISTENT_MAX_SEQLEN_Q_MASKED, c=PERSISTENT_CHUNK_KEYS - 1) == "fwd_sm90"
    assert pick(chunked, PERSISTENT_MAX_SEQLEN_Q_MASKED - 1, c=2 * PERSISTENT_CHUNK_KEYS) == "fwd_sm90"  # below the bound

    windowed = fa4gen.build(dict(base, name="window_probe_d128",
                                 mask={"kind": "sliding_window", "left": 4095, "right": 0}))._forward
    (long,) = windowed.long_plans["sm90"]
    assert long["min_window_keys"] == PERSISTENT_WINDOW_KEYS
    assert pick(windowed, PERSISTENT_MAX_SEQLEN_Q_MASKED) == "fwd_sm90_long"  # the spec's window: 4096 keys
    assert pick(windowed, PERSISTENT_MAX_SEQLEN_Q_MASKED, (PERSISTENT_WINDOW_KEYS - 1, 0)) == "fwd_sm90_long"
    assert pick(windowed, 10**6, (PERSISTENT_WINDOW_KEYS - 2, 0)) == "fwd_sm90"
    assert pick(windowed, PERSISTENT_MAX_SEQLEN_Q_MASKED, (1000, PERSISTENT_WINDOW_KEYS - 1001)) == "fwd_sm90_long"
    assert pick(windowed, PERSISTENT_MAX_SEQLEN_Q_MASKED, (-1, 0)) == "fwd_sm90_long"  # unbounded: as causal

    causal = fa4gen.build(dict(base, name="causal_probe_d128", mask={"kind": "causal"}))._forward
    assert causal.long_plans["sm90"][0]["min_window_keys"] == 0
    # masked calls keep the persistent forward below PERSISTENT_MAX_SEQLEN_Q_MASKED; calls without a mask hand over
    # from PERSISTENT_MAX_SEQLEN_Q (session 64's causal pins)
    assert PERSISTENT_MAX_SEQLEN_Q < PERSISTENT_MAX_SEQLEN_Q_MASKED
    assert [pick(causal, s) for s in (PERSISTENT_MAX_SEQLEN_Q, PERSISTENT_MAX_SEQLEN_Q_MASKED - 1,
                                      PERSISTENT_MAX_SEQLEN_Q_MASKED)] == ["fwd_sm90", "fwd_sm90", "fwd_sm90_long"]
    packed = fa4gen.build(dict(base, name="chunk_probe_d128_packed", varlen=True,
                               mask={"kind": "chunked", "chunk_size": 1024}))._forward
    assert packed.long_plans.get("sm90", []) == []  # a varlen forward is not persistent: one kernel
    assert packed.forward_plan("sm90", 10**6)["scheduler"] != "persistent"


def test_build_out_dir(tmp_path, cache_dir):
    mod = fa4gen.build(ROOT / "specs" / "vit_encoder.yaml", out_dir=tmp_path / "pkgs")
    assert Path(mod.__file__).parent.parent == tmp_path / "pkgs"
    assert not (cache_dir / "packages").exists()
    committed = (ROOT / "generated" / "vit_encoder" / "fwd_sm90.py").read_text().splitlines()[1:]
    built = Path(mod.__file__).with_name("fwd_sm90.py").read_text().splitlines()[1:]
    assert built == committed  # only the provenance line (spec label) may differ


def test_build_invalid_dict_names_the_field(cache_dir):
    with pytest.raises(SpecError) as info:
        fa4gen.build({**VALID, "head_dim": 100, "pipeline": {"tile_n": 17}})
    locations = [p.location for p in info.value.problems]
    assert locations == ["head_dim", "pipeline.tile_n"]
    assert "<dict>: head_dim:" in str(info.value)
    assert not (cache_dir / "packages").exists()


def test_build_unplannable_dict(cache_dir):
    from fa4gen.plan import PlanError

    with pytest.raises(PlanError, match="shared memory"):
        fa4gen.build({**VALID, "head_dim": 256, "pipeline": {"tile_n": 256, "kv_stages": 4}})
    assert not (cache_dir / "packages").exists()


# --- exact reference vs a naive loop -------------------------------------------------------------


def _visible(i, j, s_q, s_k, causal, window, chunk) -> bool:
    pos = i + s_k - s_q  # bottom-right aligned
    if causal and j > pos:
        return False
    if window is not None:
        left, right = window
        if left is not None and left >= 0 and j < pos - left:
            return False
        if right is not None and right >= 0 and j > pos + right:
            return False
    if chunk:
        if j > pos or pos < 0 or j // chunk != pos // chunk:
            return False
    return True


def naive_attention(q, k, v, *, scale, causal=False, window=None, chunk=None, softcap=0.0):
    """Per-row loops over Python floats: out (b, s_q, h, dv) and natural-log lse (b, h, s_q)."""
    b, s_q, h, d = q.shape
    s_k, h_kv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = h // h_kv
    Q, K, V = q.tolist(), k.tolist(), v.tolist()
    out = [[[[0.0] * dv for _ in range(h)] for _ in range(s_q)] for _ in range(b)]
    lse = [[[-math.inf] * s_q for _ in range(h)] for _ in range(b)]
    for bi in range(b):
        for hi in range(h):
            hk = hi // group
            for i in range(s_q):
                scores = {}
                for j in range(s_k):
                    if not _visible(i, j, s_q, s_k, causal, window, chunk):
                        continue
                    s = sum(Q[bi][i][hi][x] * K[bi][j][hk][x] for x in range(d)) * scale
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    scores[j] = s
                if not scores:
                    continue
                m = max(scores.values())
                weights = {j: math.exp(s - m) for j, s in scores.items()}
                total = sum(weights.values())
                lse[bi][hi][i] = m + math.log(total)
                for x in range(dv):
                    out[bi][i][hi][x] = sum(w * V[bi][j][hk][x] for j, w in weights.items()) / total
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


CASES = {
    "none": dict(s_q=5, s_k=9),
    "causal": dict(s_q=7, s_k=9, causal=True),
    "causal_square": dict(s_q=8, s_k=8, causal=True),
    "window_left_right": dict(s_q=7, s_k=9, window=(2, 1)),
    "window_left_only": dict(s_q=9, s_k=9, window=(3, -1)),
    "window_right_only": dict(s_q=6, s_k=9, window=(None, 0)),
    "chunked": dict(s_q=7, s_k=9, chunk=3),
    "chunked_square": dict(s_q=8, s_k=8, chunk=4),
    "softcap": dict(s_q=6, s_k=6, causal=True, softcap=2.0, scale=1.3),
    "gqa_2": dict(s_q=5, s_k=7, h=4, h_kv=2, causal=True),
    "mqa": dict(s_q=5, s_k=7, h=4, h_kv=1),
    "head_dim_v": dict(s_q=4, s_k=6, d=12, dv=8, window=(1, 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_naive_loop(case):
    c = dict(CASES[case])
    s_q, s_k = c.pop("s_q"), c.pop("s_k")
    h, h_kv = c.pop("h", 2), c.pop("h_kv", 2)
    d, dv = c.pop("d", 16), c.pop("dv", None)
    scale = c.pop("scale", None)
    gen = torch.Generator().manual_seed(list(CASES).index(case))
    q = torch.randn(2, s_q, h, d, generator=gen) * 2
    k = torch.randn(2, s_k, h_kv, d, generator=gen) * 2
    v = torch.randn(2, s_k, h_kv, dv or d, generator=gen)
    out, lse = attention_ref(q, k, v, softmax_scale=scale, dtype=torch.float64, **c)
    ref_out, ref_lse = naive_attention(q, k, v, scale=scale if scale is not None else d ** -0.5, **c)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    # a wrong mask is not hidden by the comparison: the unmasked result differs when a mask is set
    if any(key in c for key in ("causal", "window", "chunk")):
        unmasked, _ = attention_ref(q, k, v, softmax_scale=scale, dtype=torch.float64,
                                    softcap=c.get("softcap", 0.0))
        assert not torch.allclose(out, unmasked)


@pytest.mark.parametrize("kw", [
    dict(causal=True),  # s_q > s_k: the first rows sit before every key
    dict(window=(0, 0)),
    dict(chunk=2),
])
def test_fully_masked_rows(kw):
    s_q, s_k = 6, 3
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, s, 2, 8, generator=gen) for s in (s_q, s_k, s_k))
    out, lse = attention_ref(q, k, v, dtype=torch.float64, **kw)
    ref_out, ref_lse = naive_attention(q, k, v, scale=8 ** -0.5, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)  # (b, h, s_q)
    assert empty.any() and not empty.all()
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    rows_out = out.permute(0, 2, 1, 3)  # (b, h, s_q, d)
    assert (rows_out[empty] == 0).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-10, atol=1e-12)


def test_window_sides_stay_inside_int32():
    """The kernels add window sides to key-space positions (in [-seqlen_q, seqlen_k)) in Int32: sides
    wider than both sequences are clamped, and lengths whose sum would wrap are refused naming k (a
    session 13 review: rows would silently see no key)."""
    from fa4gen.api.runtime import ForwardOp, clamp_window
    from fa4gen.plan import plan_kernels
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict({"name": "w", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64,
                           "mask": {"kind": "sliding_window", "left": 100, "right": 20}})
    plan = plan_kernels(spec, "sm90")[0].to_dict()
    assert clamp_window(2**31 - 1, 5, 300, 200) == (300, 5)
    assert ForwardOp._runtime_args(plan, 0.125, None, None, seqlens=(2**30 - 1, 2**30))[-2:] == [100, 20]
    with pytest.raises(ValueError, match=r"^k: a sliding window needs seqlen_q \+ seqlen_k < 2\*\*31"):
        ForwardOp._runtime_args(plan, 0.125, None, None, seqlens=(2**30, 2**30))
