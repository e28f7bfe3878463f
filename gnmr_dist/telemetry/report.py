"""``gnmr-report RUN_DIR_OR_TRACE [--out PNG] [--title T]``: one PNG that shows what GNMR did.

The figure has four panels over the optimizer steps of a recorded trace:

1. the loss (``extra.loss``; the global gradient norm when the run logged no loss);
2. the per-unit risk ``max(GNMR / alpha_t, dGNMR / beta_t)`` as a units x steps heatmap on a log
   colour scale centred on the threshold 1 (red exceeds, blue is calm, black is a non-finite
   norm), with a circle where a unit ran the recovery path (at the step after it was chosen);
3. the fraction of eligible units that exceeded the threshold, and the fraction chosen for the
   next step's recovery path, at every step, with their run averages after warm-up in the legend;
4. a text summary: steps, units, budget, policy and the two rates.

A trace stores norms, not risk: the risk is recomputed by replaying the norms through a
``GNMRController`` with the recorded config, which reproduces the run exactly (the controller is
deterministic), so the heatmap shows the scores the run's decisions were made from. The rates
use the same definition as ``gnmr-replay``: per eligible unit-step after warm-up.

A trace recorded with ``gnmr.probe`` also gets a printed "selection quality" section: over the
probe steps, the mean (and the number of steps where it is defined) of the precision against the
top gaps and of the share of the squared gap covered, for the gradient gap and the update gap
(``n/a`` where the run could not measure it), of the risk's top-k, the plan that ran, the new
decision, the error scores' top-k (a trace with ``errors``), the first and last layers' units (by
the layer number in the unit names), a random k-set (its exact expectation) and the oracle (the
top-k by the gap: the upper bound), with the median probe time (and the median step time when
the records carry ``extra.step_ms``). The figures are
:func:`gnmr_dist.telemetry.selection.probe_figures`'s.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gnmr_dist.telemetry.replay import Recording, rate_text
from gnmr_dist.telemetry.selection import first_last_units, probe_figures
from gnmr_dist.telemetry.trace import read_probes

__all__ = ["draw_report", "format_selection_quality", "selection_quality", "summarise"]

TRACE_NAME = "trace.jsonl"
MAX_UNIT_LABELS = 40
LABEL_CHARS = 28
MAX_CELLS_X, MAX_CELLS_Y = 500, 250  # heatmap cells; more are max-pooled
RISK_TICKS = (0.01, 0.03, 0.1, 0.25, 0.5, 1, 2, 4, 10, 30, 100, 1e3, 1e4, 1e6)


def resolve_trace(path: str | Path) -> Path:
    """``RUN_DIR/trace.jsonl`` for a run directory, else ``path`` itself."""
    p = Path(path)
    if p.is_dir():
        p = p / TRACE_NAME
        if not p.is_file():
            raise ValueError(f"{path}: a run directory without {TRACE_NAME}")
    elif not p.is_file():
        raise ValueError(f"{path}: no such trace file or run directory")
    return p


def short_names(units: Sequence[str]) -> list[str]:
    """Unit names without their common dotted prefix, long ones cut in the middle."""
    parts = [u.split(".") for u in units]
    common = 0
    if len(parts) > 1:
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
    out = []
    for p in parts:
        name = ".".join(p[common:])
        if len(name) > LABEL_CHARS:
            half = (LABEL_CHARS - 1) // 2
            name = name[:half] + "~" + name[-half:]
        out.append(name)
    return out


def _replay_risk(recording: Recording) -> torch.Tensor:
    """Risk [steps, U] from the recorded norms (and error scores and learning rates), through
    the controller the run built (:meth:`Recording.controller`)."""
    return torch.stack([d.risk for d in recording.decisions()])


def _loss_series(records: list[dict[str, Any]], norms: torch.Tensor) -> tuple[list[float], str]:
    """``extra.loss`` per step (NaN where absent), else the global gradient norm."""
    extras = [r.get("extra") or {} for r in records]
    if any("loss" in e for e in extras):
        return [float(e.get("loss", math.nan)) for e in extras], "loss"
    if any("global_norm" in e for e in extras):
        return [float(e.get("global_norm", math.nan)) for e in extras], "global grad norm"
    return norms.pow(2).sum(dim=1).sqrt().tolist(), "global grad norm (from unit norms)"


def summarise(
    header: Any, norms: torch.Tensor, records: list[dict[str, Any]], risk: torch.Tensor
) -> dict[str, Any]:
    """Per-step fractions and the run rates (per eligible unit-step after warm-up)."""
    elig = torch.tensor(header.eligible, dtype=torch.bool)
    n_elig = max(1, int(elig.sum()))
    exceed = ((risk > 1.0) & elig).sum(dim=1).double() / n_elig
    active = torch.zeros_like(risk, dtype=torch.bool)
    for i, r in enumerate(records):
        active[i, list(r["active"])] = True
    recovery = active.sum(dim=1).double() / n_elig
    ran = torch.zeros_like(active)  # a decision runs at the next step: A_t is the plan of t + 1
    ran[1:] = active[:-1]
    scored = torch.arange(1, len(records) + 1) > header.config.warmup_steps
    n_scored = int(scored.sum())
    return {
        "steps": len(records),
        "units": len(header.units),
        "eligible_units": int(elig.sum()),
        "scored_steps": n_scored,
        "exceedance_rate": float(exceed[scored].sum()) / n_scored if n_scored else None,
        "recovery_rate": float(recovery[scored].sum()) / n_scored if n_scored else None,
        "nonfinite_steps": int((~torch.isfinite(norms)).any(dim=1).sum()),
        "max_active": header.config.max_active,
        "config": header.config.to_dict(),
        "_exceed": exceed,
        "_recovery": recovery,
        "_active": active,
        "_ran": ran,
    }


SELECTION_ROWS = {
    "risk_topk": "risk top-k",
    "active": "active (ran the step)",
    "decided": "decided (next step)",
    "error_topk": "error-score top-k",
    "first_last": "first+last layers",
    "random": "random k (expected)",
    "oracle": "oracle (upper bound)",
}
"""The rows of the selection-quality section, in order, by :func:`probe_figures` row name."""


def selection_quality(
    trace: Path, header: Any, records: list[dict[str, Any]], risk: torch.Tensor, errors: Any
) -> dict[str, Any] | None:
    """Mean figures over the probe steps by row (``None`` for a trace without probe records).

    Each row maps figure -> ``(mean, steps where defined)``; also ``probe_steps``, ``k``,
    ``update_gap`` (whether any probe measured it), ``probe_ms`` and ``step_ms`` (medians;
    ``step_ms`` ``None`` without ``extra.step_ms``).
    """
    probes = read_probes(trace, records, len(header.units))
    if not probes:
        return None
    first_last = first_last_units(header.units)
    values: dict[str, dict[str, list[float]]] = {}
    for p in probes:
        sets = {"active": p.sets["active"], "decided": p.sets["decided"]}
        if first_last:
            sets["first_last"] = first_last
        figures = probe_figures(
            p.grad_gap,
            p.update_gap,
            risk[p.step - 1],
            sets,
            p.k,
            errors=errors[p.step - 1] if errors is not None else None,
            eligible=header.eligible,
        )
        for row, fig in figures.items():
            for key, value in fig.items():
                values.setdefault(row, {}).setdefault(key, []).append(value)
    rows = {
        row: {key: _mean_defined(v) for key, v in fig.items()}
        for row, fig in sorted(values.items(), key=lambda kv: list(SELECTION_ROWS).index(kv[0]))
    }
    steps = [float(r["extra"]["step_ms"]) for r in records if "step_ms" in (r.get("extra") or {})]
    return {
        "probe_steps": len(probes),
        "k": sorted({p.k for p in probes}),
        "update_gap": any(p.update_gap is not None for p in probes),
        "rows": rows,
        "probe_ms": statistics.median(p.probe_ms for p in probes),
        "step_ms": statistics.median(steps) if steps else None,
    }


def _mean_defined(values: Sequence[float]) -> tuple[float, int]:
    defined = [v for v in values if not math.isnan(v)]
    return (statistics.fmean(defined) if defined else math.nan), len(defined)


def format_selection_quality(q: dict[str, Any]) -> str:
    """The printed section of :func:`selection_quality`."""
    ks = ", ".join(str(k) for k in q["k"])
    cols = ("precision_grad", "share_grad", "precision_update", "share_update")
    lines = [
        f"selection quality ({q['probe_steps']} probe steps, k = {ks}; mean [steps defined])",
        "  prec@k: share of the set in the top-|set| gaps; share: of the squared gap covered",
        f"  {'set':<22}{'prec@k grad':>16}{'share grad':>16}{'prec@k update':>16}"
        f"{'share update':>16}",
    ]
    for row, fig in q["rows"].items():
        cells = "".join(f"{_cell(*fig[c]):>16}" for c in cols)
        lines.append(f"  {SELECTION_ROWS[row]:<22}{cells}")
    if not q["update_gap"]:
        lines.append(
            "  update gap: n/a (no per-parameter Adam state to read: DeepSpeed ZeRO 1-2, bf16)"
        )
    probe = f"probe time: median {q['probe_ms']:.1f} ms"
    if q["step_ms"]:
        probe += f", step time median {q['step_ms']:.1f} ms ({q['probe_ms'] / q['step_ms']:.2g}x)"
    lines.append(f"  {probe}")
    return "\n".join(lines)


def _cell(mean: float, n: int) -> str:
    return "n/a" if n == 0 else f"{mean:.3f} [{n}]"


def _import_matplotlib() -> Any:
    """``Figure`` (no pyplot, so no display or global backend) and ``MaxNLocator``."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError(
            "gnmr-report draws with matplotlib: pip install 'gnmr-dist[report]'"
        ) from None
    return Figure, MaxNLocator


