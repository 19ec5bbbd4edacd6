"""`batchlens plan`: how many replicas of which GPU and model profile serve a trace within its SLO, and at what cost."""
