"""Render stage: KernelPlans -> the text of a generated package (generated/<name>/).

One strict Jinja environment over templates/. Templates branch on plan booleans and insert plan
values; every inserted value goes through the `py` filter, which accepts numbers, booleans,
tuples of numbers and already-validated identifiers only, so no spec text can become code.
Rendering is a pure function of (spec, plans, spec path label, fa4gen version): byte-identical
across runs and machines.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import jinja2

from fa4gen import __version__
from fa4gen.plan import KernelPlan
from fa4gen.spec import AttentionSpec, spec_digest

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
# columns of a traced kernel's trace tensor (templates/sm90/bwd.py.j2 T_*; tools/bwd_timeline.py reads them)
TRACE_EVENTS = 27
IDENTIFIER_FIELDS = ("name", "module", "class_name", "cutlass_dtype", "torch_dtype", "cute_arch", "arch")


def _py(value) -> str:
    """Render a plan value as a Python literal; refuse anything that could smuggle code."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite value {value!r} cannot be rendered")
        return repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_py(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    raise TypeError(f"refusing to render {type(value).__name__} {value!r} as code")


def _ident(value: str) -> str:
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
        raise ValueError(f"refusing to render {value!r} as an identifier")
    return value


def _pystr(value: str) -> str:
    """A string literal for data (never code): JSON escaping is a valid Python literal."""
    return json.dumps(str(value))


# `module_calls` (templates/sm90/_steps.j2 guarded): these method calls of template text, as calls of module functions
# (fa4gen/device/sm90.py) on the same objects. A fixed table of literal template text, never spec text.
_MODULE_CALLS = tuple(
    (f"{obj}.{method}(", f"hopper.{function}({obj}, ")
    for obj, method, function in (
        ("pipe_k", "consumer_wait", "consumer_wait"), ("pipe_v", "consumer_wait", "consumer_wait"),
        ("pipe_k", "consumer_release", "consumer_release"), ("pipe_v", "consumer_release", "consumer_release"),
    )
)


def _module_calls(text: str) -> str:
    for old, new in _MODULE_CALLS:
        text = text.replace(old, new)
    return text


def make_environment(templates_dir: Path = TEMPLATES_DIR) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = _py
    env.filters["ident"] = _ident
    env.filters["pystr"] = _pystr
    env.filters["module_calls"] = _module_calls
    return env


@dataclass(frozen=True)
class RenderedPackage:
    name: str
    files: dict[str, str]  # relative path -> text


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def render_package(
    spec: AttentionSpec, plans: list[KernelPlan], *, spec_label: str, unavailable: dict[str, str],
    trace: Collection[str] = (),
) -> RenderedPackage:
    """All files of generated/<spec.name>/. `spec_label` is the spec path as the user names it. `trace`
    (kernel modules; tools/bwd_timeline.py only) renders those kernels traced: they take one more tensor and
    write timestamps into it (SM90 backward kernels only; fa4gen/device/trace.py)."""
    env = make_environment()
    for plan in plans:
        for f in IDENTIFIER_FIELDS:
            _ident(getattr(plan, f))
    traceable = {p.module for p in plans if p.arch == "sm90" and p.direction == "bwd"}
    if not set(trace) <= traceable:
        raise ValueError(f"trace: {sorted(set(trace) - traceable)}: expected SM90 backward kernels of this package "
                         f"({', '.join(sorted(traceable)) or 'none'})")
    header = dict(version=__version__, spec_label=spec_label, spec_sha=spec_digest(spec))
    files: dict[str, str] = {}
    for plan in plans:
        template = env.get_template(f"{plan.arch}/{plan.direction}.py.j2")
        files[f"{plan.module}.py"] = template.render(plan=plan, trace_events=TRACE_EVENTS if plan.module in trace else 0, **header)
    files["__init__.py"] = env.get_template("package/__init__.py.j2").render(
        spec=spec, plans=plans, unavailable=sorted(unavailable.items()), **header
    )
    lock = {
        "generator": f"fa4gen {__version__}",
        "spec_path": spec_label,
        "spec_sha256": spec_digest(spec),
        "spec": spec.model_dump(mode="json"),
        "plans": [p.to_dict() for p in plans],
        "unavailable_targets": dict(sorted(unavailable.items())),
        "files": {path: _sha(text) for path, text in sorted(files.items())},
    }
    files["spec.lock.json"] = json.dumps(lock, indent=2, sort_keys=True) + "\n"
    return RenderedPackage(name=spec.name, files=files)
