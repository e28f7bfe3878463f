"""``quantizers[recipe]`` and ``shadow_bound[recipe]``: the shadow route against TE's own casts.

``quantizers``: the shadow's quantized wgrad operands (:mod:`.operands`: outlier channels) against
TE's quantizer of the recipe on the same BF16 tensors, as TE's recipe states build them
(``transformer_engine/pytorch/quantization.py``): ``Float8Quantizer`` at the stale delayed scale,
``Float8CurrentScalingQuantizer``, ``Float8BlockQuantizer`` (1 x 128, power-of-two scales),
``MXFP8Quantizer`` and ``NVFP4Quantizer`` (Hadamard transform and post-transform amax on the
columnwise data) with e4m3 ``x`` and e5m2 ``dy`` (HYBRID). TE's columnwise data is read back in
the shadow's ``[tokens, features]`` layout by shape (TE stores it transposed for per-tensor and
1 x 128 casts and for NVFP4, untransposed for MXFP8; scales padded for the GEMM, sliced here).
Codes and scales must be equal bit for bit (NVFP4: e2m1 values, ``-0 == 0``; its tensor amax
too), and ``B`` of the operands decoded from TE's tensors must equal the shadow's. NVFP4's
stochastic rounding of ``dy`` draws TE's random bits, not the shadow's: there the scales must be
equal, every TE code within one e2m1 step of the nearest one, and ``B`` within
:data:`SR_RTOL`.

``shadow_bound``: ``te_fp8`` with ``gamma`` on one ``te.Linear`` (bias) and on one
``te.LayerNormLinear`` (RMSNorm, zero-centred gamma, ``return_layernorm_output``): over three
steps of the outlier operands, the backend's error sum (``error_sums``) against ``B`` from TE's
quantizers on the input and output gradient the module really had (delayed: at the scales its
``fp8_meta`` held in the forward and when ``dy`` arrived), and the outputs and gradients against
the same module under plain TE (measuring changes nothing). ``Linear``: bit for bit (NVFP4:
within :data:`SR_RTOL`); ``LayerNormLinear``: the route recomputes the norm in torch's order,
so within :data:`NORM_RTOL`, against TE's own ``ln_out`` (not under ``delayed``, whose fused
norm-and-cast TE skips when it returns ``ln_out``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.shadow import WgradOperands, quantize_wgrad_operands, wgrad_bound
from gnmr_dist.backends.te_fp8 import TEFp8Backend
from gnmr_dist.backends.te_shadow import gemm_input
from gnmr_dist.train.gpu_check.common import DEVICE, bf16_kw, diff, plain_region, te_pytorch
from gnmr_dist.train.gpu_check.operands import (
    BLOCK,
    FEATURES,
    TOKENS,
    decode,
    delayed_scales,
    fp8_dtype,
    grid_index,
    outlier_operands,
    recipe_of,
    shadow_operands,
)
from gnmr_dist.train.gpu_check.runner import Outcome

__all__ = ["check_quantizers", "check_shadow_bound", "te_cast"]

SR_RTOL = 0.03
"""NVFP4's stochastically rounded ``dy``: ``|B_TE - B_shadow| / B_shadow`` at most this (two
draws of the same noise over 160k elements differ by well under 1%)."""
NORM_RTOL = 0.01
"""``LayerNormLinear``: ``B`` on the recomputed norm against ``B`` on TE's ``ln_out``."""
SR_SEED = 1234
_QUANTIZERS = {
    "delayed": "Float8Quantizer",
    "tensorwise": "Float8CurrentScalingQuantizer",
    "blockwise": "Float8BlockQuantizer",
    "mxfp8": "MXFP8Quantizer",
    "nvfp4": "NVFP4Quantizer",
}
"""TE's quantizer of each recipe."""


