"""``python -m benchmarks.report``: :func:`benchmarks.report.main`."""

from benchmarks.report import main

raise SystemExit(main())
