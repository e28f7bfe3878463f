"""Precision policies against controls: the selection sweeps of issue 13
(:mod:`.selection`, whole runs paired by seed) and the FP4 sweeps of issue 24 (:mod:`.fp4`,
measured with the branch estimator of :mod:`.branch`), their regimes, statistics and reports.
"""
