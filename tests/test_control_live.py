"""The controller inside `batchlens remediate`, a real process over real HTTP: who owns the limit, and faults.

Fake boundary: `Upstreams` (harness/upstreams.py) plays the engines. Each serves a real vLLM 0.32
exposition and the admin API, and can be told to hang. The law's own choices are tested pure in
test_control_law.py; the controller steering the simulator under load is in test_control_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
import urllib.request
from dataclasses import replace

import aiohttp
import pytest

from batchlens.config import Config
from batchlens.control.admission import Saturated
from batchlens.control.door import DoorState
from batchlens.control.law import State
from batchlens.control.signals import Histogram, Window, read_sample
from batchlens.control.steering import Steering, Tick
from batchlens.control.steering import steer as live_steer
from batchlens.exporter.sampler import SourceError
from batchlens.remediation.admin_client import AdminCallError, AdminClient
from batchlens.remediation.breaker import EngineState
from batchlens.remediation.controller import UNSET, Controller
from batchlens.remediation.service import Remediator
from batchlens.remediation.store import Store
from harness.admin import AdminClient as EngineAdmin
from harness.admin import set_caps
from harness.exporter import one, pick
from harness.procs import free_port
from harness.remediate import RemediateProcess, alert, notification
from harness.simulator import SimulatorProcess
from test_remediate import eventually

pytestmark = pytest.mark.slow
TOKEN = "engine-admin-token"
CONTROL = {"enabled": True, "interval_seconds": 0.2, "timeout_seconds": 0.5, "manual_hold_seconds": 2,
           "start_limit": 16}  # fmt: skip


def engine(upstreams, name: str, exposition: str, limit: int = 64) -> str:
    admin = {"max_num_seqs": 64, "max_num_active_seqs": limit, "num_running": 0, "num_waiting": 0}
    return upstreams.add(name, text=exposition, admin=admin, admin_token=TOKEN)


def limit_of(upstreams, name: str) -> int:
    return upstreams.engines[name].admin["max_num_active_seqs"]


def set_by_hand(url: str, limit: int) -> None:
    body = json.dumps({"max_num_active_seqs": limit}).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    req = urllib.request.Request(url + "/batchlens/v1/batch", data=body, method="PUT", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as reply:
        assert reply.status == 200


def decisions(hook: RemediateProcess, name: str, reason: str) -> float:
    return hook_decisions(hook, name).get(reason, 0.0)


def target(hook: RemediateProcess, name: str) -> float:
    return one(hook.samples(), "batchlens_controller_target_limit", vllm_instance=name)


def hook_with(tmp_path, *engines: tuple[str, str], **control) -> RemediateProcess:
    config = {"engines": [{"name": n, "url": u} for n, u in engines], "control": {**CONTROL, **control}}
    return RemediateProcess(tmp_path, config, env={"BATCHLENS_ADMIN_TOKEN": TOKEN})


def test_a_hand_on_the_knob_pauses_control_and_kill_9_keeps_where_it_was(tmp_path, upstreams, vllm_exposition):
    url = engine(upstreams, "a", vllm_exposition)
    hook = hook_with(tmp_path, ("a", url))
    try:
        eventually(lambda: limit_of(upstreams, "a") == 16, "control starting at its start_limit, 16")
        log = hook.process.log_path.read_text()
        assert "a: the controller uses limits 1..64, starting at 16" in log
        assert "a: limit starts at 16, from the engine's 64 (control.start_limit" in log, log
        set_by_hand(url, 40)
        eventually(lambda: "set by hand" in hook.process.log_path.read_text(), "the log naming the hand")
        assert decisions(hook, "a", "manual_hold") >= 1
        time.sleep(1.0)
        assert limit_of(upstreams, "a") == 40, "the hand's limit stands during the hold"
        eventually(lambda: "steers again from 40" in hook.process.log_path.read_text(), "the hold ending", 5)
        hook.kill9()
        hook.start()
        assert target(hook, "a") == 40, "the restarted hook steers on from its saved state, not from start_limit"
        time.sleep(1.0)
        assert limit_of(upstreams, "a") == 40
        assert decisions(hook, "a", "manual_hold") == 0, "its own limit is not taken for a hand after a restart"
    finally:
        hook.stop()


def test_a_restart_during_a_manual_hold_says_the_hold_still_stands(tmp_path, upstreams, vllm_exposition) -> None:
    url = engine(upstreams, "a", vllm_exposition)
    hook = hook_with(tmp_path, ("a", url), manual_hold_seconds=600)
    try:
        eventually(lambda: limit_of(upstreams, "a") == 16, "control starting at its start_limit, 16")
        set_by_hand(url, 40)
        eventually(lambda: decisions(hook, "a", "manual_hold") >= 1, "the controller seeing the hand")
        hook.kill9()
        hook.start()
        assert "a: a limit set by hand still holds control off for " in hook.process.log_path.read_text()
        time.sleep(1.0)
        assert limit_of(upstreams, "a") == 40
        health = json.loads(urllib.request.urlopen(hook.url + "/healthz", timeout=5).read())["control"]["engines"]
        assert health["a"] == {"limit": 40, "limit_in_force": 40, "manual_hold": True, "cap_manual_hold": False}
    finally:
        hook.stop()


def test_a_hanging_engine_is_held_and_retried_while_the_other_is_steered(tmp_path, upstreams, vllm_exposition):
    ok, stuck = engine(upstreams, "ok", vllm_exposition), engine(upstreams, "stuck", vllm_exposition)
    hook = hook_with(tmp_path, ("ok", ok), ("stuck", stuck))
    try:
        eventually(lambda: limit_of(upstreams, "stuck") == 16, "both engines steered")
        upstreams.engines["stuck"].behavior = "hang"
        eventually(lambda: decisions(hook, "stuck", "no_signal") >= 2, "the hanging engine counted, twice")
        before = sum(v for k, v in hook_decisions(hook, "ok").items() if k != "no_signal")
        time.sleep(1.5)
        after = sum(v for k, v in hook_decisions(hook, "ok").items() if k != "no_signal")
        assert after - before >= 3, "a hanging engine does not hold up the others' ticks (every 0.2 s)"
        samples = hook.samples()
        quick, count = one(samples, "batchlens_controller_tick_seconds_bucket", le="0.25"), one(
            samples, "batchlens_controller_tick_seconds_count")  # fmt: skip
        assert count - quick >= 2, "the hanging engine's ticks took their timeout (0.5 s), and say so"
        assert quick >= after, "the other's were quick"
        assert limit_of(upstreams, "stuck") == 16, "never acted on blind"
        log = hook.process.log_path.read_text()
        assert log.count("stuck: not steered: no answer within 0.5 s") == 1, "logged once, not every tick"
        upstreams.engines["stuck"].behavior = "garbage"
        eventually(lambda: "stuck: not steered: " in log_after(hook, log), "garbage counted as no signal")
        upstreams.engines["stuck"].behavior = "ok"
        eventually(lambda: "stuck: answering again" in hook.process.log_path.read_text(), "the engine back")
        assert hook.health()["status"] == "ok"
    finally:
        hook.stop()


def hook_decisions(hook: RemediateProcess, name: str) -> dict[str, float]:
    found = pick(hook.samples(), "batchlens_controller_decisions_total", vllm_instance=name)
    return {dict(labels)["reason"]: value for labels, value in found.items()}


def log_after(hook: RemediateProcess, earlier: str) -> str:
    return hook.process.log_path.read_text()[len(earlier) :]


def test_the_breaker_is_the_outer_layer_and_dry_run_never_sets(tmp_path, upstreams, vllm_exposition) -> None:
    url = engine(upstreams, "a", vllm_exposition)
    hook = hook_with(tmp_path, ("a", url))
    try:
        eventually(lambda: limit_of(upstreams, "a") == 16, "control at 16")
        hook.post(notification(alert("a")))
        eventually(lambda: limit_of(upstreams, "a") == 8, "the breaker halving the controller's 16")
        eventually(lambda: decisions(hook, "a", "breaker_open") >= 3, "control yielding while the breaker is open")
        assert limit_of(upstreams, "a") == 8
        assert target(hook, "a") == 8
    finally:
        hook.stop()
    dry = engine(upstreams, "dry", vllm_exposition, limit=48)
    (tmp_path / "dry").mkdir()
    hook = hook_with(tmp_path / "dry", ("dry", dry), dry_run=True)
    try:
        eventually(lambda: "(dry run)" in hook.process.log_path.read_text(), "the dry run's decision logged")
        assert target(hook, "dry") == 16
        time.sleep(0.5)
        assert limit_of(upstreams, "dry") == 48, "a dry run never sets a limit"
        health = json.loads(urllib.request.urlopen(hook.url + "/healthz", timeout=5).read())
        assert health["engines"]["dry"]["target_limit"] is None, health  # a dry controller wants nothing in force
        assert health["engines"]["dry"]["applied_limit"] == 48, health  # as found at start: nothing was set
        assert health["control"]["engines"]["dry"]["limit"] == 16, health
    finally:
        hook.stop()
    # The hook's own dry run (remediate --dry-run): the controller's 16 is wanted, said once, never applied.
    (tmp_path / "hook-dry").mkdir()
    config = {"engines": [{"name": "dry", "url": dry}], "control": CONTROL, "breaker": {"dry_run": True}}
    hook = RemediateProcess(tmp_path / "hook-dry", config, env={"BATCHLENS_ADMIN_TOKEN": TOKEN})
    try:
        eventually(lambda: "dry run: would set the batch limit to 16" in hook.process.log_path.read_text(),
                   "the hook's dry run saying what it would set")  # fmt: skip
        time.sleep(0.5)
        health = json.loads(urllib.request.urlopen(hook.url + "/healthz", timeout=5).read())["engines"]["dry"]
        assert (health["target_limit"], health["applied_limit"]) == (16, 48), health  # wanted 16; 48 stands
        assert limit_of(upstreams, "dry") == 48
        assert hook.process.log_path.read_text().count("would set the batch limit to 16") == 1
    finally:
        hook.stop()


def test_the_law_is_told_of_a_door_only_where_batchlens_keeps_one(
    tmp_path, caplog, monkeypatch, upstreams, vllm_exposition
):
    # What the law is told of the door, and what the log says of it, turn on whether batchlens keeps a cap on the
    # engine, not on control.admission alone: a dry run sets none, and an engine whose cap route errs (a release
    # without caps or the plugin's middleware) never sheds a backlog. The hook's own calls over real HTTP: the
    # simulator serves the admission route, an upstream (harness/upstreams.py) answers 404 like a plain vLLM.
    sim = SimulatorProcess(tmp_path)
    engines = {"sim": (sim.url, sim.token), "plain": (engine(upstreams, "plain", vllm_exposition), TOKEN)}

    databases = itertools.count()

    def controller(**control) -> Controller:
        config = Config.model_validate({"engines": [{"name": n, "url": u} for n, (u, _) in engines.items()],
                                        "control": {"enabled": True, "admission": True, **control}})  # fmt: skip
        return Controller(config, Store(tmp_path / f"{next(databases)}.db"), admins={})

    @contextlib.asynccontextmanager
    async def admins(c: Controller):  # the controller's admin clients, on one real HTTP session
        async with aiohttp.ClientSession() as session:
            c._admins = {n: AdminClient(session, u, t) for n, (u, t) in engines.items()}
            yield

    async def admit(c: Controller) -> None:  # one tick's calls on the cap route, as _tick_one makes them
        async with admins(c):
            for name in engines:
                await c._admit(name, None, time.time())

    told: list[bool] = []

    def steer(*args, door: bool, **kwargs) -> Tick:  # the law's own, recording what it is told of the door
        told.append(door)
        return live_steer(*args, door=door, **kwargs)

    monkeypatch.setattr("batchlens.remediation.controller.steer", steer)

    async def ticks(c: Controller, *names: str) -> list[bool]:  # whole ticks: what the law was told of the door
        told.clear()
        async with admins(c):
            for name in names:
                await c._tick_one(name, time.time(), {name: EngineState()})
        await c._http.aclose()
        return list(told)

    before = Steering(State(36, ceiling=40, ceiling_until=99), seen_limit=36)
    grown = Tick(replace(before, law=replace(before.law, limit=37)), "headroom")

    def said(c: Controller, name: str) -> tuple[bool, bool]:
        caplog.clear()
        with caplog.at_level(logging.INFO, "batchlens.control"):
            c._report(name, before, grown, None, 36)
        return c._door_works(name), "no door to shed a backlog" in caplog.text

    try:
        live, dry = controller(), controller(dry_run=True)
        assert said(live, "sim") == (False, True), "its route not called yet"
        assert asyncio.run(ticks(controller(), "sim", "sim", "plain")) == [False, True, False], "asked, then told"
        assert asyncio.run(ticks(controller(dry_run=True), "sim", "sim")) == [False, False]
        asyncio.run(admit(live)), asyncio.run(admit(dry))
        assert said(live, "sim") == (True, False), "the door open for want of figures still counts: it will shed"
        assert said(live, "plain") == (False, True), "a route that errs never sheds"
        assert said(dry, "sim") == (False, True), "a dry run sets no cap"
        live._door("sim", DoorState(cap=4000, seen=True))  # as if batchlens had set it: the engine's None is a hand's
        asyncio.run(admit(live))
        assert said(live, "sim") == (False, True), "a hand opened the door: nothing sheds while its hold lasts"
        live._door("sim", replace(live.states["sim"].door, manual_until=0.0)), asyncio.run(admit(live))
        assert said(live, "sim") == (True, False)
        live._not_steered("sim", "no answer within 1 s")
        assert said(live, "sim") == (False, True), "gone: asked again when it is back"
    finally:
        sim.stop()


def test_the_door_goes_on_from_what_the_store_kept_and_fails_open_when_its_figures_stop(tmp_path, caplog) -> None:
    # Controllers on one store, started and stopped as kill -9 and a restart would, each tick's cap calls over
    # real HTTP to the simulator's admission route. Fault boundaries: the engine's /metrics read
    # (Controller._fetch) fails on cue, and one PUT lands but answers with an error, as a timeout does.
    sim = SimulatorProcess(tmp_path)
    engine = EngineAdmin(sim.url, sim.token)
    config = Config.model_validate(
        {
            "engines": [{"name": "sim", "url": sim.url}],
            "control": {"enabled": True, "admission": True, "manual_hold_seconds": 600},
        }
    )

    def cap() -> int | None:
        return engine.request("GET", "/batchlens/v1/admission")[1]["max_num_queued_tokens"]

    async def run(c: Controller, step) -> None:
        async with aiohttp.ClientSession() as session:
            c._admins = {"sim": AdminClient(session, sim.url, sim.token)}
            await step(c)
        await c._http.aclose()

    def started(at: float) -> Controller:
        return Controller(config, Store(tmp_path / "hook.db"), admins={}, clock=lambda: at)

    def reasons(c: Controller) -> dict[str, int]:
        return {reason: n for (_, reason), n in c.decisions.items() if reason.startswith("admission_")}

    try:
        set_caps(engine, max_num_queued_tokens=3000)  # at launch, or by a batchlens before a kill -9
        first = started(1000)
        asyncio.run(run(first, lambda c: c._admit("sim", None, 1000)))
        assert cap() == 3000 and reasons(first) == {"admission_resumed": 1}, "not lifted on a loaded engine's start"
        assert first.caps["sim"].cap == 3000
        again = started(1030)  # kill -9 and a restart: the store says 3000 is batchlens's own
        assert again.cap_in_force("sim") == 3000
        asyncio.run(run(again, lambda c: c._admit("sim", None, 1030)))
        assert cap() == 3000 and reasons(again) == {"admission_resumed": 1}
        asyncio.run(run(again, lambda c: c._admit("sim", None, 1030 + 61)))  # no estimate in stale_seconds
        assert cap() is None and reasons(again)["admission_no_signal"] == 1, "the door fails open"

        set_caps(engine, max_num_queued_tokens=5000)  # a hand
        asyncio.run(run(again, lambda c: c._admit("sim", None, 1100)))
        assert cap() == 5000 and reasons(again)["admission_manual_hold"] == 1
        with caplog.at_level(logging.WARNING, "batchlens.control"):
            held = started(1110)  # kill -9 during the hand's hold
        assert "a queued-token cap set by hand still holds the door's control off for 590 s" in caplog.text
        asyncio.run(run(held, lambda c: c._admit("sim", None, 1110)))
        assert cap() == 5000 and reasons(held) == {"admission_manual_hold": 1}, "the hold survives the restart"
        assert held.caps["sim"].cap == 5000, "the target exported while a hand holds the cap is that cap, not +Inf"

        async def lands_then_errs(c: Controller) -> None:
            real = c._admins["sim"].set_admission

            async def put(**caps):
                await real(**caps)
                raise AdminCallError("timeout", "no answer within 2 s")

            c._admins["sim"].set_admission = put
            await c._admit("sim", None, 1800)  # the hold is over, nothing to estimate from: the door opens

        asyncio.run(run(held, lands_then_errs))
        assert cap() is None and reasons(held)["admission_error"] == 1
        restarted = started(1801)  # kill -9 just after: the PUT that erred is in the store
        asyncio.run(run(restarted, lambda c: c._admit("sim", None, 1802)))
        assert "admission_manual_hold" not in reasons(restarted), "its own PUT landed before the kill -9: no hand"
        asyncio.run(run(held, lambda c: c._admit("sim", None, 1802)))
        assert reasons(held)["admission_manual_hold"] == 1, "its own PUT landed: no hand"
        assert held.cap_in_force("sim") is None and held.states["sim"].door.manual_until < 1802

        off = Controller(Config.model_validate({**config.model_dump(), "control": {"enabled": True}}),
                         Store(tmp_path / "hook.db"), admins={})  # fmt: skip
        assert off.cap_in_force("sim") is UNSET, "a cap stored with admission on is no reference with it off"
        assert off.wanted("found-later", EngineState(), 0) is None, "an engine discovery found after start"

        set_caps(engine, max_num_queued_tokens=3000)
        blind = started(0)
        blind._door("sim", DoorState(cap=3000, seen=True))  # batchlens's, from a window long gone

        async def metrics_fail(c: Controller) -> None:
            async def fetch(name: str) -> str:
                raise SourceError("too_large", "metrics body over exporter.max_response_bytes")

            c._fetch = fetch
            await c._tick_one("sim", 2000, {"sim": EngineState()})

        blind._engines["sim"].minute = Window(60, 16, 4, 0.5, 800, 0, Histogram(), Histogram(), rejected_per_second=1)
        assert blind.door("sim") is not None
        asyncio.run(run(blind, metrics_fail))
        assert blind.door("sim") is None, "the breaker is not told of a door from a minute that has ended"
        assert cap() is None, "the admin API answers, /metrics does not: the cap still goes once stale"
        assert blind.decisions[("sim", "no_signal")] == 1 and reasons(blind) == {"admission_no_signal": 1}
    finally:
        sim.stop()


@pytest.mark.parametrize("fault", ["engine core", "unforeseen answer", "hanging cap route", "PUT cut off"])
def test_the_door_fails_open_whatever_part_of_the_engine_fails(tmp_path, fault) -> None:
    # A cap batchlens set from figures long gone, on the simulator's admission route over real HTTP. Fault
    # boundaries: the admin batch GET (AdminClient.get), the /metrics read (Controller._fetch) and the cap read
    # (AdminClient.admission) fail or hang on cue.
    sim = SimulatorProcess(tmp_path)
    engine = EngineAdmin(sim.url, sim.token)
    control = {"enabled": True, "admission": True, "timeout_seconds": 0.5}
    config = Config.model_validate({"engines": [{"name": "sim", "url": sim.url}], "control": control})
    c = Controller(config, Store(tmp_path / "hook.db"), admins={}, clock=lambda: 0)
    killed_during_put: list[Controller] = []

    async def tick() -> float:
        async with aiohttp.ClientSession() as session:
            c._admins = {"sim": AdminClient(session, sim.url, sim.token)}
            if fault == "engine core":  # the API server answers, its engine core does not (the plugin's 504)

                async def get():
                    raise AdminCallError("http_504", "the engine core did not answer")

                c._admins["sim"].get = get
            elif fault == "unforeseen answer":

                async def fetch(name: str) -> str:
                    raise RuntimeError("nobody foresaw this")

                c._fetch = fetch
            elif fault == "hanging cap route":

                async def admission():
                    await asyncio.sleep(60)

                c._admins["sim"].admission = admission
            else:  # the PUT that opens the door lands, and its answer never comes
                real = c._admins["sim"].set_admission

                async def put(**caps):
                    await real(**caps)
                    # A kill -9 now, the PUT landed and unanswered: what a restart would find in the store.
                    killed_during_put.append(Controller(config, Store(tmp_path / "hook.db"), admins={}))
                    await asyncio.sleep(60)

                c._admins["sim"].set_admission = put
            started = time.monotonic()
            await c._tick_one("sim", 2000, {"sim": EngineState(applied_limit=64)})
            took = time.monotonic() - started
        await c._http.aclose()
        return took

    try:
        set_caps(engine, max_num_queued_tokens=3000)
        c._door("sim", DoorState(cap=3000, seen=True))
        took = asyncio.run(tick())
        cap = engine.request("GET", "/batchlens/v1/admission")[1]["max_num_queued_tokens"]
        door = {reason: n for (_, reason), n in c.decisions.items() if reason.startswith("admission_")}
        if fault == "hanging cap route":
            assert took < 5 and door == {"admission_error": 1}, "a hanging cap route holds the tick past its timeout"
        elif fault == "PUT cut off":
            assert took < 5 and cap is None and door == {"admission_no_signal": 1, "admission_error": 1}
            assert len(killed_during_put) == 1

            async def next_door_tick(hook: Controller) -> None:
                async with aiohttp.ClientSession() as session:
                    hook._admins = {"sim": AdminClient(session, sim.url, sim.token)}
                    await hook._admit("sim", None, 2002)
                await hook._http.aclose()

            for hook in (c, *killed_during_put):
                asyncio.run(next_door_tick(hook))
                assert ("sim", "admission_manual_hold") not in hook.decisions, "its own PUT, cut off, taken for a hand"
        else:
            assert cap is None, "the cap stayed in force on figures long gone: the door failed shut"
            assert c.decisions[("sim", "no_signal")] == 1 and door == {"admission_no_signal": 1}
    finally:
        sim.stop()


@pytest.mark.parametrize("dry", ["breaker", "control"])
def test_a_dry_run_sets_no_cap_and_says_once_what_it_would(tmp_path, caplog, dry) -> None:
    # breaker.dry_run is remediate --dry-run: the door, which the controller sets itself, must keep to it too.
    # The simulator's admission route over real HTTP; the door's saturated windows are given.
    sim = SimulatorProcess(tmp_path)
    engine = EngineAdmin(sim.url, sim.token)
    data = {"engines": [{"name": "sim", "url": sim.url}], "control": {"enabled": True, "admission": True}}
    data.setdefault(dry, {})["dry_run"] = True
    config = Config.model_validate(data)
    c = Controller(config, Store(tmp_path / "hook.db"), admins={}, clock=lambda: 0)
    c._engines["sim"].saturated.extend(Saturated(at, 2000.0, 8.0) for at in (996.0, 998.0, 1000.0))

    async def door_ticks() -> None:
        async with aiohttp.ClientSession() as session:
            c._admins = {"sim": AdminClient(session, sim.url, sim.token)}
            await c._admit("sim", None, 1000.0)
            # Nothing is set, so the cap in force stays none: the estimate moving 2% is not said again, doubling is.
            c._engines["sim"].saturated.extend(Saturated(1000.5, 2080.0, 8.0) for _ in range(3))
            await c._admit("sim", None, 1001.0)
            c._engines["sim"].saturated.extend(Saturated(1001.5, 4000.0, 8.0) for _ in range(9))
            await c._admit("sim", None, 1002.0)
        await c._http.aclose()

    try:
        with caplog.at_level(logging.INFO, "batchlens.control"):
            asyncio.run(door_ticks())
        assert engine.request("GET", "/batchlens/v1/admission")[1]["max_num_queued_tokens"] is None, "a dry run shed"
        assert c.caps["sim"].cap is not None and caplog.text.count("dry run: would set the queued-token cap") == 2
    finally:
        sim.stop()


def test_a_wall_clock_stepped_back_does_not_stop_the_ticks(tmp_path, upstreams, vllm_exposition) -> None:
    config = Config.model_validate({"engines": [{"name": "a", "url": engine(upstreams, "a", vllm_exposition)}],
                                    "control": {"enabled": True, "interval_seconds": 2}})  # fmt: skip
    c = Controller(config, Store(tmp_path / "hook.db"), admins={})

    async def ticks() -> list[bool]:
        c._engines["a"].due = 1000.0 + 3600  # the last tick was scheduled an hour ahead of where NTP put the clock
        c._admins = {}
        started = []
        c.tick(1000.0, {"a": EngineState()})
        started.append(c._engines["a"].in_flight is not None)
        await c.close()
        return started

    assert asyncio.run(ticks()) == [True]
    # Nor does a window across the step count: its length is negative, and its rates would be a billion times over.
    assert c._remember("a", read_sample(vllm_exposition, 5000.0)) is None  # the first sample: no window yet
    assert c._remember("a", read_sample(vllm_exposition, 5002.0)).seconds == 2.0
    c._engines["a"].saturated.append(Saturated(5002.0, 2000.0))  # the door's, which would count as new from 5002 on
    assert c._remember("a", read_sample(vllm_exposition, 1000.0)) is None, "a window across the clock's step back"
    assert not c._engines["a"].saturated
    assert c._remember("a", read_sample(vllm_exposition, 1002.0)).seconds == 2.0


def test_a_fleets_ticks_are_spread_over_the_interval_and_keep_its_beat(tmp_path) -> None:
    """At 256 engines every tick at once queued the last behind the others for most of an interval, and a tick
    taken when the hook's pass came round to it pushed each later one back (docs/scaling.md)."""
    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:9/e{i}"} for i in range(16)]
    config = Config.model_validate({"engines": engines, "control": {"enabled": True, "interval_seconds": 2}})
    c = Controller(config, Store(tmp_path / "hook.db"), admins={}, clock=lambda: 1000.0)
    assert sorted({e.due for e in c._engines.values()}) == [1000.0 + 0.25 * beat for beat in range(8)]
    assert c.next_due() == 1000.0

    async def ticks(now: float) -> None:
        c.tick(now, {})
        for engine in c._engines.values():
            if engine.in_flight is not None:
                engine.in_flight.cancel()
        await asyncio.sleep(0)  # the cancelled ticks done
        c.decisions.clear()

    asyncio.run(ticks(1000.9))  # late: the first four beats' engines
    taken = sorted(e.due for e in c._engines.values())[8:]
    assert taken == [1002.0] * 2 + [1002.25] * 2 + [1002.5] * 2 + [1002.75] * 2, "each on its beat, not 1002.9"
    assert c.next_due() == 1001.0  # the beats not yet taken
    c._engines["e0"].due = 990.0  # a whole interval late: from now, not a burst of catching up
    asyncio.run(ticks(1002.0))
    assert c._engines["e0"].due == 1004.0