def _draw_loss(ax: Any, steps: list[int], values: list[float], label: str) -> None:
    finite = [v for v in values if math.isfinite(v)]
    ax.plot(steps, values, color="tab:blue", lw=1.2, marker="o" if len(steps) < 30 else None, ms=3)
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")
    ax.set_ylabel(label)
    ax.set_title("Training curve", loc="left", fontsize=11)
    ax.grid(alpha=0.3)


def _draw_heatmap(
    fig: Any, ax: Any, cax: Any, risk: torch.Tensor, s: dict[str, Any], header: Any
) -> None:
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    pooled = _max_pool(risk.T, MAX_CELLS_Y, MAX_CELLS_X)  # [U', steps']
    r = pooled.numpy()
    finite = r[torch.isfinite(pooled).numpy()]
    positive = finite[finite > 0]
    hi = max(2.0, float(positive.max()) if positive.size else 2.0)
    lo = min(0.5, float(positive.min()) if positive.size else 0.5)
    span = max(hi, 1.0 / lo)  # symmetric in log space, so 1 sits mid-colourbar
    cmap = colormaps["RdBu_r"].with_extremes(bad="black")
    shown = r.copy()
    shown[~torch.isfinite(pooled).numpy()] = math.nan
    shown[(shown <= 0)] = 1.0 / span
    steps, units = risk.shape
    im = ax.imshow(
        shown,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=LogNorm(vmin=1.0 / span, vmax=span),
        extent=(0.5, steps + 0.5, units - 0.5, -0.5),
    )
    act_u, act_t = torch.nonzero(s["_ran"].T, as_tuple=True)
    ax.scatter(
        (act_t + 1).numpy(),
        act_u.numpy(),
        s=max(4.0, min(36.0, 3000.0 / max(steps, units))),
        facecolors="none",
        edgecolors="k",
        linewidths=0.9,
    )
    cb = fig.colorbar(im, cax=cax)
    cb.minorticks_off()
    ticks = [x for x in RISK_TICKS if 1.0 / span <= x <= span]
    cb.set_ticks(ticks, labels=[f"{x:g}" for x in ticks])
    cb.ax.axhline(1.0, color="k", lw=1.5)
    cb.set_label("risk (log); threshold = 1", fontsize=9)
    _label_units(ax, header)
    ax.set_ylabel("unit")
    ax.set_title(
        "Per-unit risk (red > 1 exceeds; black = non-finite norm; o = ran the recovery path, "
        "chosen the step before)",
        loc="left",
        fontsize=11,
    )


