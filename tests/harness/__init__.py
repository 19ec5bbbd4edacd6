"""Test harness shared by every test module: real processes, real HTTP.

- procs:     free ports, waiting for HTTP, managed subprocesses
- vllm:      one real vLLM 0.32 on the CPU (docs/architecture.md says how) and a load helper
- upstreams: HTTP upstreams that behave like a vLLM server, well or badly
- exporter:  the batchlens exporter as a subprocess
- prometheus: a real Prometheus (Debian package) in a temporary folder
"""