def test_the_breaker_keeps_the_doors_figures_when_the_admin_api_times_out_under_the_overload(tmp_path) -> None:
    # The admin route lives on the same overloaded API server as the generation routes, and can time out under
    # the load the door holds; the door's figures are the controller's own readings, and a hold must stay a hold.
    # Real HTTP to a port nobody listens on stands in for the admin API that does not answer.
    url = f"http://127.0.0.1:{free_port()}"
    config = Config.model_validate({"engines": [{"name": "e", "url": url}],
                                    "control": {"enabled": True, "admission": True}})  # fmt: skip

    async def observe():
        async with aiohttp.ClientSession() as session:
            service = Remediator(config, Store(tmp_path / "hook.db"), session, {"BATCHLENS_ADMIN_TOKEN": TOKEN})
            service.states["e"] = EngineState(applied_limit=32, capacity=64)
            service.controller.states["e"] = Steering(door=DoorState(cap=3000, seen=True))
            service.controller._engines["e"].minute = Window(
                60, 32, 0, 0.5, 800, 0, Histogram(((0.1, 9.0), (math.inf, 10.0)), 0.3),
                Histogram(((0.05, 100.0), (math.inf, 100.0)), 3.0), rejected_per_second=2,
                finished_per_second=8)  # fmt: skip
            obs = await service._observe("e")
            await service.controller.close()
            return obs

    obs = asyncio.run(observe())
    assert obs is not None and obs.door is not None and obs.door.queue_bound(obs.waiting)


