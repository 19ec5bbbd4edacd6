"""What this vLLM offers the plugin, found by feature, not by version. Refusing is safe; guessing is not.

The plugin reaches into the scheduler, which is not a public API. Two shapes of
it are known to cap admission safely (see docs/compatibility.md for the proof
on each release):

- ``max_num_active_reqs`` (vLLM 0.32 and later): vLLM's own admission limit,
  separate from the runner's slot count. The plugin sets it.
- ``running_cap`` (vLLM 0.10 to 0.31): the scheduler admits while the running
  batch is below ``max_num_running_reqs``, and nothing but ``schedule()`` reads
  that value. The plugin lowers it for the span of each ``schedule()`` call
  (admission.py), never below what already runs, so the end-of-step assert
  holds, nothing is preempted and the runner's buffers keep their startup size.

Any other shape is refused, with a reason that names what is missing. The
check reads the names each method's code uses, from the loaded class or, for a
release that cannot run here, from its source (:meth:`SchedulerShape.of_source`).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import CodeType

ACTIVE_REQS = "max_num_active_reqs"
RUNNING_CAP = "running_cap"
ENDPOINT_PLUGIN = "endpoint plugin"
MIDDLEWARE = "--middleware"
# What a user adds to `vllm serve` where vLLM has no endpoint plugins (before 0.32).
MIDDLEWARE_PATH = "batchlens.vllm_plugin.middleware.AdminMiddleware"

SLOTS = "max_num_running_reqs"  # the runner's slot count, set once from --max-num-seqs
ADMISSION_METHOD = "schedule"


def _names(code: CodeType) -> frozenset[str]:
    """Every attribute or global name a function's code uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return frozenset(names)


@dataclass(frozen=True)
class SchedulerShape:
    """The names each method of a scheduler class uses: all the check needs to know of it."""

    methods: Mapping[str, frozenset[str]]

    @classmethod
    def of_class(cls, scheduler_cls: type) -> SchedulerShape:
        methods: dict[str, frozenset[str]] = {}
        for owner in reversed(scheduler_cls.__mro__[:-1]):  # a subclass's method replaces its base's
            for name, attr in vars(owner).items():
                function = attr.fget if isinstance(attr, property) else inspect.unwrap(attr) if callable(attr) else None
                code = getattr(function, "__code__", None)
                if code is not None:
                    methods[name] = _names(code)
                else:
                    methods.pop(name, None)  # a subclass that sets a method's name to something else has none
        return cls(methods)

    @classmethod
    def of_source(cls, source: str, class_name: str = "Scheduler") -> SchedulerShape:
        """The same view from a release's source: for a vLLM that cannot be imported here."""
        tree = ast.parse(source)
        found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
        if not found:
            raise ValueError(f"no class {class_name} in this source")
        methods: dict[str, frozenset[str]] = {}
        for node in found[0].body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                used = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                used |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                methods[node.name] = frozenset(used)
        return cls(methods)

    def uses(self, method: str, name: str) -> bool:
        return name in self.methods.get(method, frozenset())


@dataclass(frozen=True)
class Admission:
    """How the plugin can cap admission on a scheduler: a mechanism, or why there is none."""

    mechanism: str | None
    refusal: str | None = None


def admission(shape: SchedulerShape) -> Admission:
    """The safe mechanism this scheduler shape offers, preferring vLLM's own admission limit."""
    if "get_request_counts" not in shape.methods:
        return Admission(None, "Scheduler has no get_request_counts()")
    if not (shape.uses("__init__", SLOTS) and shape.uses(ADMISSION_METHOD, SLOTS)):
        return Admission(None, f"Scheduler.__init__ and Scheduler.schedule() do not both use {SLOTS}")
    if shape.uses("__init__", ACTIVE_REQS) and shape.uses(ADMISSION_METHOD, ACTIVE_REQS):
        return Admission(ACTIVE_REQS)
    # Lowering the slot count during schedule() is invisible elsewhere only if nothing else reads it.
    readers = sorted(m for m, names in shape.methods.items() if SLOTS in names and m not in ("__init__", "schedule"))
    if readers:
        return Admission(
            None,
            f"Scheduler has no {ACTIVE_REQS}, and {SLOTS} is also read by "
            f"{', '.join(f'Scheduler.{m}' for m in readers)}, so it cannot be lowered for admission alone",
        )
    return Admission(RUNNING_CAP)


UTILITY_CALL = "call_utility_async"  # how the API server runs a method in the engine-core process


