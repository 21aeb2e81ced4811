"""Compile stage: read cubins with the stdlib (``struct``), no CUDA toolkit needed.

Two jobs. (1) Find the cubin(s) inside the host object that CuTe-DSL's ``export_to_c``
writes: the object embeds each GPU module as a constant byte array that is a complete
ELF image with ``e_machine == EM_CUDA`` (190); we scan for ELF headers and keep those.
(2) Read per-kernel resources from a cubin:

* registers per thread, stack frame, min/max stack: the ``.nv.info`` section's
  ``EIATTR_REGCOUNT`` / ``EIATTR_FRAME_SIZE`` / ``EIATTR_MIN_STACK_SIZE`` /
  ``EIATTR_MAX_STACK_SIZE`` records, each ``(symbol index, value)``;
* launch bounds, ``maxrregcount``, kernel-parameter bytes, mbarrier count, cluster shape:
  the per-kernel ``.nv.info.<kernel>`` records;
* static shared memory: the size of the ``.nv.shared.<kernel>`` section; the module-wide
  system reservation is the ``.nv.shared.reserved.*`` sections (64 B on sm_100 even for
  an empty kernel).

Not in a cubin: dynamic shared memory (CuTe-DSL kernels allocate their smem dynamically;
the byte count is a launch argument computed by the host code) and ptxas' spill byte
counts (the SASS ``STL``/``LDL`` instruction counts are the available proxy).

Arch: ``e_flags`` and ``EI_ABIVERSION`` (``e_ident[8]``) encode the SM. ABI 7 (sm_90 and
older): SM = ``flags & 0xff``, arch-specific ("a") = ``flags & 0x800``. ABI 8 (sm_100 and
newer): SM = ``(flags >> 8) & 0xff``, "a" = ``flags & 0x8``; "sm_100f" reads as sm_100.
"""

from __future__ import annotations

import struct
from typing import Any

EM_CUDA = 190
_SHT_NOBITS = 8
_STO_CUDA_ENTRY = 0x10

_EIFMT_SVAL = 0x04
_EIATTR_MAX_THREADS = 0x05
_EIATTR_REQNTID = 0x10
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_MIN_STACK_SIZE = 0x12
_EIATTR_CBANK_PARAM_SIZE = 0x19
_EIATTR_MAXREG_COUNT = 0x1B
_EIATTR_MAX_STACK_SIZE = 0x23
_EIATTR_REGCOUNT = 0x2F
_EIATTR_NUM_MBARRIERS = 0x38
_EIATTR_CTA_PER_CLUSTER = 0x3D

_PER_SYMBOL_ATTRS = {
    _EIATTR_REGCOUNT: "registers",
    _EIATTR_FRAME_SIZE: "stack_frame",
    _EIATTR_MIN_STACK_SIZE: "min_stack",
    _EIATTR_MAX_STACK_SIZE: "max_stack",
}


class CubinFormatError(ValueError):
    """The bytes are not a cubin this reader understands."""


def _u16(b: bytes, o: int) -> int:
    return struct.unpack_from("<H", b, o)[0]


def _u32(b: bytes, o: int) -> int:
    return struct.unpack_from("<I", b, o)[0]


def _u64(b: bytes, o: int) -> int:
    return struct.unpack_from("<Q", b, o)[0]


def _is_elf64le(b: bytes, o: int = 0) -> bool:
    return len(b) - o >= 64 and b[o : o + 4] == b"\x7fELF" and b[o + 4] == 2 and b[o + 5] == 1


def _elf_extent(b: bytes, o: int) -> int:
    """Bytes the ELF image starting at ``o`` spans (headers, tables, section data)."""
    phoff, shoff = _u64(b, o + 0x20), _u64(b, o + 0x28)
    ehsize, phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHHH", b, o + 0x34)
    end = max(ehsize, phoff + phentsize * phnum, shoff + shentsize * shnum)
    if o + shoff + shentsize * shnum > len(b):
        raise CubinFormatError("section header table runs past the buffer")
    for i in range(shnum):
        sh = o + shoff + i * shentsize
        sh_type, sh_offset, sh_size = _u32(b, sh + 4), _u64(b, sh + 24), _u64(b, sh + 32)
        if sh_type != _SHT_NOBITS:
            end = max(end, sh_offset + sh_size)
    return end


def extract_cubins(obj: bytes) -> list[bytes]:
    """Every cubin embedded in a host object (or ``[obj]`` if ``obj`` is itself a cubin)."""
    if _is_elf64le(obj) and _u16(obj, 18) == EM_CUDA:
        return [obj]
    found, pos = [], obj.find(b"\x7fELF", 1)
    while pos != -1:
        if _is_elf64le(obj, pos) and _u16(obj, pos + 18) == EM_CUDA:
            try:
                size = _elf_extent(obj, pos)
            except (CubinFormatError, struct.error):
                size = 0
            if 0 < size <= len(obj) - pos:
                found.append(obj[pos : pos + size])
                pos = obj.find(b"\x7fELF", pos + size)
                continue
        pos = obj.find(b"\x7fELF", pos + 1)
    return found


def cubin_arch(cubin: bytes) -> str:
    """``"sm_90a"``-style target of a cubin, decoded from ``e_flags``."""
    _check_cubin(cubin)
    flags, abi = _u32(cubin, 0x30), cubin[8]
    if abi >= 8:
        sm, accel = (flags >> 8) & 0xFF, bool(flags & 0x8)
    else:
        sm, accel = flags & 0xFF, bool(flags & 0x800)
    return f"sm_{sm}{'a' if accel else ''}"