def test_while_the_breaker_recovers_the_controller_steers_under_its_ceiling(
    tmp_path, monkeypatch, upstreams, vllm_exposition
) -> None:
    """Issue 58, item 7: the demo logged `raise: recovery: -> 38` while the limit stayed at 27, and the controller
    counted `breaker_open` all through the recovery: the controller held at the breaker's cut until it closed.
    The engine is an upstream (harness/upstreams.py) over real HTTP; the law is the real one, watched."""
    url = engine(upstreams, "a", vllm_exposition, limit=27)
    config = Config.model_validate({"engines": [{"name": "a", "url": url}], "control": {"enabled": True}})
    told: list[bool] = []

    def steer(*args, breaker_open: bool, **kwargs) -> Tick:
        told.append(breaker_open)
        return live_steer(*args, breaker_open=breaker_open, **kwargs)

    monkeypatch.setattr("batchlens.remediation.controller.steer", steer)
    c = Controller(config, Store(tmp_path / "hook.db"), admins={})

    async def tick(breaker: EngineState) -> None:
        async with aiohttp.ClientSession() as session:
            c._admins = {"a": AdminClient(session, url, TOKEN)}
            await c._tick_one("a", time.time(), {"a": breaker})
        await c._http.aclose()

    breakers = {mode: EngineState(mode=mode, target_limit=limit, applied_limit=27)
                for mode, limit in (("tripped", 27), ("cold_start", 1), ("recovering", 38))}  # fmt: skip
    for breaker in breakers.values():
        asyncio.run(tick(breaker))
    assert told == [True, True, False], "the law is held only while the breaker is tripped or in cold start"
    grown = replace(c.states["a"], law=replace(c.states["a"].law, limit=45))
    c.states["a"] = grown
    assert c.wanted("a", breakers["recovering"], time.time()) == 38, "the breaker's limit is its ceiling"
    assert c.wanted("a", breakers["tripped"], time.time()) == 27
    assert c.wanted("a", EngineState(), time.time()) == 45


