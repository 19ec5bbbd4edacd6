"""``batchlens doctor``: the article's hardware and host checklist, run and explained.

:mod:`~batchlens.doctor.probe` reads (kernel settings, NVML, processes);
:mod:`~batchlens.doctor.checks` judges, without I/O, so every outcome can be
tested from readings alone.
"""
