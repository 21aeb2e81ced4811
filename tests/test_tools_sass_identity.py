"""tools/sass_identity.py: bad arguments are named before anything is compiled or a worktree is made."""

import subprocess

import pytest

from conftest import load_tool


def _tool():
    return load_tool("sass_identity")


def test_unknown_ref_is_named(capsys):
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--ref", "no-such-ref-s52", "--archs", "sm90"])
    assert exc.value.code == 2
    assert "--ref: 'no-such-ref-s52' is not a commit" in capsys.readouterr().err


def test_unknown_arch_is_named(capsys):
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--ref", "HEAD", "--archs", "sm80"])
    assert exc.value.code == 2
    assert "--archs: unknown arch 'sm80'" in capsys.readouterr().err


def test_no_worktree_is_left_behind():
    """A refused call leaves `git worktree list` as it was (nothing was added)."""
    before = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout
    with pytest.raises(SystemExit):
        _tool().main(["--ref", "no-such-ref-s52"])
    assert subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout == before
