"""The markdown tables of parts (b) and (c), printed by ``python -m benchmarks.overhead`` and
shown in RESULTS.md."""

from __future__ import annotations

from typing import Any


def monitor_table(rows: list[dict[str, Any]]) -> str:
    """Part (b)'s table: per gradient set and arm, the median time and its ratio to clipping."""
    lines = ["| gradients | arm | median ms | / clip_grad_norm_ |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {r['grads']} | {r['arm']} | {r['median_ms']:.3f} | {r['ratio']:.3f} |" for r in rows
    ]
    return "\n".join(lines)


def collectives_table(res: dict[str, Any]) -> str:
    """Part (c)'s table: per rank and step, the collectives with GNMR off and on."""
    lines = [
        "| rank | step | off: calls / bytes | on: calls / bytes | extra (wrapper) | "
        "extra (gloo profiler) | expected |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    want = f"all_reduce {res['expected_extra_bytes']} B"
    for r in res["rows"]:
        extra = ", ".join(f"{op} {n} B" for op, n in r["extra"]) or "none"
        extra_g = ", ".join(f"{op} {n} B" for op, n in r["extra_gloo"]) or "none"
        lines.append(
            f"| {r['rank']} | {r['step']} | {r['off_calls']} / {r['off_bytes']} | "
            f"{r['on_calls']} / {r['on_bytes']} | {extra} | {extra_g} | {want} |"
        )
    return "\n".join(lines)
