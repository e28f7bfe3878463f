"""``torchao_fp8``: real FP8 GEMMs from torchao's float8 training, switched per unit and per step.

torchao trains a linear layer in FP8 by swapping ``nn.Linear`` for ``Float8Linear``, whose forward
calls one autograd function, ``matmul_with_hp_or_float8_args``: it casts the operands of each of
the three GEMMs to FP8 with its recipe's scales and multiplies them with ``torch._scaled_mm``, a
real FP8 GEMM (H100 tensor cores; a CPU from torch 2.13). The swap is static. This backend keeps
the ``nn.Linear`` modules and installs two forwards over the same parameters per unit:

* low-cost: ``Float8Linear.forward``'s code on the module's weight and bias, bit for bit a
  ``Float8Linear`` of the recipe (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``);
* recovery: ``"bf16"``, the module's own ``F.linear`` (bit for bit the unconverted module, in
  the dtype it trains in), or a stronger recipe;
* ``gnmr.gemms``: one torchao config whose recovered GEMMs take the recovery path's casts
  (disabled ones for ``"bf16"``), the others the low-cost casts
  (:func:`~gnmr_dist.backends.torchao_casts.mixed_config`).

``B(u)`` (``gnmr.gamma``) is the wgrad bound ``||dy|| ||x - Q(x)|| + ||Q(dy) - dy|| ||x||`` with
``Q`` torchao's own wgrad casts of the low-cost recipe
(:func:`~gnmr_dist.backends.torchao_casts.wgrad_cast`): ``x`` in the forward (once per shared
input), ``dy`` in a hook on the output's gradient; a recovered unit scores its low-cost casts.
A GEMM on a reparametrized weight (:meth:`TorchaoFp8Backend.scale_gradient_columns`: ``x D`` and
``W D^-1``, the harness's function-preserving outlier) is scored on the trained weight's gradient.

Refused by name with the fix: torchao missing; an MX recipe (``mxfp8``, ``nvfp4``); a linear whose
features are not multiples of 16 (``torch._scaled_mm`` on a GPU) unless ``pad_inner_dim``; a
module torchao already converted; a ``gnmr.gemms`` mix torchao's config refuses. Why each
choice: ``docs/backends.md#torchao_fp8``.
"""

from __future__ import annotations

import importlib
import logging
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.base import LOW_COST, PrecisionBackend
from gnmr_dist.backends.error_sums import GemmProbe
from gnmr_dist.backends.gemms import ALL_GEMMS, subset_error
from gnmr_dist.backends.registry import register_backend
from gnmr_dist.backends.torchao_options import (
    MX_RECIPES,
    TorchaoLowCost,
    TorchaoRecovery,
    check_pair,
)

__all__ = ["TorchaoFp8Backend", "load_torchao"]

logger = logging.getLogger(__name__)

MIN_TORCHAO = (0, 18)
"""The first torchao whose float8 training this backend is written and tested against."""


def load_torchao() -> types.ModuleType:
    """:mod:`gnmr_dist.backends.torchao_casts` (which imports torchao), or an ``ImportError``
    that says what to install."""
    try:
        torchao = importlib.import_module("torchao")
        casts = importlib.import_module("gnmr_dist.backends.torchao_casts")
    except ImportError as err:
        raise ImportError(
            f"the 'torchao_fp8' backend needs torchao >= {'.'.join(map(str, MIN_TORCHAO))} "
            f"(import failed: {err}); install it with `pip install torchao==0.18.0` (CPU, or "
            "beside your CUDA torch), or use the fp8_emulated backend, which needs nothing"
        ) from err
    version = tuple(int(p) for p in str(torchao.__version__).split("+")[0].split(".")[:2])
    if version < MIN_TORCHAO:
        raise ImportError(
            f"the 'torchao_fp8' backend needs torchao >= {'.'.join(map(str, MIN_TORCHAO))}, "
            f"found {torchao.__version__}; `pip install torchao==0.18.0`"
        )
    return casts


def check_mx_device(recipe: str) -> None:
    """Refuse an MX recipe (``"mxfp8"``, ``"nvfp4"``) by name: torchao runs them on compute
    capability 10.0+ only, and this backend does not run them yet anywhere."""
    if recipe not in MX_RECIPES:
        return
    device = "no CUDA device"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
    raise RuntimeError(
        f"gnmr.low_cost.recipe: {recipe!r} runs on torchao's MX kernels "
        "(torchao.prototype.mx_formats), which need an NVIDIA GPU of compute capability 10.0+, "
        f'and this backend does not run them yet; this host has {device}. Use "tensorwise" or '
        '"rowwise" here, the te_fp8 backend\'s MX recipes on a Blackwell GPU, or fp8_emulated '
        '(format "e2m1" for NVFP4)'
    )


