"""`batchlens report`: the article's batch efficiency trend report, as a PNG and an HTML page."""
