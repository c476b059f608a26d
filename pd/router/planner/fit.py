"""Least-squares fits of seconds against a size, over a bounded window of recent samples.

`WindowFit(degree)` fits y = a + b*x (+ c*x^2) to its last `window` samples. Guarantees:
- `predict` is None until `min_samples` samples are in (a figure is never guessed);
- with fewer distinct sizes than coefficients, the fit drops to a lower degree (one
  distinct size: the mean), so a narrow sample set never gives a wild curve;
- predictions are never negative, and beyond the largest sampled size never below the
  value there (extrapolation of a curve that dips would make a larger prompt look cheaper).
"""
from __future__ import annotations

import collections

import numpy as np


class WindowFit:
    def __init__(self, degree: int, window: int = 256, min_samples: int = 4) -> None:
        if degree not in (1, 2):
            raise ValueError(f"degree must be 1 or 2, got {degree}")
        if window < 2 or min_samples < 1:
            raise ValueError("window must be >= 2 and min_samples >= 1")
        self.degree = degree
        self.min_samples = min_samples
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._coefs: np.ndarray | None = None  # a, b[, c]; None: refit on the next read

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples

    def add(self, x: float, y: float) -> None:
        self._samples.append((float(x), float(y)))
        self._coefs = None

    def coefficients(self) -> list[float] | None:
        """[a, b] or [a, b, c] (zeros above the degree the samples support); None before `ready`."""
        if not self.ready:
            return None
        if self._coefs is None:
            self._coefs = self._fit()
        return [float(c) for c in self._coefs]

    def predict(self, x: float) -> float | None:
        coefs = self.coefficients()
        if coefs is None:
            return None
        x, top = float(x), self._max_x()
        value = _poly(coefs, x)
        if x > top:  # beyond the samples a dipping curve must not make a larger prompt look cheaper
            value = max(value, _poly(coefs, top))
        return max(0.0, value)

    def covers(self, x: float) -> bool:
        """Whether `x` lies within the sampled sizes (a prediction there interpolates)."""
        return bool(self._samples) and float(x) <= self._max_x()

    def describe(self) -> dict:
        coefs = self.coefficients()
        return {"num_samples": self.num_samples, "coefficients": coefs}

    def _max_x(self) -> float:
        return max(x for x, _ in self._samples)

    def _fit(self) -> np.ndarray:
        xs = np.array([x for x, _ in self._samples])
        ys = np.array([y for _, y in self._samples])
        num_distinct = len(np.unique(xs))
        degree = min(self.degree, num_distinct - 1)
        out = np.zeros(3)
        if degree == 0:
            out[0] = ys.mean()
            return out
        scale = max(1.0, float(np.abs(xs).max()))  # conditioning: fit on x / scale
        design = np.vander(xs / scale, degree + 1, increasing=True)
        coefs, *_ = np.linalg.lstsq(design, ys, rcond=None)
        for power, c in enumerate(coefs):
            out[power] = c / scale ** power
        if out[1] < 0 and out[2] <= 0:  # a falling curve (noise over a narrow range): the samples say "flat"
            out[:] = 0.0
            out[0] = ys.mean()
        return out


def _poly(coefs: list[float], x: float) -> float:
    return sum(c * x ** power for power, c in enumerate(coefs))
