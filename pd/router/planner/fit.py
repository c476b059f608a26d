"""Least-squares fits of seconds against a size, over a bounded window of recent samples.

`WindowFit(degree)` fits y = a + b*x (+ c*x^2) (+ d*z) to its last `window` samples, where
`z` is an optional second size that costs linearly (for a prefill: the tokens of other
requests that shared its steps, the batch). Guarantees:
- `predict` is None until `min_samples` samples are in (a figure is never guessed);
- with fewer distinct sizes than coefficients, the fit drops to a lower degree (one
  distinct size: the mean), so a narrow sample set never gives a wild curve;
- predictions are never negative, and beyond the largest sampled size never below the
  value there (extrapolation of a curve that dips would make a larger prompt look cheaper);
- the `z` term is fitted only when the samples' `z` vary apart from `x` (a `z` that the
  polynomial in `x` explains, such as a steady number of decodes times a prompt's steps,
  cannot be told from the `x` terms), and never with a negative coefficient (more work in
  the batch never makes a step cheaper): without it, d = 0.
"""
from __future__ import annotations

import collections

import numpy as np

MIN_Z_SHARE = 0.1  # of z's variance left after regressing it on the x terms, for d to be fitted


class WindowFit:
    def __init__(self, degree: int, window: int = 256, min_samples: int = 4) -> None:
        if degree not in (1, 2):
            raise ValueError(f"degree must be 1 or 2, got {degree}")
        if window < 2 or min_samples < 1:
            raise ValueError("window must be >= 2 and min_samples >= 1")
        self.degree = degree
        self.min_samples = min_samples
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=window)
        self._coefs: np.ndarray | None = None  # a, b, c, d; None: refit on the next read

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples

    def add(self, x: float, y: float, z: float = 0.0) -> None:
        self._samples.append((float(x), float(y), float(z)))
        self._coefs = None

    def coefficients(self) -> list[float] | None:
        """[a, b, c, d] (zeros for the terms the degree or the samples do not support); None before
        `ready`."""
        if not self.ready:
            return None
        if self._coefs is None:
            self._coefs = self._fit()
        return [float(c) for c in self._coefs]

    def predict(self, x: float, z: float = 0.0) -> float | None:
        coefs = self.coefficients()
        if coefs is None:
            return None
        x, top = float(x), self._max_x()
        value = _poly(coefs, x)
        if x > top:  # beyond the samples a dipping curve must not make a larger prompt look cheaper
            value = max(value, _poly(coefs, top))
        return max(0.0, value + coefs[3] * max(0.0, float(z)))

    def covers(self, x: float, z: float = 0.0) -> bool:
        """Whether `x` (and `z`, where the fit has a `z` term) lie within the sampled sizes (a
        prediction there interpolates)."""
        if not self._samples or float(x) > self._max_x():
            return False
        coefs = self.coefficients()
        return coefs is None or coefs[3] == 0.0 or float(z) <= max(s[2] for s in self._samples)

    def describe(self) -> dict:
        coefs = self.coefficients()
        return {"num_samples": self.num_samples, "coefficients": coefs}

    def _max_x(self) -> float:
        return max(x for x, _, _ in self._samples)

    def _fit(self) -> np.ndarray:
        xs, ys, zs = (np.array(column) for column in zip(*self._samples, strict=True))
        out = _lstsq(xs, ys, self.degree, zs)  # (a z that does not vary apart from x gets no term)
        return out if out[3] >= 0 else _lstsq(xs, ys, self.degree, None)


def _lstsq(xs: np.ndarray, ys: np.ndarray, degree: int, zs: np.ndarray | None) -> np.ndarray:
    """[a, b, c, d] by least squares: the polynomial in x up to `degree` (lower where the x are too
    few distinct), plus d*z when `zs` is given."""
    degree = min(degree, len(np.unique(xs)) - 1)
    out = np.zeros(4)
    scale = max(1.0, float(np.abs(xs).max()))  # conditioning: fit on x / scale (and z / its scale)
    columns = [(xs / scale) ** power for power in range(degree + 1)]
    z_scale = max(1.0, float(np.abs(zs).max())) if zs is not None else 1.0
    if zs is not None and not _varies_apart(columns, zs / z_scale):
        zs = None
    if zs is not None:
        columns.append(zs / z_scale)
    coefs, *_ = np.linalg.lstsq(np.stack(columns, axis=1), ys, rcond=None)
    for power in range(degree + 1):
        out[power] = coefs[power] / scale ** power
    if zs is not None:
        out[3] = coefs[-1] / z_scale
    if degree > 0 and out[1] < 0 and out[2] <= 0:  # a falling curve (noise over a narrow range): "flat"
        out[:3] = 0.0
        out[0] = (ys - out[3] * (zs if zs is not None else 0.0)).mean()
    return out


def _varies_apart(columns: list[np.ndarray], z: np.ndarray) -> bool:
    """Whether `z` keeps at least `MIN_Z_SHARE` of its variance once the `columns` (the x terms)
    explain what they can of it."""
    base = np.stack(columns, axis=1)
    coefs, *_ = np.linalg.lstsq(base, z, rcond=None)
    residual, spread = z - base @ coefs, z - z.mean()
    return float(residual @ residual) > MIN_Z_SHARE * float(spread @ spread)


def _poly(coefs: list[float], x: float) -> float:
    return coefs[0] + coefs[1] * x + coefs[2] * x * x
