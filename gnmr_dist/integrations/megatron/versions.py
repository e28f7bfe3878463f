"""What differs between the megatron-core series GNMR supports: one table behind every gate.

Every version-dependent decision in :mod:`megatron_patches` reads :func:`series_info`, never a
version string of its own; megatron-core's version is read in one place,
:func:`installed_version` (at each call, so a test may set ``package_info.__version__``). A
series is listed only after the call sites GNMR hooks were read in its sources and its tests ran
on it (CI runs 0.17.1 in the main venv, 0.16.1 and 0.19.2 in test-only installs). What the
table records, per ``major.minor``:

* ``grads_for_norm``: the optimizer method that returns the gradients megatron's clip norm
  reads (``get_main_grads_for_grad_norm`` up to 0.17; ``get_grads_for_grad_norm`` from 0.19,
  which also takes a ``grad_norm_group`` filter: parameters of a registered separate group,
  e.g. multi-token-prediction layers, are normed and clipped apart).
* ``norm_may_be_tensor``: ``clip_grads.get_grad_norm_fp32`` returns the norm as a device tensor
  (no ``.item()``, no host sync) when TE's ``multi_tensor_scale_tensor`` kernel exists (0.17+);
  0.16 always returns a Python float. The fused patch returns what the original would.
* ``norm_call_sites``: the modules that import ``get_grad_norm_fp32`` by name and call it from
  the optimizer step (the patch replaces the name in each).
* ``has_training``: the wheel ships Megatron-LM's ``megatron/training`` (0.17+).
* ``te_quant_params``: megatron's TE linears read ``self.te_quant_params`` on every forward
  (0.16-0.19), so one projection can be put on a high-precision recipe with no context patch.
* ``grad_sync_current_stream``: DDP's ``start_grad_sync`` asks for ``torch.cuda.current_stream()``
  on every grad sync (0.19: to wait for CUDA-graph weight-gradient events), which
  :mod:`gnmr_dist.testing.megatron_cpu` must then stand in for.

:mod:`gnmr_dist.testing.megatron_cpu` gates on the same table (``SUPPORTED_MEGATRON_VERSIONS``
is its keys).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SERIES",
    "SeriesInfo",
    "installed_version",
    "megatron_series",
    "series_info",
    "series_of",
]


@dataclass(frozen=True)
class SeriesInfo:
    """The facts GNMR's megatron patches depend on, for one megatron-core ``major.minor``."""

    series: str
    """``major.minor``, e.g. ``"0.17"``."""
    checked: str
    """The release whose sources were read and tested (``"0.17.1"``)."""
    grads_for_norm: str
    """Optimizer method returning the gradients of megatron's clip norm."""
    norm_may_be_tensor: bool
    """``get_grad_norm_fp32`` returns a device tensor when TE's tensor-scale kernel exists."""
    norm_call_sites: tuple[str, ...]
    """Modules that call ``get_grad_norm_fp32`` by their own imported name."""
    has_training: bool
    """The wheel ships ``megatron.training`` (Megatron-LM's training loop)."""
    te_quant_params: bool
    """TE linears honour a per-module ``te_quant_params`` on every forward."""
    grad_sync_current_stream: bool
    """DDP's grad sync calls ``torch.cuda.current_stream()`` unconditionally."""


_OPTIMIZER = "megatron.core.optimizer.optimizer"
_LAYER_WISE = "megatron.core.optimizer.layer_wise_optimizer"

SERIES: dict[str, SeriesInfo] = {
    "0.16": SeriesInfo(
        series="0.16", checked="0.16.1", grads_for_norm="get_main_grads_for_grad_norm",
        norm_may_be_tensor=False, norm_call_sites=(_OPTIMIZER, _LAYER_WISE),
        has_training=False, te_quant_params=True, grad_sync_current_stream=False,
    ),
    "0.17": SeriesInfo(
        series="0.17", checked="0.17.1", grads_for_norm="get_main_grads_for_grad_norm",
        norm_may_be_tensor=True, norm_call_sites=(_OPTIMIZER, _LAYER_WISE),
        has_training=True, te_quant_params=True, grad_sync_current_stream=False,
    ),
    "0.19": SeriesInfo(
        series="0.19", checked="0.19.2", grads_for_norm="get_grads_for_grad_norm",
        norm_may_be_tensor=True, norm_call_sites=(_OPTIMIZER, _LAYER_WISE),
        has_training=True, te_quant_params=True, grad_sync_current_stream=True,
    ),
}  # fmt: skip
"""The supported series. 0.18 is absent: it was never read nor tested here."""


def series_of(version: str) -> str:
    """``major.minor`` of a version string (``"0.19.2+abc"`` -> ``"0.19"``)."""
    return ".".join(version.split(".")[:2])


def installed_version() -> str:
    """The installed megatron-core's version string (``"0.19.2+abc"``), read at each call.

    Every reader of megatron-core's version goes through this one function.
    """
    from megatron.core import package_info

    return str(package_info.__version__)


def megatron_series() -> str:
    """The installed megatron-core's ``major.minor``."""
    return series_of(installed_version())


def series_info(series: str | None = None, *, what: str = "megatron_patches") -> SeriesInfo:
    """The table row of ``series`` (default: the installed one); refuses an unlisted series.

    ``what`` names the caller in the error, so a refusal says which feature needs which version.
    """
    series = megatron_series() if series is None else series
    info = SERIES.get(series)
    if info is None:
        listed = ", ".join(f"{s}.x (checked on {i.checked})" for s, i in SERIES.items())
        raise RuntimeError(
            f"{what}: megatron-core {series} is not in the version table "
            f"(gnmr_dist.integrations.megatron.versions.SERIES: {listed}). Install one of "
            "those, or read this series' optimizer/clip_grads.py and optimizer.py against the "
            "table's fields and add a row."
        )
    return info
