"""Replay recorded workloads against an engine, in simulated or real time, under batch-limit policies."""
