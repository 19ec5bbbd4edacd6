"""``batchlens sweep``: drive an engine through batch limits under a fixed load and find the knee.

:mod:`~batchlens.sweep.knee` decides (pure), :mod:`~batchlens.sweep.run`
drives the engine and measures, :mod:`~batchlens.sweep.output` writes the
table, the CSV and the PNG.
"""
