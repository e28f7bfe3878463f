"""The error sums ``B(u)`` of the low-cost paths (docs/algorithm.md#damage-term), kept without a
host sync.

A linear's weight gradient is ``dW = dy^T x``. A low-cost path computes it, in effect, as
``Q(dy)^T Q(x)`` (each backend rounds some of the two factors), and to first order

    ||Q(dy)^T Q(x) - dy^T x||_F  <=  ||dy||_F ||x - Q(x)||_F  +  ||Q(dy) - dy||_F ||x||_F

(a backend drops the term of a factor it does not round). ``B(u)`` is that bound summed over
every GEMM of unit u's operators on this rank since the last ``apply``: every micro-batch's
backward, so it grows with the micro-batches as the accumulated gradient does. Each norm is one
``torch.linalg.vector_norm`` of a tensor the backend has at hand anyway (its quantized copy, or
``dy`` in the backward); the GEMMs only append their 0-dim norms (:class:`GemmProbe`), and
:meth:`ErrorSums.total` multiplies and scatters them into a float64 ``[U]`` vector in a few
kernels: no host sync, no extra GEMM. A unit on the recovery path is measured *in shadow*: the
low-cost rounding is applied once more to the same ``x`` (in the forward) and ``dy`` (in a hook
on the output's gradient) only to measure it, so ``B(u)`` is what the low-cost path would have
done to that unit's gradient this step. The runtime divides the reduced ``B(u)`` by the global
gradient norm ``G`` of the step to get the dimensionless ``e_t(u) = B(u) / G``
(:mod:`gnmr_dist.distributed.runtime`).

:class:`~gnmr_dist.backends.base.PrecisionBackend` turns the measuring on
(``track_errors``) and reads the sums (``error_sums``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gnmr_dist.distributed.monitor import IndexCache, index_tensor

__all__ = ["ErrorSums", "GemmProbe", "frobenius"]


def frobenius(t: torch.Tensor) -> torch.Tensor:
    """0-dim ``||t||_F`` on ``t``'s device, accumulated in fp32 at least (no host sync)."""
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    norm: torch.Tensor = torch.linalg.vector_norm(t, dtype=wide if t.dtype != wide else None)
    return norm


class ErrorSums:
    """This rank's ``B(u)`` since the last reset, kept as the GEMMs' 0-dim factor norms.

    Each GEMM appends its terms ``(unit, a, b)`` (``B(unit) += a * b``): a list append, no
    kernel. :meth:`total` multiplies and scatters them all at once (two stacks, one product,
    one ``index_add_``, the index cached on the device): a handful of kernels per step however
    many GEMMs and micro-batches ran, and no host sync. Past :data:`FOLD_AT` terms (many
    micro-batches, or no ``apply`` for a long time) they are folded into a running vector.
    """

    FOLD_AT = 4096

    def __init__(self, num_units: int) -> None:
        self.num_units = num_units
        self._terms: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._folded: torch.Tensor | None = None
        self._index: dict[torch.device, IndexCache] = {}

    def add(self, unit: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """``B(unit) += a * b`` (0-dim tensors on one device), evaluated in :meth:`total`."""
        self._terms.append((unit, a, b))
        if len(self._terms) >= self.FOLD_AT:
            self._folded = self.total(a.device)
            self._terms = []

    def total(self, device: torch.device) -> torch.Tensor:
        """A float64 ``[U]`` tensor on ``device`` (zeros before the first GEMM)."""
        out = torch.zeros(self.num_units, dtype=torch.float64, device=device)
        if self._folded is not None:
            out.add_(self._folded.to(device))
        if not self._terms:
            return out
        units, a, b = zip(*self._terms, strict=True)
        terms = torch.stack(a).double() * torch.stack(b).double()
        out.index_add_(0, self._index_of(units, device), terms.to(device))
        return out

    def _index_of(self, units: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The unit ids as a device tensor, copied from the host once per distinct sequence."""
        cache = self._index.setdefault(device, {})
        if len(cache) > 64:  # the sequence repeats every step; never grow unbounded
            cache.clear()
        return index_tensor(units, device, cache)

    def reset(self) -> None:
        self._terms, self._folded = [], None


@dataclass
class GemmProbe:
    """The error bound of one GEMM call of one unit, filled in its forward, added in its backward.

    ``x_err = ||x - Q(x)||_F`` and ``x_norm = ||x||_F`` are 0-dim device tensors (``None``: the
    term is dropped); :meth:`record` adds ``||dy|| x_err + dy_err x_norm`` to ``B(unit)``.
    """

    sink: ErrorSums
    unit: int
    x_err: torch.Tensor | None = None
    """``||x - Q(x)||_F`` (``None`` when the backend does not round ``x``)."""
    x_norm: torch.Tensor | None = None
    """``||x||_F`` (only needed when the backend rounds ``dy``)."""

    def record(self, dy_norm: torch.Tensor, dy_err: torch.Tensor | None = None) -> None:
        """Add ``||dy|| ||x - Q(x)|| + ||Q(dy) - dy|| ||x||`` to the unit's sum (terms whose
        factors are ``None`` are dropped)."""
        if self.x_err is not None:
            self.sink.add(self.unit, dy_norm, self.x_err)
        if dy_err is not None and self.x_norm is not None:
            self.sink.add(self.unit, dy_err, self.x_norm)

    def record_output_grad(self, y: torch.Tensor) -> None:
        """Record ``||dy|| x_err`` from a hook on the GEMM's output ``y`` (shadow measurement of
        a path that has no backward of its own to read ``dy`` in). The hook only reads."""

        def hook(dy: torch.Tensor) -> None:
            self.record(frobenius(dy))

        y.register_hook(hook)  # type: ignore[no-untyped-call]
