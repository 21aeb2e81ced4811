"""Cold first call, this tree against a prepared ref (`tools/ab_bench.sh prepare REF`, .ab/ref) and flash-attn-4,
alternated in one device call: the H200 host's spread between identical cold compiles is large (±50% in
session 36), so single `tools/launch_cost.py` samples say little about a compile-path change.

Each round runs, in fresh processes with empty caches, tools/launch_cost.py's first call of a (1, 128, 1, 128)
causal d128 call for this tree and for .ab/ref (PYTHONPATH first), with and without cutlass imported before the
clock, then flash-attn-4's first call of the same shape. Prints one tuple per process.

Run on the GPU machine: `source tools/device_env.sh; unset FA4GEN_QUIET; python3 tools/cold_first_call_ab.py
[ROUNDS]` (carry [".device", ".ab"]).
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_cost  # noqa: E402


def main(rounds: int = 3) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ref = os.path.join(root, ".ab", "ref")
    if not os.path.isdir(ref):
        raise SystemExit("no .ab/ref: run 'tools/ab_bench.sh prepare REF' first")
    base = os.environ.get("PYTHONPATH", "")
    for r in range(rounds):
        # the sides alternate their order (session 44, this tree on both sides by the bug launch_cost.child_env
        # fixes: with cutlass imported first, the second side's compile read 0.82-0.96 of the first's in all
        # four rounds)
        for side in ("new", "ref") if r % 2 == 0 else ("ref", "new"):
            os.environ["PYTHONPATH"] = f"{ref}:{base}" if side == "ref" else base
            for pre in (True, False):
                res = launch_cost.first_call(tempfile.mkdtemp(), preimport=pre)
                # (the same check as tools/compile_time_cpu.py --against-ref: symlinks resolved)
                if Path(res["fa4gen_from"]).resolve().is_relative_to(Path(ref).resolve()) != (side == "ref"):
                    raise SystemExit(f"side {side}: fa4gen came from {res['fa4gen_from']}")
                print((r, side, pre, res["first_call_s"], res["log"][-1] if res["log"] else ""), flush=True)
        os.environ["PYTHONPATH"] = base
        print(("fa4", r, launch_cost.fa4_first_call()), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
