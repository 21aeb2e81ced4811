"""tools/cta_cost.py: the per-CTA / per-query-block fit of a backward main kernel from bwd_profile rows (CPU)."""

from __future__ import annotations

import json

import pytest
from conftest import load_tool

cta = load_tool("cta_cost")


def _row(s, fa4gen_us, fa4_us=None, d=64, causal=False):
    row = {"d": d, "dv": d, "seqlen": str(s), "causal": causal,
           "fa4gen": {"kernel_cutlass_kernel_fa4gen_pkg_x_bwd_sm90__abc": fa4gen_us, "ConvertChunks": 49.0}}
    if fa4_us is not None:
        row["fa4"] = {"kernel_flash_bwd_sm90FlashAttentionBackwardSm90_x": fa4_us, "postprocess": 49.0}
    return row


def test_session_44s_d64_rows_give_its_per_cta_cost():
    """Session 44's d64 no-mask main kernels (H200: 397.6 / 674.3 µs ours, 387.1 / 660.8 flash-attn-4's at s512 /
    s1k, 128 x 128 tiles): 4,096 CTAs of 4 and of 8 query blocks, so P + 4B = 12.81 and P + 8B = 21.73 µs per CTA."""
    rows = [_row(512, 397.6, 387.1), _row(1024, 674.3, 660.8)]
    assert cta.work(512, 64, False, 128, 128) == (4096, 4096 * 4)
    out = cta.run(rows, 64, False, 132, 128, 128)
    assert out["fa4gen"]["P_us"] == pytest.approx(3.90, abs=0.01)
    assert out["fa4gen"]["B_us"] == pytest.approx(2.23, abs=0.01)
    assert out["fa4"]["P_us"] == pytest.approx(3.65, abs=0.01)
    share = out["fa4gen"]["points"][0][4]
    assert share == pytest.approx(3.90 / 12.81, abs=0.005)  # 30% of an s512 CTA


def test_causal_rows_count_each_key_blocks_visits():
    """Causal (s_q = s_k): key block n visits the query blocks from its diagonal on; 80-row query tiles against
    128-key blocks start at the tile holding row 128 n."""
    ctas, blocks = cta.work(512, 128, True, 128, 128)
    pairs = 32 * 16
    assert ctas == 4 * pairs and blocks == (4 + 3 + 2 + 1) * pairs
    _, blocks80 = cta.work(512, 128, True, 80, 128)
    assert blocks80 == (7 + 6 + 4 + 3) * pairs  # ceil(512 / 80) = 7 tiles; key block n starts at tile 128 n // 80


def test_a_fit_needs_rows_that_separate_the_two_costs(tmp_path, capsys):
    with pytest.raises(ValueError, match="two or more lengths"):
        cta.run([_row(512, 400.0)], 64, False, 132, 128, 128)
    path = tmp_path / "p.json"
    path.write_text(json.dumps([_row(512, 397.6), _row(1024, 674.3), _row(2048, 1230.0)]))
    assert cta.main([str(path), "--head-dim", "64", "--tile-m", "128", "--tile-n", "128"]) == 0
    printed = capsys.readouterr().out
    assert "fa4gen: P = " in printed and "s2048: 4096 CTAs, 16.0 blocks each" in printed
    assert cta.main([str(path), "--head-dim", "128", "--tile-m", "80", "--tile-n", "128"]) == 2
    assert "no rows at head dim 128" in capsys.readouterr().err
    path.write_text("{not json")
    assert cta.main([str(path), "--head-dim", "64", "--tile-m", "128", "--tile-n", "128"]) == 2


def test_default_tiles_are_fa4gens_plan():
    assert cta.plan_tiles(128, False) == (80, 128)
    assert cta.plan_tiles(64, False) == (128, 128)