def test_the_hook_says_once_which_api_servers_lack_the_caps_and_a_deployment_numbers_them_over_its_servers(
    tmp_path, caplog
) -> None:
    """The admin API's answer is the boundary here (a stand-in): a real vLLM cannot be started with one API server
    process of N without the plugin. What the plugin answers then is tests/test_siblings.py's."""
    from batchlens.admin_api import AdmissionState
    from batchlens.remediation.admin_client import _one_door

    door = AdmissionState(num_queued_tokens=10, num_unfinished_reqs=1, api_servers=4, api_servers_behind=[3])

    class Answers:
        def __init__(self) -> None:
            self.behind = [3]

        async def admission(self) -> AdmissionState:
            return door.model_copy(update={"api_servers_behind": self.behind})

    config = Config.model_validate({"engines": [{"name": "dp8", "url": "http://127.0.0.1:9"}],
                                    "control": {"enabled": True, "admission": True}})  # fmt: skip
    controller = Controller(config, Store(tmp_path / "s.db"), admins={"dp8": Answers()})
    answers = controller._admins["dp8"]

    async def ticks(n: int) -> None:
        for _ in range(n):
            await controller._door_tick("dp8", None, time.time())

    with caplog.at_level(logging.WARNING, "batchlens"):
        asyncio.run(ticks(3))
        answers.behind = []
        asyncio.run(ticks(1))
        answers.behind = [3]
        asyncio.run(ticks(1))
    said = [r.getMessage() for r in caplog.records if "do not have the door's caps" in r.getMessage()]
    assert len(said) == 2 and "[3] of 4" in said[0] and "VLLM_PLUGINS=batchlens" in said[0], said
    # Two servers of one deployment, each with its API servers: one door, the second's numbered after the first's.
    both = _one_door([door.model_copy(update={"max_num_queued_tokens": 500}),
                      door.model_copy(update={"max_num_queued_tokens": 700, "api_servers_behind": [0]})])  # fmt: skip
    assert (both.max_num_queued_tokens, both.num_queued_tokens, both.api_servers) == (1200, 20, 8)
    assert both.api_servers_behind == [3, 4]


