"""Which vLLM versions and internals the plugin knows. Refusing is safe; guessing is not.

The plugin reaches into the scheduler, which is not a public API: a release
that renames ``max_num_active_reqs`` or stops reading it at admission would
make a PUT silently do nothing. So the plugin installs itself only where both
the version and the code it relies on are as it expects.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import CodeType

SUPPORTED_VERSIONS = ("0.32",)  # major.minor series the plugin was tested against


def version_supported(version: str) -> bool:
    parts = version.split(".")
    return len(parts) >= 2 and ".".join(parts[:2]) in SUPPORTED_VERSIONS


def _names(code: CodeType) -> set[str]:
    """Every attribute or global name a function's code uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def missing_internals(scheduler_cls: type, engine_core_cls: type) -> list[str]:
    """What the plugin relies on that these classes lack; empty when all is there."""
    wanted: Iterable[tuple[str, object, str]] = (
        (
            "Scheduler.__init__ sets max_num_active_reqs",
            getattr(scheduler_cls, "__init__", None),
            "max_num_active_reqs",
        ),
        (
            "Scheduler.__init__ sets max_num_running_reqs",
            getattr(scheduler_cls, "__init__", None),
            "max_num_running_reqs",
        ),
        (
            "Scheduler.schedule admits by max_num_active_reqs",
            getattr(scheduler_cls, "schedule", None),
            "max_num_active_reqs",
        ),
        ("Scheduler.get_request_counts", scheduler_cls, "get_request_counts"),
        ("EngineCore.__init__ sets scheduler", getattr(engine_core_cls, "__init__", None), "scheduler"),
    )
    missing = []
    for what, owner, name in wanted:
        if isinstance(owner, type):
            present = hasattr(owner, name)
        else:
            code = getattr(owner, "__code__", None)
            present = code is not None and name in _names(code)
        if not present:
            missing.append(what)
    return missing


def refusal(version: str, scheduler_cls: type, engine_core_cls: type) -> str | None:
    """Why the plugin must not install itself on this vLLM, or None when it may."""
    supported = ", ".join(f"{v}.x" for v in SUPPORTED_VERSIONS)
    if not version_supported(version):
        return f"vLLM {version} is not supported (supported: {supported})"
    missing = missing_internals(scheduler_cls, engine_core_cls)
    if missing:
        return f"vLLM {version} lacks what the plugin relies on: {'; '.join(missing)} (supported: {supported})"
    return None


def check_installed_vllm() -> tuple[str, str | None]:
    """The running vLLM's version, and why the plugin must not install itself on it (None: it may)."""
    try:
        from vllm import __version__ as version
    except ImportError:
        return "unknown", "vLLM is not importable here"
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
    except ImportError as exc:
        return version, f"vLLM {version} has no {exc.name or 'scheduler or engine core module'}"
    return version, refusal(version, Scheduler, EngineCore)
