"""A fake Kubernetes API server and the pods it lists, over real HTTP.

Fake boundary: the API server (none can run here). It keeps Leases and ConfigMaps (create, get, replace, with
the real one's resourceVersion conflicts), and answers ``GET /api/v1/pods``,
``/api/v1/namespaces/<ns>/pods`` and ``/api/v1/namespaces/<ns>/secrets/<name>`` with the
JSON shapes the real one sends (a PodList, a Secret, or a Status for an error), takes a merge
``PATCH`` of a Secret's data with the real one's resourceVersion precondition (409), and applies
``labelSelector`` and ``fieldSelector`` equality terms, as lightkube sends them. Each listed
pod with an IP is also a real HTTP server on that loopback IP (127.0.0.2, 127.0.0.3, ...)
serving a real vLLM 0.32 exposition and the plugin's admin API, which takes the token of
the Secret in the namespace ``serve_pod`` gives it; every Authorization header a pod's
server receives is kept in ``authorizations``, and the token that signed each admin call in ``signers``, so a
test sees where a token went.
Tests change ``pods``, ``tokens`` and ``forbidden`` while it runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from pathlib import Path

from aiohttp import web

from batchlens.admin_auth import PodIdentity
from harness.admin import accepted
from harness.procs import free_port

CAPTURE = Path(__file__).resolve().parent.parent / "data" / "releases" / "vllm-0.32.0-cpu.prom"
FORBIDDEN = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'pods is forbidden: User "system:serviceaccount:batchlens:bl-batchlens" cannot list resource '
    '"pods" in API group "" at the cluster scope',
    "reason": "Forbidden",
    "details": {"kind": "pods"},
    "code": 403,
}


TOKEN_SECRET = {"name": "batchlens-admin-token", "key": "token"}  # batchlens' default admin_token_secret and key


def pod(
    name: str, ip: str | None, *, node: str = "gpu-node-a", namespace: str = "serving", labels=None,
    token_secret: dict | None = TOKEN_SECRET,
) -> dict:  # fmt: skip
    """A pod as the API server returns it: running with an IP, or pending without one.

    Its container takes BATCHLENS_ADMIN_TOKEN from ``token_secret`` (None: the pod holds no admin token).
    """
    status = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}], "qosClass": "Burstable"}
    if ip:
        ready = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T10:01:00Z"}
        status = {"phase": "Running", "hostIP": "10.0.0.5", "podIP": ip, "podIPs": [{"ip": ip}],
                  "startTime": "2026-12-01T10:00:00Z", "qosClass": "Burstable", "conditions": [ready]}  # fmt: skip
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"0c6a7e1e-{abs(hash(name)) % 10**4:04d}-4c1b-9f0e-5a7d9b1c2e3f",
            "resourceVersion": "4711",
            "creationTimestamp": "2026-12-01T10:00:00Z",
            "labels": labels or {"app.kubernetes.io/name": "vllm"},
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "vllm",
                    "image": "registry.example.com/vllm-batchlens:0.32.0",
                    "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                    "env": [{"name": "VLLM_PLUGINS", "value": "batchlens"}]
                    + (
                        [{"name": "BATCHLENS_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": token_secret}}]
                        if token_secret
                        else []
                    ),
                }
            ],
        },
        "status": status,
    }


def _matches(item: dict, selector: str, fields: str) -> bool:
    labels = item["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    for term in filter(None, fields.split(",")):
        key, _, value = term.partition("=")
        if key == "spec.nodeName" and item["spec"].get("nodeName") != value:
            return False
    return True


class FakeKubernetes:
    """The API server. ``tokens`` holds each namespace's Secret batchlens-admin-token (namespace -> token), and
    ``webhook_tokens`` the same Secret's webhook-token key, where a namespace has one."""

    def __init__(self, pod_port: int, admin_token: str = "pod-admin-token") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pod_port = pod_port
        self.pods: list[dict] = []
        self.forbidden = False
        self.requests: list[str] = []
        self.admin_token = admin_token
        self.tokens: dict[str, str] = {"serving": admin_token}
        self.webhook_tokens: dict[str, str] = {}  # namespace -> the webhook-token key of that same Secret
        self.secret_forbidden: set[str] = set()  # namespaces whose Secret the caller may not read
        self.fill_marked: set[str] = set()  # namespaces whose Secret carries batchlens.io/fill-tokens
        self.versions: dict[str, int] = {}  # namespace -> its Secret's resourceVersion
        self.patches: list[tuple[str, dict]] = []  # (namespace, body) of every PATCH taken
        self.batch: dict[str, dict] = {}  # pod IP -> its admin API's batch state
        self.namespace_of: dict[str, str] = {}  # pod IP -> the namespace whose token its server takes
        self.authorizations: dict[str, list[str]] = {}  # pod IP -> every Authorization header it received
        self.signers: dict[str, list[str | None]] = {}  # pod IP -> per admin call, the token that signed it, or None
        # (a read with no credential is taken with None, as the plugin takes it)
        self._sites: dict[str, web.TCPSite] = {}
        # Leases and ConfigMaps, (kind, namespace, name) -> the object as stored, with the real API server's
        # semantics: a resourceVersion per write, 409 AlreadyExists on a second create, 409 Conflict on a replace
        # carrying a version that is no longer the object's, 404 NotFound.
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.writes: list[tuple[str, str, dict]] = []  # (verb, kind, body) of every write taken
        self._version = 5000
        self.object_requests = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kube-api", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake API server did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        api = web.Application()
        api.router.add_get("/api/v1/pods", self._list)
        api.router.add_get("/api/v1/namespaces/{namespace}/pods", self._list)
        api.router.add_get("/api/v1/namespaces/{namespace}/secrets/{name}", self._secret)
        api.router.add_patch("/api/v1/namespaces/{namespace}/secrets/{name}", self._patch_secret)
        for prefix in ("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                       "/api/v1/namespaces/{namespace}/configmaps"):  # fmt: skip
            api.router.add_post(prefix, self._create)
            api.router.add_get(prefix + "/{name}", self._get)
            api.router.add_put(prefix + "/{name}", self._replace)
        self._api = web.AppRunner(api, access_log=None, handle_signals=False)
        self._loop.run_until_complete(self._api.setup())
        self._loop.run_until_complete(web.TCPSite(self._api, "127.0.0.1", self.port).start())
        engine = web.Application()
        engine.router.add_get("/metrics", self._metrics)
        engine.router.add_get("/batchlens/v1/batch", self._admin)
        engine.router.add_put("/batchlens/v1/batch", self._admin)
        self._engine = web.AppRunner(engine, access_log=None, handle_signals=False)
        self._loop.run_until_complete(self._engine.setup())
        ready.set()
        self._loop.run_forever()

    def serve_pod(self, ip: str, namespace: str = "serving") -> None:
        """Make ``ip`` (a loopback address) answer as a vLLM pod of ``namespace`` on the pod port."""
        self.namespace_of[ip] = namespace
        self.authorizations[ip] = []
        self.signers[ip] = []

        async def start() -> None:
            site = web.TCPSite(self._engine, ip, self.pod_port)
            await site.start()
            self._sites[ip] = site
            self.batch[ip] = {"max_num_seqs": 64, "max_num_active_seqs": 64, "num_running": 40, "num_waiting": 0}

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)

    async def _list(self, request: web.Request) -> web.Response:
        self.requests.append(str(request.rel_url))
        if self.forbidden:
            return web.json_response(FORBIDDEN, status=403)
        namespace = request.match_info.get("namespace")
        selector, fields = request.query.get("labelSelector", ""), request.query.get("fieldSelector", "")
        items = [
            p
            for p in self.pods
            if (namespace is None or p["metadata"]["namespace"] == namespace) and _matches(p, selector, fields)
        ]
        return web.json_response(
            {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "4712"}, "items": items}
        )

    async def _secret(self, request: web.Request) -> web.Response:
        self.requests.append(str(request.rel_url))
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        if namespace in self.secret_forbidden:
            return web.json_response({**FORBIDDEN, "message": f'secrets "{name}" is forbidden'}, status=403)
        if name != TOKEN_SECRET["name"] or namespace not in self.tokens:
            status = {**FORBIDDEN, "message": f'secrets "{name}" not found', "reason": "NotFound", "code": 404}
            return web.json_response(status, status=404)
        values = {TOKEN_SECRET["key"]: self.tokens[namespace]}  # "": the Secret has no such key
        if namespace in self.webhook_tokens:
            values["webhook-token"] = self.webhook_tokens[namespace]
        data = {key: base64.b64encode(value.encode()).decode() for key, value in values.items() if value}
        meta = {"name": name, "namespace": namespace, "resourceVersion": str(self.versions.get(namespace, 4713))}
        if namespace in self.fill_marked:
            meta["annotations"] = {"batchlens.io/fill-tokens": "true"}
        return web.json_response(
            {"kind": "Secret", "apiVersion": "v1", "metadata": meta, "type": "Opaque", "data": data}
        )

    async def _patch_secret(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        body = await request.json()
        if request.content_type != "application/merge-patch+json":
            return web.json_response({**FORBIDDEN, "code": 415, "reason": "UnsupportedMediaType"}, status=415)
        if body.get("metadata", {}).get("resourceVersion") != str(self.versions.get(namespace, 4713)):
            conflict = {**FORBIDDEN, "code": 409, "reason": "Conflict", "message": "the object has been modified"}
            return web.json_response(conflict, status=409)
        self.patches.append((namespace, body))
        for key, value in body.get("data", {}).items():
            token = base64.b64decode(value).decode()
            if key == TOKEN_SECRET["key"]:
                self.tokens[namespace] = token
            else:
                self.webhook_tokens[namespace] = token
        self.versions[namespace] = self.versions.get(namespace, 4713) + 1
        return await self._secret(request)

    @staticmethod
    def _kind(request: web.Request) -> str:
        return "Lease" if "/leases" in request.path else "ConfigMap"

    def _status(self, code: int, reason: str, message: str) -> web.Response:
        return web.json_response({**FORBIDDEN, "code": code, "reason": reason, "message": message}, status=code)

    def _stored(self, kind: str, body: dict) -> web.Response:
        self._version += 1
        body["metadata"]["resourceVersion"] = str(self._version)
        api = "coordination.k8s.io/v1" if kind == "Lease" else "v1"
        self.objects[(kind, body["metadata"]["namespace"], body["metadata"]["name"])] = {
            **body, "kind": kind, "apiVersion": api}  # fmt: skip
        return web.json_response(self.objects[(kind, body["metadata"]["namespace"], body["metadata"]["name"])])

    async def _create(self, request: web.Request) -> web.Response:
        self.object_requests += 1
        kind, body = self._kind(request), await request.json()
        body["metadata"]["namespace"] = request.match_info["namespace"]
        if (kind, body["metadata"]["namespace"], body["metadata"]["name"]) in self.objects:
            return self._status(409, "AlreadyExists", f'{kind.lower()}s "{body["metadata"]["name"]}" already exists')
        self.writes.append(("create", kind, body))
        return self._stored(kind, body)

    async def _get(self, request: web.Request) -> web.Response:
        self.object_requests += 1
        kind, namespace, name = self._kind(request), request.match_info["namespace"], request.match_info["name"]
        if (found := self.objects.get((kind, namespace, name))) is None:
            return self._status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
        return web.json_response(found)

    async def _replace(self, request: web.Request) -> web.Response:
        self.object_requests += 1
        kind, namespace, name = self._kind(request), request.match_info["namespace"], request.match_info["name"]
        body = await request.json()
        if (found := self.objects.get((kind, namespace, name))) is None:
            return self._status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
        version = body.get("metadata", {}).get("resourceVersion")
        if version and version != found["metadata"]["resourceVersion"]:
            return self._status(409, "Conflict", f'Operation cannot be fulfilled on {kind.lower()}s "{name}": the '
                                "object has been modified; please apply your changes to the latest version and try "
                                "again")  # fmt: skip
        body["metadata"]["namespace"] = namespace
        self.writes.append(("replace", kind, body))
        return self._stored(kind, body)

    @staticmethod
    def _ip(request: web.Request) -> str:
        return request.transport.get_extra_info("sockname")[0]

    async def _admin(self, request: web.Request) -> web.Response:
        ip, auth, body = self._ip(request), request.headers.get("Authorization", ""), await request.read()
        self.authorizations[ip].append(auth)
        token = self.tokens.get(self.namespace_of[ip])
        name = next((p["metadata"]["name"] for p in self.pods if p.get("status", {}).get("podIP") == ip), "")
        pod = PodIdentity(name, self.namespace_of[ip])  # as the plugin knows its own pod, from the downward API
        taken = accepted(token or "", auth, request.method, request.path, body, pod=pod)  # a bare read is taken
        self.signers[ip].append(token if taken and auth else None)
        if not taken:
            return web.json_response({"error": "unauthorized"}, status=401)
        state = self.batch[ip]
        if request.method == "PUT":
            state["max_num_active_seqs"] = json.loads(body)["max_num_active_seqs"]
        return web.json_response(state)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.authorizations[self._ip(request)].append(request.headers.get("Authorization", ""))
        return web.Response(text=CAPTURE.read_text(), content_type="text/plain")

    def close(self) -> None:
        async def stop() -> None:
            await self._engine.cleanup()
            await self._api.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