def test_with_admission_predict_the_controller_puts_the_per_request_door_in_front_of_a_wider_cap(
    tmp_path, caplog
) -> None:
    # The simulator's admission route over real HTTP; the door's saturated windows are given, as above.
    sim = SimulatorProcess(tmp_path)
    engine = EngineAdmin(sim.url, sim.token)
    caps = {}
    for predict in (False, True):
        control = {"enabled": True, "admission": True, "admission_predict": predict, "admission_predict_margin": 0.25}
        config = Config.model_validate({"engines": [{"name": "sim", "url": sim.url}], "control": control,
                                        "slo": {"ttft_seconds": 2.0}})  # fmt: skip
        c = Controller(config, Store(tmp_path / f"hook-{predict}.db"), admins={}, clock=lambda: 0)
        c._engines["sim"].saturated.extend(Saturated(at, 2000.0, 8.0) for at in (996.0, 998.0, 1000.0))

        async def door_ticks(c=c) -> None:
            async with aiohttp.ClientSession() as session:
                c._admins = {"sim": AdminClient(session, sim.url, sim.token)}
                await c._admit("sim", None, 1000.0)
                await c._admit("sim", None, 1001.0)
            await c._http.aclose()

        try:
            with caplog.at_level(logging.INFO, "batchlens.control"):
                asyncio.run(door_ticks())
            caps[predict] = engine.request("GET", "/batchlens/v1/admission")[1]
        finally:
            if predict:
                sim.stop()
    assert caps[False]["max_predicted_ttft_seconds"] is None
    assert caps[True]["max_predicted_ttft_seconds"] == 2.5  # slo.ttft_seconds x (1 + admission_predict_margin)
    assert caps[True]["max_num_queued_tokens"] == pytest.approx(1.5 * caps[False]["max_num_queued_tokens"], rel=0.01)
    assert caplog.text.count("per-request door on") == 1  # set once, not every tick
    with pytest.raises(ValueError, match=r"admission_predict needs control\.admission"):
        Config.model_validate({"control": {"enabled": True, "admission_predict": True}})