def _check_cubin(cubin: bytes) -> None:
    if not _is_elf64le(cubin) or _u16(cubin, 18) != EM_CUDA:
        raise CubinFormatError("not a 64-bit little-endian CUDA ELF (cubin)")


def _sections(b: bytes) -> list[dict[str, Any]]:
    shoff = _u64(b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    raw = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", b, shoff + i * shentsize
        )
        raw.append(dict(name_off=name, type=typ, offset=off, size=size, link=link, info=info, entsize=entsize))
    strtab = raw[shstrndx]["offset"] if shstrndx < len(raw) else 0
    for sec in raw:
        sec["name"] = _cstr(b, strtab + sec["name_off"])
    return raw


def _cstr(b: bytes, o: int) -> str:
    end = b.find(b"\0", o)
    return b[o : end if end != -1 else len(b)].decode("utf-8", "replace")


def _symbols(b: bytes, sections: list[dict[str, Any]]) -> list[dict[str, Any]]:
    symtab = next((s for s in sections if s["name"] == ".symtab"), None)
    if symtab is None:
        return []
    strtab = sections[symtab["link"]]["offset"]
    entsize = symtab["entsize"] or 24
    out = []
    for i in range(symtab["size"] // entsize):
        st_name, _info, other, _shndx, _value, _size = struct.unpack_from(
            "<IBBHQQ", b, symtab["offset"] + i * entsize
        )
        out.append(dict(name=_cstr(b, strtab + st_name), other=other))
    return out


def _nv_info_records(b: bytes, sec: dict[str, Any]) -> list[tuple[int, int | bytes]]:
    """(attribute, value) pairs: a u16 for NVAL/BVAL/HVAL formats, the payload for SVAL."""
    records, o, end = [], sec["offset"], sec["offset"] + sec["size"]
    while o + 4 <= end:
        fmt, attr = b[o], b[o + 1]
        if fmt == _EIFMT_SVAL:
            size = _u16(b, o + 2)
            records.append((attr, b[o + 4 : o + 4 + size]))
            o += 4 + size
        else:
            records.append((attr, _u16(b, o + 2)))
            o += 4
    return records


def _triple(payload: bytes) -> list[int] | None:
    return list(struct.unpack_from("<III", payload)) if len(payload) >= 12 else None


def kernel_resources(cubin: bytes) -> dict[str, Any]:
    """Per-function resources of one cubin, plus module-level facts.

    Returns ``{"arch", "smem_reserved", "functions": {name: {...}}}``; each function has
    ``entry`` (a ``__global__`` kernel), ``registers``, ``stack_frame``, ``min_stack``,
    ``max_stack``, ``smem_static`` and, for kernels, ``reqntid`` / ``max_threads``
    (``[x, y, z]`` or None), ``max_reg_count``, ``param_bytes``, ``num_mbarriers``,
    ``cta_per_cluster``. A value the cubin does not record is None.
    """
    _check_cubin(cubin)
    sections = _sections(cubin)
    symbols = _symbols(cubin, sections)
    functions: dict[str, dict[str, Any]] = {}
    for sec in sections:
        if sec["name"].startswith(".text."):
            name = sec["name"][len(".text.") :]
            entry = any(s["name"] == name and s["other"] & _STO_CUDA_ENTRY for s in symbols)
            functions[name] = dict(
                entry=entry, registers=None, stack_frame=None, min_stack=None, max_stack=None,
                smem_static=0, reqntid=None, max_threads=None, max_reg_count=None,
                param_bytes=None, num_mbarriers=None, cta_per_cluster=None,
            )
    smem_reserved = 0
    for sec in sections:
        name = sec["name"]
        if name == ".nv.info":
            for attr, value in _nv_info_records(cubin, sec):
                field = _PER_SYMBOL_ATTRS.get(attr)
                if field is None or not isinstance(value, bytes) or len(value) < 8:
                    continue
                sym_index, amount = struct.unpack_from("<II", value)
                if sym_index < len(symbols) and symbols[sym_index]["name"] in functions:
                    functions[symbols[sym_index]["name"]][field] = amount
        elif name.startswith(".nv.info.") and name[len(".nv.info.") :] in functions:
            _read_kernel_info(cubin, sec, functions[name[len(".nv.info.") :]])
        elif name.startswith(".nv.shared.reserved."):
            smem_reserved += sec["size"]
        elif name.startswith(".nv.shared.") and name[len(".nv.shared.") :] in functions:
            functions[name[len(".nv.shared.") :]]["smem_static"] = sec["size"]
    return {"arch": cubin_arch(cubin), "smem_reserved": smem_reserved, "functions": functions}


def _read_kernel_info(cubin: bytes, sec: dict[str, Any], info: dict[str, Any]) -> None:
    for attr, value in _nv_info_records(cubin, sec):
        if attr == _EIATTR_REQNTID and isinstance(value, bytes):
            info["reqntid"] = _triple(value)
        elif attr == _EIATTR_MAX_THREADS and isinstance(value, bytes):
            info["max_threads"] = _triple(value)
        elif attr == _EIATTR_CTA_PER_CLUSTER and isinstance(value, bytes):
            info["cta_per_cluster"] = _triple(value)
        elif attr == _EIATTR_MAXREG_COUNT and isinstance(value, int):
            info["max_reg_count"] = value
        elif attr == _EIATTR_CBANK_PARAM_SIZE and isinstance(value, int):
            info["param_bytes"] = value
        elif attr == _EIATTR_NUM_MBARRIERS and isinstance(value, bytes) and len(value) >= 4:
            info["num_mbarriers"] = _u32(value, 0)
