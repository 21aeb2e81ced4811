"""Compile stage: SASS disassembly, opcode summaries and resource usage of a cubin.

``nvdisasm`` comes from ``$PATH`` or the ``nvidia-cuda-nvdisasm`` wheel (it installs the
binary under ``site-packages/nvidia/cu13/bin/``; its version must be at least the CUDA
version CuTe-DSL was built with). The summary counts the instructions the design checks
for: SM90 ``HGMMA``; SM100 ``UTCHMMA``/``UTCQMMA`` (tcgen05 MMA), ``LDTM``/``STTM`` (TMEM);
TMA ``UTMALDG``/``UTMASTG``; ``MUFU.EX2``; ``FFMA``/``FFMA2``; spills ``LDL``/``STL``;
barriers ``BAR`` + ``SYNCS``. Counts are static (instructions in the binary, padding
``NOP``s included in ``total``), not dynamic executions.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from fa4gen.compile.elf import extract_cubins, kernel_resources

NVDISASM_TIMEOUT_S = 300

_INSTRUCTION_RE = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s+\{?\s*(?P<text>[^;{}]+?)\s*;")
_PREDICATE_RE = re.compile(r"^@!?U?P(?:T|\d+)\s+")
_FUNCTION_RE = re.compile(r"^\s*\.section\s+\.text\.(?P<name>[^,\s]+)")
_UTC_MMA_RE = re.compile(r"^UTC\w*?[HQ]MMA")


class NvdisasmNotFoundError(RuntimeError):
    """No ``nvdisasm`` on PATH or in the ``nvidia-cuda-nvdisasm`` wheel."""


def find_nvdisasm() -> str | None:
    """Path of ``nvdisasm``: ``$PATH`` first, then the ``nvidia-cuda-nvdisasm`` wheel."""
    on_path = shutil.which("nvdisasm")
    if on_path:
        return on_path
    try:
        files = metadata.files("nvidia-cuda-nvdisasm") or []
        dist = metadata.distribution("nvidia-cuda-nvdisasm")
    except metadata.PackageNotFoundError:
        return None
    for rel in files:
        if rel.name == "nvdisasm":
            path = Path(dist.locate_file(rel))
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def disassemble(cubin: bytes, *, nvdisasm: str | None = None, flags: tuple[str, ...] = ()) -> str:
    """SASS text of every function in ``cubin`` (``nvdisasm -c``: code sections only; `flags` added before it)."""
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise NvdisasmNotFoundError(
            "nvdisasm not found: install the test extra (pip install nvidia-cuda-nvdisasm) "
            "or put a CUDA toolkit's bin/ on PATH"
        )
    with tempfile.TemporaryDirectory(prefix="fa4gen-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run(
            [tool, *flags, "-c", str(path)], capture_output=True, text=True, timeout=NVDISASM_TIMEOUT_S
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} failed (exit {proc.returncode}): {proc.stderr.strip()[:2000]}")
    return proc.stdout


@dataclass(frozen=True)
class SassSummary:
    """Static opcode counts of a SASS listing.

    ``opcodes`` histograms the base opcode (predicate dropped, text after the first "."
    dropped: ``@!P0 MUFU.EX2`` -> ``MUFU``); ``full_opcodes`` keeps the modifiers
    (``MUFU.EX2``). Both are sorted by count, then name.
    """

    kernels: tuple[str, ...]
    total: int
    hgmma: int
    utchmma: int
    ldtm: int
    sttm: int
    utmaldg: int
    utmastg: int
    mufu_ex2: int
    ffma: int
    ffma2: int
    ldl: int
    stl: int
    bar: int
    opcodes: dict[str, int] = field(compare=False, hash=False)
    full_opcodes: dict[str, int] = field(compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kernels"] = list(self.kernels)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SassSummary":
        return cls(**{**data, "kernels": tuple(data.get("kernels", ()))})


def _sorted_hist(counter: Counter[str]) -> dict[str, int]:
    return dict(sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize_sass(sass_text: str) -> SassSummary:
    """Count opcodes in ``nvdisasm`` output (any flags that keep one instruction per line)."""
    base: Counter[str] = Counter()
    full: Counter[str] = Counter()
    kernels: list[str] = []
    for line in sass_text.splitlines():
        section = _FUNCTION_RE.match(line)
        if section:
            kernels.append(section.group("name"))
            continue
        match = _INSTRUCTION_RE.match(line)
        if not match:
            continue
        text = _PREDICATE_RE.sub("", match.group("text"))
        opcode = text.split(None, 1)[0] if text else ""
        if not opcode:
            continue
        full[opcode] += 1
        base[opcode.split(".", 1)[0]] += 1

    def count(*names: str) -> int:
        return sum(base[n] for n in names)

    return SassSummary(
        kernels=tuple(kernels),
        total=sum(base.values()),
        hgmma=count("HGMMA"),
        utchmma=sum(n for op, n in base.items() if _UTC_MMA_RE.match(op)),
        ldtm=count("LDTM"),
        sttm=count("STTM"),
        utmaldg=count("UTMALDG"),
        utmastg=count("UTMASTG"),
        mufu_ex2=sum(n for op, n in full.items() if op == "MUFU.EX2" or op.startswith("MUFU.EX2.")),
        ffma=count("FFMA"),
        ffma2=count("FFMA2"),
        ldl=count("LDL"),
        stl=count("STL"),
        bar=count("BAR", "SYNCS"),
        opcodes=_sorted_hist(base),
        full_opcodes=_sorted_hist(full),
    )


def resource_usage(cubin: bytes, *, sass: str | None = None, disassemble_missing: bool = True) -> dict[str, Any]:
    """Registers, shared memory, stack and spill indicators of a cubin (or host object).

    From the ELF (always; see :mod:`fa4gen.compile.elf`): ``registers`` (max over entry
    kernels), ``smem_static``, ``smem_reserved``, ``stack_frame``, ``min_stack``, the
    per-kernel table ``kernels`` and ``arch``. ``smem_dynamic`` is always None: a cubin
    does not record it (CuTe-DSL passes it at launch), so callers that know their smem
    budget (the plan) store it themselves. ``spill_stores`` / ``spill_loads`` are the
    static ``STL`` / ``LDL`` instruction counts, taken from ``sass`` or, when nvdisasm is
    available and ``disassemble_missing``, from disassembling ``cubin``; otherwise None.
    ptxas' spill *byte* counts are not in the cubin.
    """
    cubins = extract_cubins(cubin)
    if not cubins:
        raise ValueError("no cubin found in the given bytes")
    kernels: dict[str, dict[str, Any]] = {}
    arch, smem_reserved = None, 0
    for image in cubins:
        info = kernel_resources(image)
        arch = arch or info["arch"]
        smem_reserved = max(smem_reserved, info["smem_reserved"])
        kernels.update(info["functions"])
    entries = [k for k in kernels.values() if k["entry"]] or list(kernels.values())

    def peak(key: str) -> int | None:
        values = [k[key] for k in entries if k[key] is not None]
        return max(values) if values else None

    if sass is None and disassemble_missing and find_nvdisasm() is not None:
        sass = "\n".join(disassemble(image) for image in cubins)
    spills = summarize_sass(sass) if sass is not None else None
    return {
        "arch": arch,
        "registers": peak("registers"),
        "smem_static": peak("smem_static"),
        "smem_dynamic": None,
        "smem_reserved": smem_reserved,
        "stack_frame": peak("stack_frame"),
        "min_stack": peak("min_stack"),
        "spill_stores": spills.stl if spills else None,
        "spill_loads": spills.ldl if spills else None,
        "kernels": kernels,
    }



_LABEL_RE = re.compile(r"^\s*(\.L_x_\d+):")
_BACK_BRANCH_RE = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")
_SASS_LINE_RE = re.compile(r"^\s*/\*[0-9a-f]+\*/")


_SYMBOL_RE = re.compile(r"`\([^)]*\)")


def instruction_lines(sass_text: str) -> list[str]:
    """The instructions of a listing as comparable text: without addresses, encodings or the symbols branches and
    calls name (kernel symbols carry the cache key), so two compiles of one kernel under different package names or
    keys compare equal when their machine code is the same (tools/pipeline_sass_check.py)."""
    return [_SYMBOL_RE.sub("`(SYM)", _SASS_LINE_RE.sub("", line).split(";")[0].strip())
            for line in sass_text.splitlines() if _SASS_LINE_RE.match(line)]


_HEX_WORD_RE = re.compile(r"/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


def disassemble_with_control(cubin: bytes, *, nvdisasm: str | None = None) -> str:
    """SASS of every function in ``cubin`` with each instruction's scheduling control (``nvdisasm -hex -c``, one
    line per instruction): the stall count ptxas encoded ends each instruction line as ``/* stall N */``, the
    encoding words are dropped, and everything else reads as :func:`disassemble`'s listing (so :func:`loops` works
    on it). The stall count is the number of cycles the warp waits before issuing its next instruction (bits
    105-108 of the 128-bit Volta-and-later encoding), whatever other warps do meanwhile; a loop's sum of them
    (:func:`issue_cycles`) is its static issue time for one warp, without any wait on a barrier or a scoreboard."""
    return with_stall_counts(disassemble(cubin, nvdisasm=nvdisasm, flags=("-hex",)))


def control_listing(obj: bytes) -> str:
    """:func:`disassemble_with_control` of every cubin embedded in an exported kernel object (or a cubin)."""
    from fa4gen.compile.elf import extract_cubins

    return "\n".join(disassemble_with_control(c) for c in extract_cubins(obj))


def with_stall_counts(hex_listing: str) -> str:
    """An ``nvdisasm -hex`` listing as one line per instruction ending in ``/* stall N */`` (see
    :func:`disassemble_with_control`). An instruction's first line carries its low encoding word, the next line
    (nothing but a comment) the high word, whose bits 41-44 hold the stall count."""
    lines = hex_listing.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        low = _HEX_WORD_RE.search(line)
        if _SASS_LINE_RE.match(line) and low and i + 1 < len(lines):
            high = _HEX_WORD_RE.search(lines[i + 1])
            if high and not _SASS_LINE_RE.match(lines[i + 1]):
                stall = (int(high.group(1), 16) >> 41) & 0xF
                out.append(f"{line[:low.start()].rstrip()} /* stall {stall} */")
                i += 2
                continue
        out.append(line)
        i += 1
    return "\n".join(out) + "\n"


_STALL_RE = re.compile(r"/\* stall (\d+) \*/")


def issue_cycles(body: list[str]) -> int:
    """Static issue cycles of instruction lines from :func:`disassemble_with_control`: their stall counts summed."""
    return sum(int(m.group(1)) for line in body if (m := _STALL_RE.search(line)))


def loops(sass_text: str, wait_returns: bool = True) -> list[list[str]]:
    """The instruction lines of every loop: a backward branch to a label above it (nested loops and
    out-of-line wait loops that branch back across others included), in listing order. With
    `wait_returns` False, without the regions closed by an out-of-line mbarrier wait's jump back into the code
    it left (`wait_return`): they hold no iteration of anything, only the listing between the two."""
    lines = sass_text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL_RE.match(line))}
    found = []
    for i, line in enumerate(lines):
        m = _BACK_BRANCH_RE.search(line)
        if m and labels.get(m.group(1), i) < i:
            body = [b for b in lines[labels[m.group(1)]:i + 1] if _SASS_LINE_RE.match(b)]
            if wait_returns or not wait_return(body):
                found.append(body)
    return found


def wait_return(body: list[str]) -> bool:
    """Whether a loop found by `loops` is closed by the unconditional jump that ends an out-of-line mbarrier
    wait (a poll that missed branches there: a retry of `SYNCS.PHASECHK` with NANOSLEEP, then back)."""
    return bool(body) and re.search(r"\bBRA\b", body[-1]) is not None and "@" not in body[-1] and any(
        "SYNCS.PHASECHK" in b for b in body[-4:-1])


def mma_loops(sass_text: str, per_iteration: int, mma: str = "HGMMA") -> list[list[str]]:
    """The loops whose body issues exactly `per_iteration` MMA instructions: a kernel's main loop over
    tiles (out-of-line wait loops that branch back across it hold a different count), where a spill
    costs once per iteration."""
    return [body for body in loops(sass_text) if sum(mma in b for b in body) == per_iteration]


def spills_in_mma_loops(sass_text: str, per_iteration: int, mma: str = "HGMMA") -> int:
    """Distinct LDL/STL instructions inside the main loops (see `mma_loops`)."""
    return len({b for body in mma_loops(sass_text, per_iteration, mma) for b in body if re.search(r"\b(LDL|STL)\b", b)})
