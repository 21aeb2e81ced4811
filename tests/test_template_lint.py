"""Generated kernel modules never rebind their run-time scalar parameters (scale, softcap, window,
chunk size, ...): a template variable that happened to share such a name would silently change the
mask or the math for the rest of the kernel (session 6: a dQ chunk index named `chunk` overwrote a
chunked mask's chunk size; the varlen kernel compiled and gave wrong gradients). Renders every
template family for specs that switch on every scalar parameter and checks each function's body with
the AST. Also: no statement is rendered into a comment (a Jinja whitespace slip that compiles a kernel
without the statement). CPU only, no compile."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest

from fa4gen.builder import plan_spec
from fa4gen.render import render_package
from fa4gen.spec import spec_from_dict

SCALAR_TYPES = {"Float32", "Int32"}
SPECS = [
    dict(name="lint_chunked", head_dim=192, head_dim_v=128, softcap=20.0, mask={"kind": "chunked", "chunk_size": 96}),
    dict(name="lint_window", head_dim=128, mask={"kind": "sliding_window", "left": 100, "right": 20}, deterministic=True),
    dict(name="lint_varlen", head_dim=256, softcap=20.0, mask={"kind": "chunked", "chunk_size": 96}, varlen=True),
    dict(name="lint_causal_swap", head_dim=128, mask={"kind": "causal"}, pipeline={"bwd_swap_ab": True}),
    dict(name="lint_d64_causal", head_dim=64, mask={"kind": "causal"}, varlen=True, deterministic=True),
    # SM100: forward only
    dict(name="lint_sm100_chunked", targets=["sm100"], backward=False, head_dim=128, softcap=20.0,
         mask={"kind": "chunked", "chunk_size": 96}),
    dict(name="lint_sm100_window", targets=["sm100"], backward=False, head_dim=128,
         mask={"kind": "sliding_window", "left": 100, "right": 20}),
]


def _scalar_params(fn: ast.FunctionDef) -> set[str]:
    args = fn.args.args + fn.args.kwonlyargs
    return {a.arg for a in args if isinstance(a.annotation, ast.Name) and a.annotation.id in SCALAR_TYPES}


def _rebinds(fn: ast.FunctionDef, names: set[str]) -> list[tuple[str, int]]:
    return sorted({(node.id, node.lineno) for node in ast.walk(fn)
                   if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in names})


@functools.lru_cache(maxsize=None)
def _rendered(name: str) -> dict[str, str]:
    """The rendered package files of the lint spec `name` (rendered once for both checks)."""
    fields = next(f for f in SPECS if f["name"] == name)
    spec = spec_from_dict({"targets": ["sm90"], "dtype": "bf16", "backward": True, **fields})
    plans, _ = plan_spec(spec)
    return render_package(spec, plans, spec_label="lint", unavailable={}).files


@pytest.mark.parametrize("fields", SPECS, ids=lambda f: f["name"])
def test_scalar_parameters_are_never_rebound(fields):
    files = _rendered(fields["name"])
    checked = 0
    for path, text in files.items():
        if not path.endswith(".py"):
            continue
        for fn in (n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)):
            params = _scalar_params(fn)
            checked += bool(params)
            assert not _rebinds(fn, params), f"{path}: {fn.name} rebinds run-time parameters {_rebinds(fn, params)}"
    assert checked >= 2  # kernels and their hosts take scalar parameters


# A statement joined onto the end of a comment: a Jinja block tag with a leading `-` ({%- if ...%}) after a template line
# that ends in a comment strips the newline, so the next statement renders inside that comment and the kernel compiles
# without it (session 80: a forward whose P conversion sat in a comment compiled, with no P·V input written). A run of
# spaces then a call or an assignment, inside a comment, is that join; no prose comment of the templates has one.
JOINED_STATEMENT = re.compile(r"\S {4,}[A-Za-z_][\w.]*\s*(\(|=[^=])")


def _joined_statements(text: str) -> list[tuple[int, str]]:
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT and JOINED_STATEMENT.search(tok.string)]


def test_the_join_check_finds_a_statement_rendered_into_a_comment():
    joined = ("def f(a):\n    # P before the O rescale (frag.convert)                frag.convert(a, pinned=True)\n"
              "    return a\n")
    assert _joined_statements(joined) == [(2, joined.splitlines()[1].strip())]
    clean = "def f(a):\n    # the rescale (frag.convert, softmax.scale_rows); x = 2 * y in prose\n    return a\n"
    assert _joined_statements(clean) == []


@pytest.mark.parametrize("fields", SPECS, ids=lambda f: f["name"])
def test_no_statement_is_rendered_into_a_comment(fields):
    files = _rendered(fields["name"])
    modules = [path for path in files if path.endswith(".py")]
    assert modules
    for path in modules:
        assert not _joined_statements(files[path]), f"{path}: {_joined_statements(files[path])}"


def test_no_statement_sits_in_a_comment_of_the_committed_packages():
    modules = sorted((Path(__file__).resolve().parent.parent / "generated").glob("*/*.py"))
    assert len(modules) > 20
    for path in modules:
        found = _joined_statements(path.read_text())
        assert not found, f"{path}: {found}"
