"""Plan stage: fit the polynomial that the software exp2 (fa4gen.device.polyexp) evaluates.

2**f on [0, 1) is approximated by c0 + c1 f + ... + cd f**d with c0 = 1 fixed (so integral
inputs are exact), fitted by least squares on the *relative* error over Chebyshev nodes, then
checked on a dense grid. Pure Python: the plan stage imports no numeric library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PolyFit:
    degree: int
    coeffs: tuple[float, ...]
    max_rel_error: float


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are at most 5×5)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def evaluate(coeffs: tuple[float, ...], f: float) -> float:
    p = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        p = p * f + c
    return p


def fit_exp2(degree: int, samples: int = 512) -> PolyFit:
    if not 1 <= degree <= 5:
        raise ValueError(f"poly-exp degree must be in [1, 5] (got {degree})")
    nodes = [0.5 - 0.5 * math.cos(math.pi * (k + 0.5) / samples) for k in range(samples)]
    # Unknowns c1..cd; residual r(f) = (1 + sum c_k f^k - 2^f) / 2^f, minimized in least squares.
    a = [[0.0] * degree for _ in range(degree)]
    b = [0.0] * degree
    for f in nodes:
        w = 2.0 ** -f
        basis = [w * f ** (k + 1) for k in range(degree)]
        target = 1.0 - w  # (2^f - 1) / 2^f
        for i in range(degree):
            b[i] += basis[i] * target
            for j in range(degree):
                a[i][j] += basis[i] * basis[j]
    coeffs = (1.0, *_solve(a, b))
    grid = [k / 4096 for k in range(4096)]
    err = max(abs(evaluate(coeffs, f) / 2.0**f - 1.0) for f in grid)
    return PolyFit(degree=degree, coeffs=tuple(float(c) for c in coeffs), max_rel_error=err)
