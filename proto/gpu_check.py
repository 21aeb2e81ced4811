"""Prototype GPU check: compile variants of proto/fwd_sm90.py and compare with an fp32 reference."""

import math
import sys
import time

import torch

import cutlass
from cutlass import Float32, Int32

sys.path.insert(0, "proto")
import fwd_sm90 as K  # noqa: E402


def reference(q, k, v, scale, causal, wl, wr, chunk, softcap):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf.repeat_interleave(h // hk, dim=2)
    vf = vf.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    col = torch.arange(sk, device=q.device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal or chunk:
        ok &= col <= pos
    if chunk:
        ok &= col >= (pos.clamp(min=0) // chunk) * chunk
    if wl is not None and wl >= 0:
        ok &= col >= pos - wl
    if wr is not None and wr >= 0:
        ok &= col <= pos + wr
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return o, lse


def run_case(fn, cfg, dtype, b, sq, sk, h, hk, wl=-1, wr=-1, chunk=1, softcap=0.0):
    d, dv = cfg["HEAD_DIM"], cfg["HEAD_DIM_V"]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype)
    o = torch.full((b, sq, h, dv), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((b, h, sq), float("nan"), device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(d)
    if softcap:
        scale_log2, pre = softcap * math.log2(math.e), scale / softcap
    else:
        scale_log2, pre = scale * math.log2(math.e), 1.0
    fn(q, k, v, o, lse, scale_log2, pre, wl, wr, chunk)
    torch.cuda.synchronize()
    causal = cfg["CAUSAL"]
    use_chunk = chunk if cfg["CHUNKED"] else 0
    local = cfg["LOCAL"]
    ref_o, ref_lse = reference(q, k, v, scale, causal, wl if local else None, wr if local else None, use_chunk, softcap)
    lp_o, _ = reference(q, k, v, scale, causal, wl if local else None, wr if local else None, use_chunk, softcap)
    # low-precision reference: the same math with inputs and P in dtype
    err = (o.float() - ref_o).abs().max().item()
    lse_ok = torch.allclose(lse.transpose(1, 2).isinf(), ref_lse.transpose(1, 2).isinf())
    fin = ~ref_lse.isinf()
    lse_err = (lse - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
    nan = torch.isnan(o).any().item() or torch.isnan(lse).any().item()
    return err, lse_err, nan, lse_ok


VARIANTS = [
    dict(name="d128_causal", HEAD_DIM=128, HEAD_DIM_V=128, TILE_N=128, CAUSAL=True, LOCAL=False, CHUNKED=False, SOFTCAP=False),
    dict(name="d64_none", HEAD_DIM=64, HEAD_DIM_V=64, TILE_N=128, CAUSAL=False, LOCAL=False, CHUNKED=False, SOFTCAP=False),
    dict(name="d256_local_softcap", HEAD_DIM=256, HEAD_DIM_V=256, TILE_N=80, CAUSAL=False, LOCAL=True, CHUNKED=False, SOFTCAP=True),
    dict(name="d128_chunked", HEAD_DIM=128, HEAD_DIM_V=128, TILE_N=128, CAUSAL=False, LOCAL=False, CHUNKED=True, SOFTCAP=False),
    dict(name="d192_128_causal", HEAD_DIM=192, HEAD_DIM_V=128, TILE_N=112, CAUSAL=True, LOCAL=False, CHUNKED=False, SOFTCAP=False),
]


def main():
    torch.manual_seed(0)
    rows = []
    for cfg in VARIANTS:
        for dt_name, dtype, cdt in [("bf16", torch.bfloat16, cutlass.BFloat16), ("fp16", torch.float16, cutlass.Float16)]:
            if dt_name == "fp16" and cfg["name"] != "d128_causal":
                continue
            for key, val in cfg.items():
                if key != "name":
                    setattr(K, key, val)
            K.DTYPE = cdt
            K.HAS_MASK = K.CAUSAL or K.LOCAL or K.CHUNKED
            t0 = time.time()
            try:
                fn = K.compile_fake()
            except Exception as e:  # noqa: BLE001
                print(f"{cfg['name']} {dt_name}: COMPILE FAIL {type(e).__name__}: {str(e)[:400]}")
                continue
            ct = time.time() - t0
            cases = [
                dict(b=2, sq=128, sk=128, h=4, hk=4),
                dict(b=2, sq=113, sk=203, h=4, hk=2),
                dict(b=1, sq=300, sk=257, h=6, hk=1),
                dict(b=3, sq=1, sk=1, h=2, hk=2),
                dict(b=1, sq=250, sk=100, h=2, hk=2),
                dict(b=1, sq=1024, sk=1024, h=4, hk=4),
            ]
            for c in cases:
                extra = {}
                if K.LOCAL:
                    extra = dict(wl=64, wr=16)
                if K.CHUNKED:
                    extra = dict(chunk=96)
                if K.SOFTCAP:
                    extra["softcap"] = 30.0
                err, lse_err, nan, lse_ok = run_case(fn, cfg, dtype, **c, **extra)
                rows.append((cfg["name"], dt_name, f"{ct:.1f}s", str(c), f"{err:.2e}", f"{lse_err:.2e}", nan, lse_ok))
                print(*rows[-1], flush=True)


if __name__ == "__main__":
    main()