def _quantizer_class(name: str) -> Any:
    """A TE quantizer class: exported by ``transformer_engine.pytorch`` (2.20) or its
    ``tensor`` package, else from the module that defines it."""
    homes = (
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.tensor",
        {
            "Float8Quantizer": "transformer_engine.pytorch.tensor.float8_tensor",
            "Float8CurrentScalingQuantizer": "transformer_engine.pytorch.tensor.float8_tensor",
            "Float8BlockQuantizer": "transformer_engine.pytorch.tensor.float8_blockwise_tensor",
            "MXFP8Quantizer": "transformer_engine.pytorch.tensor.mxfp8_tensor",
            "NVFP4Quantizer": "transformer_engine.pytorch.tensor.nvfp4_tensor",
        }[name],
    )
    for home in homes:
        try:
            cls = getattr(importlib.import_module(home), name, None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise ImportError(f"this Transformer Engine has no {name}")


def _tex() -> Any:
    """``transformer_engine_torch``, TE's compiled extension (its ``DType``)."""
    return importlib.import_module("transformer_engine_torch")


def _te_dtype(fmt: str) -> Any:
    tex = _tex()
    return {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}[fmt]


def make_quantizer(
    name: str, fmt: str, *, scale: torch.Tensor | None = None, stochastic: bool = False
) -> Any:
    """TE's quantizer of recipe ``name`` for format ``fmt``, rowwise and columnwise, as the
    recipe state builds it (``scale``: delayed scaling's)."""
    cls = _quantizer_class(_QUANTIZERS[name])
    both = {"rowwise": True, "columnwise": True}
    if name == "delayed":
        assert scale is not None
        amax = torch.zeros(1, dtype=torch.float32, device=DEVICE)
        return cls(scale=scale.reshape(1).clone(), amax=amax, fp8_dtype=_te_dtype(fmt), **both)
    if name == "tensorwise":
        return cls(_te_dtype(fmt), torch.device(DEVICE), **both)
    if name == "blockwise":
        return cls(
            _te_dtype(fmt), amax_epsilon=0.0, force_pow_2_scales=True, block_scaling_dim=1, **both
        )
    if name == "mxfp8":
        quantizer = cls(_te_dtype(fmt), **both)
        quantizer.optimize_for_gemm = False  # compact scales, not the GEMM-swizzled layout
        return quantizer
    quantizer = cls(
        fp4_dtype=_tex().DType.kFloat4E2M1,
        with_rht=True,
        with_post_rht_amax=True,
        stochastic_rounding=stochastic,
        **both,
    )
    quantizer.optimize_for_gemm = False
    return quantizer


@dataclass(frozen=True)
class TECast:
    """TE's quantized columnwise tensor in the shadow's ``[tokens, features]`` layout."""

    values: torch.Tensor
    """fp32 code values (FP8 codes as their values; NVFP4's e2m1 values)."""
    raw: torch.Tensor | None
    """The FP8 code bytes (``None`` for NVFP4)."""
    scale_inv: torch.Tensor
    """0-dim per tensor; ``[tokens / block, features]`` (MXFP8: the E8M0 bytes; NVFP4: the
    E4M3 block scales as fp32)."""
    amax: torch.Tensor | None = None
    """NVFP4's columnwise (post-transform) tensor amax."""
    transpose_agrees: bool = True
    """Per tensor: TE's cached transpose, where it made one, holds the same bytes."""

    def decoded(self, name: str) -> torch.Tensor:
        return decode(name, self.values, self.scale_inv, self.amax)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _tokens_first(t: torch.Tensor, tokens: int, features: int, what: str) -> torch.Tensor:
    """``t`` as a contiguous ``[tokens, features]`` (TE's columnwise tensors are that or its
    transpose; contiguous, so norms reduce in the shadow's order)."""
    if tuple(t.shape) == (tokens, features):
        return t.contiguous()
    if tuple(t.shape) == (features, tokens):
        return t.t().contiguous()
    raise RuntimeError(f"TE's {what} is shaped {tuple(t.shape)}, not [{tokens}, {features}]")


def _scales(t: torch.Tensor, rows: int, features: int, what: str) -> torch.Tensor:
    """The valid ``[rows, features]`` part of a padded scale tensor (or of its transpose)."""
    if t.shape[0] >= rows and t.shape[1] >= features and t.shape[0] < features:
        return t[:rows, :features].contiguous()
    if t.shape[0] >= features and t.shape[1] >= rows:
        return t[:features, :rows].t().contiguous()
    raise RuntimeError(f"TE's {what} is shaped {tuple(t.shape)}: no [{rows}, {features}] in it")


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """TE's packed FP4 (two codes a byte, the low nibble first) -> e2m1 values, fp32."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), device=packed.device)
    magnitude = grid[(nibbles & 0x7).long()]
    return torch.where((nibbles & 0x8) != 0, -magnitude, magnitude)


def te_cast(name: str, fmt: str, q: Any, tokens: int, features: int) -> TECast:
    """Read TE's quantized tensor ``q`` of recipe ``name`` back (module docstring)."""
    if BLOCK[name] == 0:
        data = q._data if q._data is not None else q._transpose.t()
        raw = _tokens_first(_bytes(data), tokens, features, "FP8 data")
        transpose = getattr(q, "_transpose", None)
        agrees = True
        if transpose is not None and not getattr(q, "_transpose_invalid", False):
            agrees = torch.equal(
                _tokens_first(_bytes(transpose), tokens, features, "FP8 data"), raw
            )
        values = raw.view(fp8_dtype(fmt)).float()
        return TECast(values, raw, q._scale_inv.float().reshape(()), None, agrees)
    rows = tokens // BLOCK[name]
    if name == "nvfp4":
        values = _tokens_first(_unpack_e2m1(_bytes(q._columnwise_data)), tokens, features, "data")
        scales = _scales(_bytes(q._columnwise_scale_inv), rows, features, "NVFP4 scales")
        scale_inv = scales.contiguous().view(torch.float8_e4m3fn).float()
        return TECast(values, None, scale_inv, q._amax_columnwise.float().reshape(()))
    raw = _tokens_first(_bytes(q._columnwise_data), tokens, features, "columnwise data")
    scales = _scales(q._columnwise_scale_inv, rows, features, "columnwise scales")
    if name == "mxfp8":
        scales = _bytes(scales)
    return TECast(
        raw.view(fp8_dtype(fmt)).float(), raw, scales.float() if name == "blockwise" else scales
    )


def quantize(name: str, fmt: str, t: torch.Tensor, **kwargs: Any) -> TECast:
    with torch.no_grad():
        q = make_quantizer(name, fmt, **kwargs)(t)
    return te_cast(name, fmt, q, t.shape[0], t.shape[1])


def _compare(name: str, side: str, te: TECast, cast: Any, ops_t: torch.Tensor) -> list[str]:
    """Codes, scales (and NVFP4's amax) bit for bit."""
    out = []
    if te.raw is not None:
        wrong = int((te.raw != cast.codes.view(torch.uint8)).sum())
    else:
        wrong = int((te.values != cast.codes).sum())
    if wrong:
        out.append(f"{side}: {wrong} of {te.values.numel()} codes differ")
    if not torch.equal(te.scale_inv, cast.scale_inv.to(te.scale_inv.dtype)):
        out.append(f"{side}: {int((te.scale_inv != cast.scale_inv).sum())} scales differ")
    if te.amax is not None and not torch.equal(te.amax, ops_t.abs().amax()):
        out.append(f"{side}: tensor amax {float(te.amax)!r} vs {float(ops_t.abs().amax())!r}")
    if not te.transpose_agrees:
        out.append(f"{side}: TE's transpose holds other bytes than its data")
    return out


def te_bound(name: str, ops: WgradOperands, tx: TECast, tdy: TECast) -> float:
    """``B`` of the operands decoded from TE's tensors (the shadow's high-precision ``x``,
    ``dy`` in the same, rotated under NVFP4, layout)."""
    te_ops = WgradOperands(ops.x, tx.decoded(name), ops.dy, tdy.decoded(name))
    return float(wgrad_bound(te_ops))


def check_quantizers(context: Any, name: str) -> Outcome:
    """The module docstring's ``quantizers[name]``."""
    del context
    x, dy = outlier_operands(DEVICE)
    ops = shadow_operands(name, x, dy)
    recipe = recipe_of(name)
    scales = delayed_scales(x, dy) if name == "delayed" else (None, None)
    extra = [{} if s is None else {"scale": s} for s in scales]
    tx = quantize(name, recipe.x_format, x, **extra[0])
    tdy = quantize(name, recipe.grad_format, dy, **extra[1])
    problems = _compare(name, "x", tx, ops.x_cast, ops.x) + _compare(
        name, "dy", tdy, ops.dy_cast, ops.dy
    )
    b_shadow, b_te = float(wgrad_bound(ops)), te_bound(name, ops, tx, tdy)
    if b_te != b_shadow:
        problems.append(f"B from TE's tensors {b_te!r} != the shadow's {b_shadow!r}")
    data: dict[str, Any] = {"B_shadow": b_shadow, "B_te": b_te}
    if name == "nvfp4":
        problems += _stochastic_dy(x, dy, data)
    n = sum(FEATURES.values()) * TOKENS
    detail = (
        f"{n} codes and their scales bit for bit (x {recipe.x_format}, dy "
        f"{recipe.grad_format}), B {b_te:.6g} equal"
    )
    if name == "nvfp4":
        detail += (
            f"; stochastic dy: scales equal, codes within one step, B within {data['sr_rel']:.2%}"
        )
    return Outcome.judged(problems, detail, data, prefix=f"{name}: ")


def _stochastic_dy(x: torch.Tensor, dy: torch.Tensor, data: dict[str, Any]) -> list[str]:
    ops = shadow_operands("nvfp4", x, dy, seed=SR_SEED)
    near = shadow_operands("nvfp4", x, dy)
    assert near.dy_cast is not None
    tdy = quantize("nvfp4", "e4m3", dy, stochastic=True)
    tx = quantize("nvfp4", "e4m3", x)
    out = []
    if not torch.equal(tdy.scale_inv, near.dy_cast.scale_inv):
        out.append("stochastic dy: TE's block scales differ from the nearest-rounded ones")
    steps = (grid_index(tdy.values) - grid_index(near.dy_cast.codes)).abs()
    data["sr_moved"] = moved = float((steps > 0).float().mean())
    if int(steps.max()) > 1 or moved == 0.0:
        out.append(
            f"stochastic dy: TE's codes up to {int(steps.max())} steps away, {moved:.1%} moved"
        )
    b_shadow, b_te = float(wgrad_bound(ops)), te_bound("nvfp4", ops, tx, tdy)
    data["sr_rel"] = rel = abs(b_te - b_shadow) / b_shadow
    if rel > SR_RTOL:
        out.append(f"stochastic dy: B {b_te:.6g} (TE) vs {b_shadow:.6g} (shadow), {rel:.2%} apart")
    return out


# ---------------------------------------------------------------------- through the backend


@dataclass
class _Seen:
    """What one measured step of the module had: its GEMM input, ``dy``, delayed scales."""

    x: torch.Tensor | None = None
    dy: torch.Tensor | None = None
    x_scale: torch.Tensor | None = None
    dy_scale: torch.Tensor | None = None


def _watch(module: nn.Module, seen: _Seen, layernorm: bool) -> list[Any]:
    def forward_hook(m: nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
        y = out[0] if isinstance(out, tuple) else out
        seen.x = (out[1] if layernorm else inputs[0]).detach()
        meta = getattr(m, "fp8_meta", None) or {}
        if "scaling_fwd" in meta and hasattr(meta["scaling_fwd"], "scale"):
            seen.x_scale = meta["scaling_fwd"].scale[0].clone()

        def grad_hook(dy: torch.Tensor) -> None:
            seen.dy = dy.detach()
            if "scaling_bwd" in meta and hasattr(meta["scaling_bwd"], "scale"):
                seen.dy_scale = meta["scaling_bwd"].scale[0].clone()

        y.register_hook(grad_hook)

    return [module.register_forward_hook(forward_hook)]


def _module(layernorm: bool) -> nn.Module:
    te = te_pytorch()
    torch.manual_seed(0)
    k, n = FEATURES["x"], FEATURES["dy"]
    if not layernorm:
        return te.Linear(k, n, **bf16_kw())  # type: ignore[no-any-return]
    module = te.LayerNormLinear(
        k,
        n,
        normalization="RMSNorm",
        zero_centered_gamma=True,
        return_layernorm_output=True,
        **bf16_kw(),
    )
    with torch.no_grad():
        module.layer_norm_weight.normal_(0.0, 0.2)
    return module  # type: ignore[no-any-return]


def _run(module: nn.Module, name: str, measured: bool, steps: int = 3) -> list[dict[str, Any]]:
    """``steps`` forward/backward passes of ``module`` on the outlier operands (``x`` in,
    ``g = dy`` as the output gradient): under the backend with the shadow route when
    ``measured``, else under plain TE. Per step: output, gradients, the backend's error sum and
    what the module had (:class:`_Seen`)."""
    x, g = outlier_operands(DEVICE)
    seen, records = _Seen(), []
    backend = None
    if measured:
        backend = TEFp8Backend(low_cost={"recipe": name})
        backend.wrap({0: module})
        backend.track_errors(1, every=1)
    handles = _watch(module, seen, hasattr(module, "layer_norm_weight"))
    plain = plain_region(name)
    try:
        for s in range(1, steps + 1):
            torch.manual_seed(s)  # TE's stochastic rounding draws the same bits in both runs
            if backend is not None:
                backend.apply(set(), s)
            with backend.autocast() if backend is not None else plain():
                out = module(x)
            y = out[0] if isinstance(out, tuple) else out
            (y.float() * g.float()).sum().backward()
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            module.zero_grad(set_to_none=True)
            sums = None
            if backend is not None:
                errors = backend.error_sums(torch.device(DEVICE))
                assert errors is not None
                sums = float(errors[0])
            records.append(
                {"y": y.detach(), "grads": grads, "sums": sums, "seen": _Seen(**vars(seen))}
            )
    finally:
        for h in handles:
            h.remove()
        if backend is not None:
            backend.unwrap()
    return records


def _reference_bound(name: str, seen: _Seen) -> float:
    """``B`` from TE's quantizers on what the module had (delayed: at its scales; NVFP4's
    ``dy`` rounded stochastically, as the module's backward does)."""
    assert seen.x is not None and seen.dy is not None
    recipe = recipe_of(name)
    delayed = name == "delayed"
    ops = quantize_wgrad_operands(
        seen.x,
        seen.dy,
        recipe,
        x_scale=seen.x_scale if delayed else None,
        dy_scale=seen.dy_scale if delayed else None,
    )
    kx = {"scale": seen.x_scale} if delayed else {}
    kdy = {"scale": seen.dy_scale} if delayed else {"stochastic": name == "nvfp4"}
    tx = quantize(name, recipe.x_format, seen.x, **kx)
    tdy = quantize(name, recipe.grad_format, seen.dy, **kdy)
    return te_bound(name, ops, tx, tdy)


def _pair(layernorm: bool) -> tuple[nn.Module, nn.Module]:
    """Two copies of the module (the same parameters, fresh TE state each)."""
    a, b = _module(layernorm), _module(layernorm)
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            q.copy_(p)
    return a, b


def check_shadow_bound(context: Any, name: str) -> Outcome:
    """The module docstring's ``shadow_bound[name]``."""
    del context
    problems: list[str] = []
    data: dict[str, Any] = {}
    for layernorm in [False] if name == "delayed" else [False, True]:
        label = "LayerNormLinear" if layernorm else "Linear"
        base, twin = _pair(layernorm)
        got = _run(base, name, measured=True)
        want = _run(twin, name, measured=False)
        tol = NORM_RTOL if layernorm else (SR_RTOL if name == "nvfp4" else 0.0)
        rels = []
        for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
            ref = _reference_bound(name, a["seen"])
            rel = abs(a["sums"] - ref) / ref if ref else float("inf")
            rels.append(rel)
            if rel > tol:
                problems.append(
                    f"{label} step {step}: route {a['sums']!r} vs TE {ref!r} ({rel:.2e})"
                )
            grads_same = all(diff(p, q) == 0.0 for p, q in zip(a["grads"], b["grads"], strict=True))
            if diff(a["y"], b["y"]) != 0.0 or not grads_same:
                problems.append(f"{label} step {step}: measuring changed the output or a gradient")
        if layernorm:
            problems += _norm_input(base, got[-1]["seen"])
        data[label] = {"max_rel": max(rels), "sums": [r["sums"] for r in got]}
    parts = [f"{k} max rel {v['max_rel']:.1e}" for k, v in data.items()]
    detail = (
        f"{name}: the route's B(u) over 3 steps == B from TE's quantizers ({', '.join(parts)}); "
        "outputs and gradients as plain TE"
    )
    return Outcome.judged(problems, detail, data, prefix=f"{name}: ")


def _norm_input(module: nn.Module, seen: _Seen) -> list[str]:
    """The route's recomputed normalised input against TE's ``ln_out``: within one BF16 step
    (``2^-7`` relative) everywhere."""
    assert seen.x is not None
    x, _ = outlier_operands(DEVICE)
    mine = gemm_input(module, x, fused_cast=False).float()
    theirs = seen.x.float()
    far = int(((mine - theirs).abs() > theirs.abs() * 2.0**-7 + 1e-30).sum())
    return (
        [f"LayerNormLinear: {far} recomputed norm outputs over one BF16 step off TE's"]
        if far
        else []
    )
