"""The markdown tables of parts (b) and (c), printed by ``python -m benchmarks.overhead`` and
shown in RESULTS.md."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.markdown import markdown_table


def monitor_table(rows: list[dict[str, Any]]) -> str:
    """Part (b)'s table: per gradient set and arm, the median time and its ratio to clipping."""
    cells = [[r["grads"], r["arm"], f"{r['median_ms']:.3f}", f"{r['ratio']:.3f}"] for r in rows]
    return markdown_table(["gradients", "arm", "median ms", "/ clip_grad_norm_"], cells)


def collectives_table(res: dict[str, Any]) -> str:
    """Part (c)'s table: per rank and step, the collectives with GNMR off and on."""
    header = ["rank", "step", "off: calls / bytes", "on: calls / bytes", "extra (wrapper)"]
    header += ["extra (gloo profiler)", "expected"]
    want = f"all_reduce {res['expected_extra_bytes']} B"

    def calls(pairs: list[tuple[str, int]]) -> str:
        return ", ".join(f"{op} {n} B" for op, n in pairs) or "none"

    rows = [
        [
            str(r["rank"]),
            str(r["step"]),
            f"{r['off_calls']} / {r['off_bytes']}",
            f"{r['on_calls']} / {r['on_bytes']}",
            calls(r["extra"]),
            calls(r["extra_gloo"]),
            want,
        ]
        for r in res["rows"]
    ]
    return markdown_table(header, rows)
