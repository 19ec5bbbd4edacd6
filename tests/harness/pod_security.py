"""Pod Security Standards, "restricted" profile: the checks the Kubernetes admission controller makes, on a
rendered pod template. Written from the published standard (kubernetes.io/docs/concepts/security/
pod-security-standards), as no API server runs here; each check returns what fails, in the standard's words.
"""

from __future__ import annotations

#: The volume types "restricted" allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # fmt: skip


def restricted_violations(pod_spec: dict) -> list[str]:
    """What keeps ``pod_spec`` (a Deployment's or DaemonSet's ``spec.template.spec``) out of "restricted"."""
    found = []
    pod_ctx = pod_spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            found.append(f"host namespaces: {flag}")
    for volume in pod_spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume types: {volume['name']} is {', '.join(sorted(kinds - RESTRICTED_VOLUMES))}")
    for c in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        ctx, name = c.get("securityContext") or {}, c["name"]

        def setting(key: str, ctx=ctx):
            return ctx.get(key, pod_ctx.get(key))

        if ctx.get("privileged"):
            found.append(f"privileged: {name}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"host ports: {name}")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"privilege escalation: {name} must set allowPrivilegeEscalation: false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            found.append(f"capabilities: {name} must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"capabilities: {name} adds {caps['add']}")
        if setting("runAsNonRoot") is not True:
            found.append(f"running as non-root: {name} must set runAsNonRoot: true")
        if setting("runAsUser") == 0:
            found.append(f"running as non-root user: {name} runs as UID 0")
        seccomp = (setting("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"seccomp: {name} needs seccompProfile RuntimeDefault or Localhost, has {seccomp}")
    return found