def _max_pool(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block maxima of ``x`` so it fits ``rows x cols`` cells: a spike survives downsampling."""
    kr, kc = math.ceil(x.shape[0] / rows), math.ceil(x.shape[1] / cols)
    if kr == 1 and kc == 1:
        return x
    pool = torch.nn.functional.max_pool2d
    return pool(x[None, None], (kr, kc), ceil_mode=True)[0, 0]


def _label_units(ax: Any, header: Any) -> None:
    names = short_names(header.units)
    every = max(1, math.ceil(len(names) / MAX_UNIT_LABELS))
    ticks = list(range(0, len(names), every))
    ax.set_yticks(ticks)
    ax.set_yticklabels([names[i] for i in ticks], fontsize=7 if len(ticks) > 20 else 8)
    for tick, i in zip(ax.get_yticklabels(), ticks, strict=True):
        if not header.eligible[i]:
            tick.set_color("gray")


def _avg(rate: float | None) -> str:
    return "n/a: all warm-up" if rate is None else f"{100 * rate:.3g}%"


def _draw_fractions(ax: Any, steps: list[int], s: dict[str, Any], warmup: int) -> None:
    marker = "o" if len(steps) < 30 else None
    ax.plot(
        steps,
        (100 * s["_exceed"]).tolist(),
        color="tab:red",
        lw=1.2,
        marker=marker,
        ms=3,
        label=f"exceeding threshold (avg {_avg(s['exceedance_rate'])})",
    )
    ax.plot(
        steps,
        (100 * s["_recovery"]).tolist(),
        color="tab:orange",
        lw=1.2,
        ls="--",
        marker=marker,
        ms=3,
        label=f"chosen for the next step's recovery path (avg {_avg(s['recovery_rate'])})",
    )
    if warmup > 0:
        ax.axvspan(0.5, min(warmup, len(steps)) + 0.5, color="0.85", zorder=0, label="warm-up")
    top = max(float(s["_exceed"].max()), float(s["_recovery"].max()), 0.05)
    ax.set_ylim(-0.03 * 100 * top, 1.25 * 100 * top)
    ax.set_ylabel("% of eligible units")
    ax.set_xlabel("optimizer step")
    ax.set_title("Exceedance and recovery per step", loc="left", fontsize=11)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.85)
    ax.grid(alpha=0.3)


def _schedule(value: Any) -> str:
    """``3.0``, ``cosine 4.0 -> 2.0 over 200 steps`` or ``step 0 -> 8 on lr decay 0 -> 0.5``."""
    if not isinstance(value, dict) or "schedule" not in value:
        return json.dumps(value)
    shape = f"{value['schedule']} {value.get('start')} -> {value.get('end')}"
    if value.get("clock") == "lr_decay":
        return f"{shape} on lr decay {value.get('from', 0)} -> {value.get('to', 1)}"
    start = f" from step {value['from']}" if "from" in value else ""
    return f"{shape} over {value.get('steps')} steps{start}"


def _second_policy(c: dict[str, Any]) -> list[str]:
    """The lines of the keys beyond the first policy, those that are set."""
    lines = []
    for key in ("gamma", "max_share", "latch", "pinned"):
        if c.get(key) is not None:
            lines += _wrapped(f"{key}: {_schedule(c[key])}")
    return lines


def _wrapped(line: str, width: int = 40) -> list[str]:
    import textwrap

    return textwrap.wrap(line, width, subsequent_indent="       ")


def _summary_text(s: dict[str, Any], trace: Path) -> str:
    c = s["config"]
    return "\n".join(
        [
            f"trace: {trace.name}",
            f"steps: {s['steps']}  (scored after warm-up: {s['scored_steps']})",
            f"units: {s['units']}  (eligible: {s['eligible_units']})",
            *_wrapped(f"exceedance rate: {rate_text(s['exceedance_rate'])}"),
            *_wrapped(f"recovery rate:   {rate_text(s['recovery_rate'])}"),
            f"steps with non-finite norm: {s['nonfinite_steps']}",
            f"attempts skipped (non-finite): {s['skipped_attempts']}",
            "",
            *_wrapped(f"budget max_active: {_schedule(c['max_active'])}"),
            *_wrapped(f"alpha: {_schedule(c['alpha'])}"),
            *_wrapped(f"beta:  {_schedule(c['beta'])}"),
            *_second_policy(c),
            f"window: {c['window']}  lock_steps: {c['lock_steps']}",
            f"warmup_steps: {c['warmup_steps']}",
            "",
            "rates: per eligible unit-step",
            "after warm-up (as gnmr-replay)",
            "grey unit labels: not eligible",
        ]
    )


def draw_report(
    trace_path: str | Path, out_path: str | Path, title: str | None = None
) -> dict[str, Any]:
    """Draw the report PNG of a trace (or run directory) and return its summary numbers.

    Raises ``ValueError`` for a missing, empty or invalid trace and ``ImportError`` without
    matplotlib. The summary holds ``steps``, ``units``, ``eligible_units``, ``scored_steps``,
    ``exceedance_rate``, ``recovery_rate`` (fractions; ``None`` when every step is in the
    warm-up), ``nonfinite_steps``, ``skipped_attempts`` (attempts the framework skipped for
    non-finite gradients), ``max_active``, ``config``, ``out`` (the PNG path) and
    ``selection_quality`` (:func:`selection_quality`, ``None`` without probe records).
    """
    trace = resolve_trace(trace_path)
    recording = Recording.read(trace)
    header, norms, records = recording.header, recording.norms, recording.records
    if not records:
        raise ValueError(f"{trace}: the trace has a header but no step records")
    figure_cls, integer_locator = _import_matplotlib()
    risk = _replay_risk(recording)
    s = summarise(header, norms, records, risk)
    s["skipped_attempts"] = recording.skipped_attempts
    s["selection_quality"] = selection_quality(trace, header, records, risk, recording.errors)
    steps = list(range(1, len(records) + 1))
    loss, loss_label = _loss_series(records, norms)

    n_units = len(header.units)
    heat_h = min(9.0, max(2.5, 0.16 * min(n_units, MAX_UNIT_LABELS)))
    fig = figure_cls(figsize=(14, 5.2 + heat_h), layout="constrained")
    gs = fig.add_gridspec(3, 3, width_ratios=[1, 0.025, 0.3], height_ratios=[2.2, heat_h, 2.4])
    ax_loss = fig.add_subplot(gs[0, 0])
    ax_heat = fig.add_subplot(gs[1, 0], sharex=ax_loss)
    ax_frac = fig.add_subplot(gs[2, 0], sharex=ax_loss)
    ax_text = fig.add_subplot(gs[:, 2])
    _draw_loss(ax_loss, steps, loss, loss_label)
    _draw_heatmap(fig, ax_heat, fig.add_subplot(gs[1, 1]), risk, s, header)
    _draw_fractions(ax_frac, steps, s, header.config.warmup_steps)
    ax_loss.set_xlim(0.5, len(steps) + 0.5)
    ax_loss.xaxis.set_major_locator(integer_locator(integer=True))
    ax_text.axis("off")
    ax_text.text(0, 1, _summary_text(s, trace), va="top", ha="left", family="monospace", fontsize=9)
    fig.suptitle(title or f"GNMR report: {trace.parent.name or trace.name}", fontsize=13)

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return {k: v for k, v in s.items() if not k.startswith("_")} | {"out": str(out)}
