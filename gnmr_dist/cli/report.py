"""``gnmr-report RUN_DIR_OR_TRACE [--out PNG] [--title T]``: one PNG that shows what GNMR did.

The figure and the selection-quality figures are :mod:`gnmr_dist.telemetry.report`'s."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gnmr_dist.telemetry.replay import rate_text
from gnmr_dist.telemetry.report import (
    TRACE_NAME,
    draw_report,
    format_selection_quality,
    resolve_trace,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnmr-report", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help=f"a run directory holding {TRACE_NAME}, or a trace file")
    p.add_argument("--out", help="PNG to write (default: report.png next to the trace)")
    p.add_argument("--title", help="figure title (default: the run directory's name)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        trace = resolve_trace(args.run)
        out = Path(args.out) if args.out else trace.parent / "report.png"
        s = draw_report(trace, out, title=args.title)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        msg = f"missing field {err}" if isinstance(err, KeyError) else str(err)
        print(f"gnmr-report: {msg}", file=sys.stderr)
        return 2
    print(
        f"gnmr-report: wrote {s['out']}  ({s['steps']} steps, {s['units']} units; "
        f"exceedance {rate_text(s['exceedance_rate'])}, recovery {rate_text(s['recovery_rate'])})"
    )
    if s["selection_quality"] is not None:
        print(format_selection_quality(s["selection_quality"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
