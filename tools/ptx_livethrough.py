"""Which virtual registers a kernel's key-block loop carries through without touching them, read from its PTX.

A value defined before the loop and used after it, never redefined inside, holds a register for the whole loop. Under
`.reqntid 512` NVVM works to 128 registers per thread (it does not see setmaxnreg's 160 for the consumers), and
session 79 found our three-warpgroup forwards recomputing loop-invariant WGMMA descriptor bases (and, in some, the
lane predicate) inside the loop where flash-attn-4's d64 forward (same launch bounds) computes them once; with
`pipeline.intra_wg_overlap: false` (less live in the loop) ours computes them once too. vit_encoder's fp16 one-CTA
loop carried 16 values through (the LSE store's kernel parameters among them, loaded at the kernel's entry),
flash-attn-4's 7; fewer alone did not make the bases leave the loop (docs/STATUS.md).

Run: dump the PTX (`CUTE_DSL_KEEP=ptx CUTE_DSL_DUMP_DIR=D PYTHONPATH=. python tools/sass_loops.py SPEC`; for
flash-attn-4, `PYTHONPATH=. python tools/fa4_sass_cpu.py --dim 64 --direction fwd --ptx --keep D`), then
`python tools/ptx_livethrough.py D/<kernel>.ptx [--min-mma 10]`: the loop (the shortest one whose body issues at least
`--min-mma` wgmma.mma_async, found by its back edge), its live-through registers with the line defining each, and how
many loop-invariant values the loop reads.
"""

import argparse
import re
import sys
from pathlib import Path

LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
REG = re.compile(r"%(?:rd|rs|fd|r|f|p)\d+\b")
# instructions whose register operands are all read (stores, barriers, branches, the MMA's accumulators in place)
NO_DEST = re.compile(r"^(?:@!?%p\d+\s+)?(?:st\.|red\.|mbarrier|bar\.|barrier|wgmma|bra|ret|setmaxnreg|fence|cp\.async)")


def mma_loop(lines: list[str], min_mma: int) -> tuple[int, int] | None:
    """(first, last) line index of the shortest loop (label ... backward branch to it) with >= min_mma wgmma issues."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    best = None
    for i, line in enumerate(lines):
        m = BRANCH.search(line)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        start = labels[m.group(1)]
        if sum("wgmma.mma_async" in x for x in lines[start:i]) >= min_mma and (best is None or i - start < best[1] - best[0]):
            best = (start, i)
    return best


def defs_uses(line: str) -> tuple[set[str], set[str]]:
    """(registers written, registers read) by one PTX line; the first operand of an ordinary instruction is its
    destination (a `{a, b}` vector destination counts whole)."""
    text = line.split("//", 1)[0].strip()
    if not text or text.startswith((".", "{", "}")) or LABEL.match(text):
        return set(), set()
    regs = REG.findall(text)
    if not regs or NO_DEST.match(text):
        return set(), set(regs)
    body = re.sub(r"^@!?%p\d+\s+", "", text)
    operands = body.split(None, 1)[1] if " " in body or "\t" in body else ""
    if operands.lstrip().startswith("{"):  # vector destination
        dest_text = operands[:operands.index("}") + 1]
        dests = set(REG.findall(dest_text))
        return dests, set(regs) - dests
    return {regs[0]}, set(regs[1:])


def live_through(lines: list[str], loop: tuple[int, int]) -> tuple[dict[str, int], set[str]]:
    """({register: defining line index} live through the loop, loop-invariant registers the loop reads)."""
    start, end = loop
    defined_before: dict[str, int] = {}
    for i, line in enumerate(lines[:start]):
        for reg in defs_uses(line)[0]:
            defined_before.setdefault(reg, i)
    defined_in, read_in, read_after = set(), set(), set()
    for line in lines[start:end + 1]:
        d, u = defs_uses(line)
        defined_in |= d
        read_in |= u
    for line in lines[end + 1:]:
        read_after |= defs_uses(line)[1]
    through = {r: i for r, i in defined_before.items() if r in read_after and r not in defined_in}
    invariant = {r for r in read_in if r in defined_before and r not in defined_in}
    return through, invariant


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ptx", type=Path)
    ap.add_argument("--min-mma", type=int, default=10, help="wgmma.mma_async issues the loop must hold (default 10)")
    args = ap.parse_args(argv)
    lines = args.ptx.read_text().splitlines()
    loop = mma_loop(lines, args.min_mma)
    if loop is None:
        print(f"{args.ptx}: no loop with {args.min_mma} or more wgmma.mma_async", file=sys.stderr)
        return 1
    through, invariant = live_through(lines, loop)
    print(f"loop: lines {loop[0] + 1}-{loop[1] + 1}; {len(through)} registers live through it "
          f"({sum(r.startswith('%rd') for r in through)} of them 64-bit); it reads {len(invariant)} loop-invariant values")
    for reg, i in sorted(through.items(), key=lambda kv: kv[1]):
        print(f"  {reg:<8} line {i + 1}: {lines[i].strip()[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
