from benchmarks.report import main

raise SystemExit(main())
