"""Engine discovery on Kubernetes: the vLLM pods, found through the API server, become engines."""