def engine_core_refusal(engine_core_cls: type, client_classes: Iterable[type]) -> str | None:
    """Why the utility methods cannot reach the scheduler through this EngineCore and its clients, or None."""
    init = getattr(engine_core_cls, "__init__", None)
    code = getattr(init, "__code__", None)
    if code is None or "scheduler" not in _names(code):
        return "EngineCore.__init__ does not set a scheduler"
    if not any(hasattr(cls, UTILITY_CALL) for cls in client_classes):
        return f"no engine-core client has {UTILITY_CALL}()"
    return None


QUEUED_CAPS = ("max_num_queued_tokens", "max_num_queued_reqs")


def queued_caps_refusal(async_llm_cls: type) -> str | None:
    """Why vLLM's own queued caps cannot be set at runtime on this release, or None.

    The API server's ``check_admission()`` reads them from ``scheduler_config`` on every request (0.29 and
    later), so a new value there is the cap from the next request on.
    """
    code = getattr(getattr(async_llm_cls, "check_admission", None), "__code__", None)
    if code is None:
        return "AsyncLLM has no check_admission() (vLLM's queued caps came in 0.29)"
    missing = [name for name in ("scheduler_config", *QUEUED_CAPS) if name not in _names(code)]
    if missing:
        return f"AsyncLLM.check_admission() does not read {', '.join(missing)}"
    return None


#: What the API server counts, per request, for the plugin's own door on releases without vLLM's caps: each
#: request's state in the output processor, its prompt length, and whether it is still in prefill.
REQUEST_STATE_FIELDS = ("prompt_len", "is_prefilling")
VLLM_DOOR = "vllm"  # vLLM's own queued caps refuse (0.29 and later)
PLUGIN_DOOR = "plugin"  # the plugin's middleware refuses by the same rules (door.py)


def plugin_door_refusal(output_processor_cls: type, request_state_cls: type) -> str | None:
    """Why the plugin cannot count, in the API server, what vLLM's queued caps count; None: it can."""
    code = getattr(getattr(output_processor_cls, "__init__", None), "__code__", None)
    if code is None or "request_states" not in _names(code):
        return "OutputProcessor keeps no request_states"
    used = frozenset().union(*SchedulerShape.of_class(request_state_cls).methods.values())
    missing = [name for name in REQUEST_STATE_FIELDS if name not in used]
    if missing:
        return f"RequestState has no {', '.join(missing)}"
    return None


@dataclass(frozen=True)
class Support:
    """What the plugin can do on the vLLM installed here, and how."""

    vllm_version: str
    mechanism: str | None  # ACTIVE_REQS or RUNNING_CAP; None: refused
    api_route: str  # ENDPOINT_PLUGIN or MIDDLEWARE
    refusal: str | None
    caps_refusal: str | None = "not checked"  # why vLLM's own queued caps cannot be set; None: they can
    #: Who applies the queued caps: VLLM_DOOR, PLUGIN_DOOR (where vLLM has none), or None (the route answers 501).
    door: str | None = None
    door_refusal: str | None = "not checked"  # why neither door can: the 501's reason


def has_endpoint_plugins() -> bool:
    try:
        from vllm.plugins.endpoint_plugins import interface  # noqa: F401
    except ImportError:
        return False
    return True


def check_installed_vllm() -> Support:
    """The running vLLM's version, the admission mechanism and API route it offers, or why it is refused."""
    try:
        from vllm import __version__ as version
    except ImportError:
        return Support("unknown", None, MIDDLEWARE, "vLLM is not importable here")
    route = ENDPOINT_PLUGIN if has_endpoint_plugins() else MIDDLEWARE
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine import core_client
        from vllm.v1.engine.core import EngineCore
    except ImportError as exc:
        return Support(version, None, route, f"vLLM {version} has no {exc.name or 'scheduler or engine core module'}")
    found = admission(SchedulerShape.of_class(Scheduler))
    clients = [c for c in vars(core_client).values() if isinstance(c, type)]
    refusal = found.refusal or engine_core_refusal(EngineCore, clients)
    if refusal is not None:
        return Support(version, None, route, f"vLLM {version}: {refusal}")
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.output_processor import OutputProcessor, RequestState
    except ImportError as exc:
        caps = door_refusal = f"vLLM has no {exc.name or 'async LLM or output processor module'}"
    else:
        caps = queued_caps_refusal(AsyncLLM)
        door_refusal = None if caps is None else plugin_door_refusal(OutputProcessor, RequestState)
    door = VLLM_DOOR if caps is None else PLUGIN_DOOR if door_refusal is None else None
    return Support(
        version, found.mechanism, route, None,
        caps_refusal=None if caps is None else f"vLLM {version}: {caps}",
        door=door,
        door_refusal=None if door else f"vLLM {version}: {caps}; {door_refusal}",
    )  # fmt: skip
