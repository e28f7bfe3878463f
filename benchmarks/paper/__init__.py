"""The paper's three experiments at CPU scale (docs/algorithm.md#paper-experiments) and the
harness
they train with: side-by-side arms of one small Llama from the same weights on the same batches.

The harness (:mod:`.harness`, :mod:`.arms`, :mod:`.model`, :mod:`.training`, :mod:`.probes`)
is shared with :mod:`benchmarks.sweep` and :mod:`benchmarks.overhead`.
"""
