"""The kubelet's pod-resources API: which pod holds which GPU on this node (docs/kubernetes.md)."""