@register_backend("torchao_fp8")
class TorchaoFp8Backend(PrecisionBackend):
    """torchao's float8 training on the low-cost path, BF16 or a stronger recipe on recovery.

    Options: ``low_cost`` (:class:`~gnmr_dist.backends.torchao_options.TorchaoLowCost`,
    default ``{"recipe": "tensorwise"}``) and ``recovery``
    (:class:`~gnmr_dist.backends.torchao_options.TorchaoRecovery`, default
    ``{"recipe": "bf16"}``). Raises ``ImportError`` without torchao and ``RuntimeError`` for an
    MX recipe this host cannot run.

    ``"gnmr"``::

        {"backend": "torchao_fp8", "low_cost": {"recipe": "tensorwise"},
         "recovery": {"recipe": "bf16"}, "max_active": 4}
    """

    reports_errors = True
    LowCost = TorchaoLowCost
    Recovery = TorchaoRecovery
    low_cost: TorchaoLowCost
    recovery: TorchaoRecovery

    def __init__(self, **blocks: Any) -> None:
        super().__init__(**blocks)
        check_pair(self.low_cost.recipe, self.recovery.recipe)
        check_mx_device(self.low_cost.recipe)
        self._ao = load_torchao()
        self.low_config: Any = self._ao.low_cost_config(self.low_cost)
        """The low-cost path's ``torchao.float8.Float8LinearConfig``."""
        rec = self.recovery.recipe
        self.recovery_config: Any = (
            None if rec == "bf16" else self._ao.recipe_config(rec, self.low_cost)
        )
        """The recovery recipe's config (``None``: ``"bf16"``, the module's ``F.linear``)."""
        self.mixed_config: Any = None
        """The config of a recovered unit under ``gnmr.gemms`` (``None``: all three GEMMs)."""
        self._weights: dict[int, tuple[nn.Linear, torch.Tensor]] = {}  # FP8 all-gather wraps
        self._columns: dict[int, torch.Tensor] = {}  # scale_gradient_columns, by id(op)
        self._last_input: tuple[Any, int, tuple[torch.Tensor, torch.Tensor] | None] = (
            None,
            0,
            None,
        )
        logger.info(
            "torchao_fp8: low-cost %s, recovery %s", self.low_cost.recipe, self.recovery.recipe
        )

    # ------------------------------------------------------------------ set-up

    def check_gemms(self, gemms: frozenset[str]) -> None:
        """Any subset torchao's ``Float8LinearConfig`` can express (``"bf16"`` recovery: all of
        them); none with FP8 all-gather, whose FP8 weight feeds fprop and dgrad as it is."""
        if gemms == ALL_GEMMS:
            self.mixed_config = None
            return
        if self.low_cost.fsdp_float8_all_gather:
            raise subset_error(
                self.name,
                gemms,
                "with fsdp_float8_all_gather FSDP2 hands the linear an FP8 weight, which "
                "torchao multiplies as it is in fprop and dgrad",
                "drop gnmr.low_cost.fsdp_float8_all_gather, or recover all three GEMMs",
            )
        recovery = self.recovery_config or self._ao.disabled(self.low_config)
        try:
            self.mixed_config = self._ao.mixed_config(self.low_config, recovery, gemms)
        except ValueError as err:
            raise subset_error(
                self.name, gemms, str(err), 'use "recovery": {"recipe": "bf16"}'
            ) from err

    def supports(self, module: nn.Module) -> bool:
        """``nn.Linear`` (not one torchao already converted: :meth:`wrap` refuses that)."""
        return isinstance(module, nn.Linear)

    def wrap(self, units: Mapping[int, nn.Module]) -> None:
        """Refuse what torchao cannot run (module docstring), wrap each weight for FSDP2's FP8
        all-gather when asked (before ``fully_shard`` and the optimizer, as torchao does), then
        install the switching forwards."""
        for uid, unit in units.items():
            for name, mod in unit.named_modules():
                if isinstance(mod, nn.Linear):
                    self._check_linear(uid, name, mod)
        if self.low_cost.fsdp_float8_all_gather:
            mm = self._ao.linear_mm_config(self.low_config)
            for unit in units.values():
                for mod in unit.modules():
                    if isinstance(mod, nn.Linear) and id(mod) not in self._weights:
                        self._weights[id(mod)] = (mod, mod.weight)
                        mod.weight = self._ao.with_float8_all_gather(
                            mod.weight, mm, self.low_config
                        )
        super().wrap(units)

    def _check_linear(self, uid: int, name: str, mod: nn.Linear) -> None:
        where = f"unit {uid}{'.' + name if name else ''} ({type(mod).__name__})"
        if type(mod).__name__ == "Float8Linear":
            raise ValueError(
                f"torchao_fp8: {where} is already a torchao Float8Linear; give GNMR the model "
                "before convert_to_float8_training (the backend runs the recipe itself and "
                "switches it per step)"
            )
        k, n = mod.in_features, mod.out_features
        if (k % 16 or n % 16) and not self.low_cost.pad_inner_dim:
            raise ValueError(
                f"torchao_fp8: {where} has in_features={k}, out_features={n}; torch._scaled_mm "
                "needs both to be multiples of 16 on a GPU (torchao's filters leave such layers "
                'in high precision): exclude the unit ("exclude": [<its name>]) or set '
                '"low_cost": {"pad_inner_dim": true}'
            )

    def unwrap(self) -> None:
        """Remove the installed forwards and give back the weights wrapped for FP8 all-gather."""
        super().unwrap()
        for mod, weight in self._weights.values():
            mod.weight = weight
        self._weights.clear()

    # ------------------------------------------------------------------ forwards

    def _path_config(self, path: str) -> Any:
        if path == LOW_COST:
            return self.low_config
        return self.recovery_config if self.mixed_config is None else self.mixed_config

    def make_gemm(self, op: nn.Module, path: str) -> Callable[..., torch.Tensor]:
        ao = self._ao
        config = self._path_config(path)
        mm = None if config is None else ao.linear_mm_config(config)

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            y: torch.Tensor
            if config is None:
                y = ao.bf16_linear(x, weight, bias)
            else:
                y = ao.float8_linear(x, weight, bias, config, mm)
            probe = self._error_probe() if weight.requires_grad else None
            if probe is not None and y.requires_grad:
                self._measure(probe, x, y, self._columns.get(id(op)))
            return y

        return gemm

    def scale_gradient_columns(self, op: nn.Module, columns: torch.Tensor | None) -> None:
        """Declare that wrapped operator ``op``'s next GEMMs run on a reparametrized weight:
        the trained parameter's gradient is the GEMM weight's with input column ``k`` times
        ``columns[k]`` (a per-channel scale moved from the weight to the input: ``x D`` and
        ``W D^-1`` give ``columns = 1 / diag(D)``). ``B(u)`` is then taken on the parameter's
        gradient, ``||dy|| ||(x - Q(x)) diag(c)|| + ||Q(dy) - dy|| ||x diag(c)||`` with ``Q``
        torchao's cast of the GEMM's own input, as ``fp8_emulated``'s method of the same name.
        ``None`` undoes it. Read when a GEMM's forward runs."""
        if columns is None:
            self._columns.pop(id(op), None)
        else:
            self._columns[id(op)] = columns.detach()

    # ------------------------------------------------------------------ the damage term

    def _measure(
        self, probe: GemmProbe, x: torch.Tensor, y: torch.Tensor, columns: torch.Tensor | None
    ) -> None:
        """``B(u)`` of this GEMM from the low-cost recipe's wgrad casts: ``x`` now (shared by
        the projections of one input; its own with ``columns``), ``dy`` in a hook on ``y``'s
        gradient."""
        ao, low = self._ao, self.low_config
        mm = ao.linear_mm_config(low)
        if columns is None:
            probe.x_err, probe.x_norm = self._input_norms(x)
        else:
            probe.x_err, probe.x_norm = self._cast_norms(x, columns)

        def hook(dy: torch.Tensor) -> None:
            dy2 = dy.reshape(-1, dy.shape[-1])
            q = ao.wgrad_cast(
                dy2, low.cast_config_grad_output_for_grad_weight, low, mm, "grad_output"
            )
            wide = dy2.to(torch.float32)
            if q is None:
                probe.record(torch.linalg.vector_norm(wide))
                return
            dy_norm, dy_err = torch._foreach_norm([wide, q - wide])
            probe.record(dy_norm, dy_err)

        y.register_hook(hook)  # type: ignore[no-untyped-call]

    def _input_norms(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(||x - Q(x)||, ||x||)`` of the wgrad cast of ``x`` (``(None, None)`` when it is
        disabled), cast once per input tensor (keyed on its identity and version)."""
        ref, version, norms = self._last_input
        if norms is not None and ref is not None and ref() is x and version == x._version:
            return norms
        err, norm = self._cast_norms(x, None)
        if err is not None and norm is not None:
            self._last_input = (weakref.ref(x), x._version, (err, norm))
        return err, norm

    def _cast_norms(
        self, x: torch.Tensor, columns: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(||(x - Q(x)) diag(c)||, ||x diag(c)||)`` of the low-cost wgrad cast ``Q`` of ``x``
        (``c``: ``columns``, or 1); ``(None, None)`` when the cast is disabled."""
        ao, low = self._ao, self.low_config
        x2 = x.detach().reshape(-1, x.shape[-1])
        cast = low.cast_config_input_for_grad_weight
        q = ao.wgrad_cast(x2, cast, low, ao.linear_mm_config(low), "input")
        if q is None:
            return None, None
        wide = x2.to(torch.float32)
        if columns is not None:  # the trained weight's gradient: column k times c_k
            c = columns.to(device=wide.device, dtype=torch.float32)
            q, wide = q * c, wide * c
        err, norm = torch._foreach_norm([q - wide, wide])
        return err, norm
