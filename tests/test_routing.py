"""Routing's pure parts: classification, the cold-path gap, the exporter's signals, the fallbacks, and where a
door's refusal is retried.

No proxy and no server: requests are plain facts, time is given, and the exporter's exposition is rendered
by prometheus_client with the names and labels the exporter uses (tests/test_exporter_* check the exporter
renders them so).
"""

from __future__ import annotations

import asyncio
import copy
import math
import re
import socket

import pytest
import yaml
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from batchlens.artifacts import artifacts
from batchlens.cli import main
from batchlens.config import Config, ConfigError, Engine, Routing, load_config
from batchlens.queued_caps import MESSAGES
from batchlens.routing.classify import Request, classify
from batchlens.routing.door_retry import (
    METADATA_KEY,
    NO_ENGINE,
    OUTCOMES,
    PAST_BUDGET,
    REFUSED_AGAIN,
    SERVED,
    DoorRetry,
    door_of,
    door_refusal,
    retry_after,
)
from batchlens.routing.gaps import ArrivalGaps
from batchlens.routing.llmd import context_range, epp_config
from batchlens.routing.pick import Route, pick
from batchlens.routing.proxy_config import ProxyConfigError, deployment_engines, litellm_config
from batchlens.routing.proxy_request import (
    caller_of,
    client_priority,
    drop_claims,
    headers_of,
    prompt_tokens,
    request_tags,
)
from batchlens.routing.router import Router
from batchlens.routing.signals import DOWN, OK, SATURATED, UNKNOWN, EngineSignal, engine_signals
from batchlens.routing.trust import Caller, is_trusted, screen

RULES = Routing()


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(
    ("tokens", "role"), [(2047, "main"), (2048, "main"), (2049, "long"), (None, "main"), (0, "main")]
)
def test_a_prompt_goes_long_only_over_the_bound(tokens, role) -> None:
    assert classify(Request(tokens), RULES, cold_gap=None).role == role


def test_the_bound_is_the_configured_one() -> None:
    rules = Routing(long_prompt_tokens=512)
    assert classify(Request(513), rules, None).role == "long"
    assert classify(Request(512), rules, None).role == "main"


@pytest.mark.parametrize(
    ("header", "tags", "expected"),
    [
        ("interactive", (), ("interactive", "latency_header")),
        (" Interactive ", (), ("interactive", "latency_header")),  # header values are read loosely
        ("batch", ("interactive",), ("main", "default")),  # the header said otherwise: the tag does not override
        (None, ("interactive",), ("interactive", "latency_tag")),
        (None, ("team-a", "interactive"), ("interactive", "latency_tag")),
        (None, ("team-a",), ("main", "default")),
        (None, (), ("main", "default")),
    ],
)
def test_header_before_tag(header, tags, expected) -> None:
    choice = classify(Request(100, latency_class=header, tags=tags), RULES, None)
    assert (choice.role, choice.reason) == expected


def test_long_wins_over_the_latency_class_and_the_gap() -> None:
    choice = classify(Request(5000, latency_class="interactive", tags=("interactive",), gap=600), RULES, 1.0)
    assert (choice.role, choice.reason) == ("long", "long_prompt")


def test_interactive_wins_over_the_gap() -> None:
    assert classify(Request(10, latency_class="interactive", gap=600), RULES, 1.0).role == "interactive"


def test_a_fixed_cold_gap() -> None:
    gaps = ArrivalGaps(Routing(cold_gap=2.0))
    assert gaps.arrived(100.0) is None  # the first arrival has no gap, and is not cold
    assert gaps.threshold() == 2.0
    assert classify(Request(10, gap=gaps.arrived(101.0)), RULES, gaps.threshold()).role == "main"
    assert classify(Request(10, gap=gaps.arrived(103.0)), RULES, gaps.threshold()).role == "main"  # 2.0 is not over
    choice = classify(Request(10, gap=gaps.arrived(105.5)), RULES, gaps.threshold())
    assert (choice.role, choice.reason) == ("cold", "cold_gap")


def test_an_auto_cold_gap_is_the_p90_of_the_recent_gaps() -> None:
    rules = Routing(cold_gap="auto", cold_gap_min_gaps=20, cold_gap_window=100)
    gaps, now = ArrivalGaps(rules), 0.0
    gaps.arrived(now)
    for i in range(19):
        now += 0.1 * (1 + i % 10)  # gaps 0.1 .. 1.0
        gaps.arrived(now)
    assert gaps.threshold() is None  # 19 gaps: too few to judge, nothing is cold yet
    assert classify(Request(10, gap=30.0), rules, gaps.threshold()).role == "main"
    now += 0.5
    gaps.arrived(now)
    assert gaps.threshold() == pytest.approx(0.9)  # of 0.1 .. 1.0 twice, nine in ten are at most 0.9
    assert classify(Request(10, gap=1.0), rules, gaps.threshold()).role == "cold"
    assert classify(Request(10, gap=0.9), rules, gaps.threshold()).role == "main"
    for _ in range(100):  # the traffic slows: the window forgets the old pace
        now += 5.0
        gaps.arrived(now)
    assert gaps.threshold() == pytest.approx(5.0)
    assert classify(Request(10, gap=1.0), rules, gaps.threshold()).role == "main"


def test_the_auto_cold_gap_is_taken_again_once_per_signal_refresh_not_per_request() -> None:
    rules = Routing(cold_gap="auto", cold_gap_min_gaps=20, cold_gap_window=20, signals_ttl_seconds=1.0)
    gaps, now = ArrivalGaps(rules), 0.0
    gaps.arrived(now)
    for _ in range(20):
        now += 0.01
        gaps.arrived(now)
    assert gaps.threshold() == pytest.approx(0.01)
    for _ in range(20):  # slower arrivals, 0.8 s of them: within one refresh, the quantile taken stands
        now += 0.04
        gaps.arrived(now)
    assert gaps.threshold() == pytest.approx(0.01)
    now += 0.3  # past the refresh: taken again, over the window as it is now
    gaps.arrived(now)
    assert gaps.threshold() == pytest.approx(0.04)


def exposition(engines: dict[str, dict[str, float]]) -> str:
    registry = CollectorRegistry()
    names = {
        "up": ("batchlens_source_up", ("source", "vllm_instance")),
        "fresh": ("batchlens_source_last_success_timestamp_seconds", ("source", "vllm_instance")),
        "limit": ("batchlens_batch_limit", ("vllm_instance", "engine")),
        "running": ("vllm:num_requests_running", ("vllm_instance", "engine")),
        "waiting": ("vllm:num_requests_waiting", ("vllm_instance", "engine")),
        "kv": ("vllm:kv_cache_usage_perc", ("vllm_instance", "engine")),
    }
    gauges = {key: Gauge(name, "", labels, registry=registry) for key, (name, labels) in names.items()}
    for instance, figures in engines.items():
        for key, value in figures.items():
            labels = ("vllm", instance) if key in ("up", "fresh") else (instance, "0")
            gauges[key].labels(*labels).set(value)
    return generate_latest(registry).decode()


NOW = 1_800_000_000.0


def states(engines: dict[str, dict[str, float]], now: float = NOW) -> dict[str, str]:
    return {name: s.state(now, RULES) for name, s in engine_signals(exposition(engines)).items()}


def test_signals_say_ok_saturated_and_down() -> None:
    fresh = {"up": 1, "fresh": NOW - 2, "limit": 8, "kv": 0.2}
    seen = states(
        {
            "idle": {**fresh, "running": 0, "waiting": 0},
            "full": {**fresh, "running": 8, "waiting": 3},
            "full-no-queue": {**fresh, "running": 8, "waiting": 0},
            "kv": {**fresh, "running": 2, "waiting": 0, "kv": 0.95},
            "dead": {"up": 0, "fresh": NOW - 600},
        }
    )
    assert seen == {"idle": OK, "full": SATURATED, "full-no-queue": OK, "kv": SATURATED, "dead": DOWN}


def test_stale_or_missing_signals_are_unknown() -> None:
    seen = states({"old": {"up": 1, "fresh": NOW - 60, "limit": 8, "running": 8, "waiting": 9}})
    assert seen == {"old": UNKNOWN}  # a full queue a minute ago says nothing now
    assert engine_signals("") == {}
    assert EngineSignal().state(NOW, RULES) == UNKNOWN


def test_without_the_admin_api_a_queue_alone_is_saturation() -> None:
    text = exposition({"plain": {"up": 1, "fresh": NOW, "running": 5, "waiting": 1}})
    signal = engine_signals(text)["plain"]
    assert math.isnan(signal.limit) and signal.state(NOW, RULES) == SATURATED


def test_engine_cores_are_summed() -> None:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "", ("vllm_instance", "engine"), registry=registry)
    limit = Gauge("batchlens_batch_limit", "", ("vllm_instance", "engine"), registry=registry)
    for core in "01":
        running.labels("dp", core).set(4)
        limit.labels("dp", core).set(4)
    signal = engine_signals(generate_latest(registry).decode())["dp"]
    assert (signal.running, signal.limit) == (8, 8)


ROLES = {"main": ["m1", "m2"], "interactive": ["i1"], "long": ["l1"], "cold": ["c1"]}


def test_a_role_with_a_usable_engine_keeps_it() -> None:
    route = pick("main", ROLES, {"m1": SATURATED, "m2": OK}, RULES)
    assert (route.role, route.engines, route.fallback) == ("main", ("m2",), "")
    assert pick("long", ROLES, {}, RULES).engines == ("l1",)  # unknown is not a reason to leave


@pytest.mark.parametrize(
    ("wanted", "states", "expected"),
    [
        ("interactive", {"i1": DOWN}, ("main", ("m1", "m2"), DOWN)),
        ("interactive", {"i1": SATURATED, "m1": DOWN}, ("main", ("m2",), SATURATED)),
        ("long", {"l1": DOWN}, ("main", ("m1", "m2"), DOWN)),
        ("main", {"m1": DOWN, "m2": SATURATED}, ("cold", ("c1",), SATURATED)),
        ("cold", {"c1": DOWN}, ("main", ("m1", "m2"), DOWN)),
    ],
)
def test_fallbacks_in_order(wanted, states, expected) -> None:
    route = pick(wanted, ROLES, states, RULES)
    assert (route.role, route.engines, route.fallback) == expected


def test_nothing_is_dropped() -> None:
    every = dict.fromkeys(["m1", "m2", "i1", "l1", "c1"], SATURATED)
    route = pick("interactive", ROLES, every, RULES)
    assert (route.role, route.engines, route.fallback) == ("interactive", ("i1",), SATURATED)  # it queues there
    dead = dict.fromkeys(["m1", "m2", "i1", "l1", "c1"], DOWN)
    route = pick("interactive", ROLES, dead, RULES)
    assert set(route.engines) == {"m1", "m2", "i1", "l1", "c1"} and route.fallback == DOWN  # the proxy retries
    assert route.role == "any"
    only_long = {**dead, "l1": OK}
    assert pick("interactive", ROLES, only_long, RULES) == Route("any", ("l1",), DOWN)


def test_a_role_without_fallbacks_goes_to_any_live_engine() -> None:
    rules = Routing(fallbacks={})
    assert pick("long", ROLES, {"l1": DOWN}, rules) == Route("any", ("m1", "m2", "i1", "c1"), DOWN)
    assert pick("long", ROLES, {"l1": SATURATED}, rules) == Route("long", ("l1",), SATURATED)  # it queues there
    assert pick("long", {"main": ["m1"]}, {"m1": SATURATED}, rules) == Route("any", ("m1",), "no_engine")


def test_a_role_without_engines_falls_back() -> None:
    route = pick("cold", {"main": ["m1"]}, {}, RULES)
    assert (route.role, route.engines, route.fallback) == ("main", ("m1",), "no_engine")


def test_roles_in_the_config() -> None:
    config = load_config(
        overrides={"engines": [{"name": "a", "url": "http://h:1", "role": ["main", "cold"]}, {"url": "http://h:2"}]}
    )
    assert [e.role for e in config.engines] == [("main", "cold"), ("main",)]
    assert config.routing.cold_gap == "auto" and config.routing.long_prompt_tokens == 2048


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"engines": [{"url": "http://h:1", "role": "fast"}]}, "engines.0.role.0: Input should be 'main'"),
        ({"engines": [{"url": "http://h:1", "role": []}]}, "give at least one role"),
        ({"routing": {"fallbacks": {"main": ["cold", "main"]}}}, "role 'main' falls back to itself"),
        ({"routing": {"cold_gap": 0}}, "expected seconds above zero or auto"),
        ({"routing": {"exporter_url": "exporter:9400"}}, "expected an http(s) URL"),
    ],
)
def test_bad_routing_config_is_named(overrides, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides, environ={})


def count_words(model: str = "", text: str | None = None, messages: list | None = None) -> int:
    """A stand-in for LiteLLM's token_counter with the same keywords: one token per word."""
    if messages is not None:
        return sum(len(str(m.get("content", "")).split()) for m in messages)
    return len((text or "").split())


@pytest.mark.parametrize(
    ("data", "tokens"),
    [
        ({"prompt": list(range(2048))}, 2048),  # token ids: exact
        ({"prompt": list(range(2049))}, 2049),
        ({"prompt": [[1, 2], list(range(10))]}, 10),  # a batch of prompts: the longest decides
        ({"prompt": "a b c"}, 3),
        ({"prompt": ["a b", "a b c d"]}, 4),
        ({"messages": [{"role": "user", "content": "a b"}, {"role": "user", "content": "c"}]}, 3),
        ({}, None),
        ({"prompt": []}, None),
    ],
)
def test_prompt_tokens_of_a_proxy_request(data, tokens) -> None:
    assert prompt_tokens(data, count_words) == tokens


def test_token_ids_at_the_bound_classify_exactly() -> None:
    at, over = (prompt_tokens({"prompt": list(range(n))}, count_words) for n in (2048, 2049))
    assert classify(Request(at), RULES, None).role == "main" and classify(Request(over), RULES, None).role == "long"


def test_request_tags_from_metadata_body_and_header() -> None:
    data = {"metadata": {"tags": ["a"]}, "tags": ["b", "a"]}
    assert request_tags(data, {"x-litellm-tags": "c, d,"}) == ("a", "b", "c", "d")
    assert request_tags({"metadata": None, "tags": "not-a-list"}, {}) == ()
    assert headers_of({"proxy_server_request": {"headers": {"X-Batchlens-Latency-Class": "interactive"}}}) == {
        "x-batchlens-latency-class": "interactive"
    }
    assert headers_of({}) == {}


TENANT = Caller(key_alias="tenant-a", teams=frozenset({"team-1"}))
PINS = ("interactive", "&interactive", "batchlens-engine:b", "&batchlens-role:interactive", "!batchlens-engine:a",
        "spend:x")  # fmt: skip


@pytest.mark.parametrize(
    ("caller", "rules", "trusted"),
    [
        (TENANT, RULES, False),  # a key with no say: the default for every key but the master key
        (Caller(admin=True), RULES, True),
        (TENANT, Routing(trusted_keys=["tenant-a"]), True),
        (TENANT, Routing(trusted_teams=["team-1"]), True),
        (TENANT, Routing(trusted_keys=["tenant-b"], trusted_teams=["team-2"]), False),
        (Caller(), Routing(trust_clients=True), True),
        (Caller(key_hash="AB12"), Routing(trusted_key_hashes=["Ab12"]), True),  # hex in either case
        (Caller(key_hash="cd34"), Routing(trusted_key_hashes=["ab12"]), False),
    ],
    ids=[
        "tenant",
        "master key",
        "trusted key",
        "trusted team",
        "another key and team",
        "trust_clients",
        "trusted key hash",
        "another key hash",
    ],
)
def test_only_a_trusted_caller_claims_the_interactive_class_an_engine_or_a_priority(caller, rules, trusted) -> None:
    screened = screen(caller, rules, latency_class="Interactive", tags=PINS, priority=True)
    if trusted:
        assert (screened.latency_class, screened.tags, screened.priority, screened.ignored) == (
            "Interactive",
            PINS,
            True,
            (),
        )
    else:
        assert screened.latency_class is None and screened.tags == ("spend:x",) and not screened.priority
        assert screened.ignored == ("latency_header", "latency_tag", "engine_tag", "priority")
        assert classify(Request(10, screened.latency_class, screened.tags), rules, None).role == "main"


def test_giving_a_claim_up_and_the_admins_own_tags_stand_for_any_key() -> None:
    """A header naming another class is a step down, always allowed; a key the admin tagged is a config rule."""
    batch = screen(TENANT, RULES, latency_class="batch", tags=("interactive",), priority=False)
    assert batch.latency_class == "batch" and batch.ignored == ("latency_tag",)
    tagged = Caller(key_alias="kiosk", tags=frozenset({"interactive", "batchlens-engine:b"}))
    kept = screen(tagged, RULES, latency_class=None, tags=("interactive", "batchlens-engine:b"), priority=False)
    assert kept.tags == ("interactive", "batchlens-engine:b") and kept.ignored == ()
    assert classify(Request(10, None, kept.tags), RULES, None).role == "interactive"


class Auth:
    """LiteLLM's UserAPIKeyAuth as the proxy hands it over (the real type is tested through the proxy)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_the_caller_and_the_claims_are_read_from_the_proxy_request_and_dropped_from_it() -> None:
    auth = Auth(user_role="LitellmUserRoles.INTERNAL_USER", key_alias="kiosk", team_id=None, team_alias=None,
                metadata={"tags": ["interactive"]}, team_metadata={"tags": "not-a-list"})  # fmt: skip
    assert caller_of(auth) == Caller(False, "kiosk", frozenset(), frozenset({"interactive"}))
    # A team key's alias and tags are the team admin's to edit (LiteLLM's /key/update): no trust; its team's are.
    team_key = Auth(key_alias="ops-console", team_id="t1", team_alias="research", metadata={"tags": ["interactive"]},
                    team_metadata={"tags": ["batchlens-role:long"]})  # fmt: skip
    assert caller_of(team_key) == Caller(False, "ops-console", frozenset({"t1"}),
                                         frozenset({"batchlens-role:long"}), team_key=True)  # fmt: skip
    assert not is_trusted(caller_of(team_key), Routing(trusted_keys=["ops-console"], trusted_teams=["research"]))
    # A team key detached by its team's admin is personal, and an org admin edits its teams' metadata: with
    # trust_metadata_tags off, neither a key's tags nor a team's count.
    assert caller_of(auth, metadata_tags=False).tags == caller_of(team_key, metadata_tags=False).tags == frozenset()
    assert caller_of(Auth(user_role="proxy_admin")).admin and not caller_of(object()).admin
    data = {"metadata": {"tags": ["interactive", "spend:x"]}, "tags": ["batchlens-engine:b"],
            "extra_body": {"priority": -10, "top_k": 5}}  # fmt: skip
    assert client_priority(data) and not client_priority({"extra_body": "x"})
    drop_claims(data, {"interactive", "batchlens-engine:b"}, priority=True)
    assert data == {"metadata": {"tags": ["spend:x"]}, "tags": [], "extra_body": {"top_k": 5}}


def routed_config(**routing) -> Config:
    return load_config(
        overrides={
            "routing": {"model": "m", "exporter_url": "http://127.0.0.1:9", **routing},
            "engines": [
                {"name": "a", "url": "http://127.0.0.1:8001", "role": "main", "scheduling_policy": "priority"},
                {"name": "b", "url": "http://127.0.0.1:8002", "role": ["interactive", "cold"],
                 "scheduling_policy": "priority"},
                {"name": "c", "url": "http://127.0.0.1:8003", "role": "long", "max_model_len": 8192},
            ],
        },
        environ={},
    )  # fmt: skip


def test_the_proxy_config_tags_each_engine_and_keeps_a_fallback_group() -> None:
    generated = litellm_config(routed_config())
    routed = [d for d in generated["model_list"] if d["model_name"] == "m"]
    spares = [d for d in generated["model_list"] if d["model_name"] == "m-fallback"]
    assert [d["litellm_params"]["tags"] for d in routed] == [
        ["batchlens-engine:a", "batchlens-role:main"],
        ["batchlens-engine:b", "batchlens-role:interactive", "batchlens-role:cold"],
        ["batchlens-engine:c", "batchlens-role:long"],
    ]
    assert [d["litellm_params"]["api_base"] for d in spares] == [d["litellm_params"]["api_base"] for d in routed]
    assert all(d["litellm_params"]["tags"] == ["default"] for d in spares)
    assert [d["model_info"].get("max_input_tokens") for d in routed] == [None, None, 8192]
    assert generated["router_settings"]["fallbacks"] == [{"m": ["m-fallback"]}]
    assert "batchlens.routing.litellm_proxy.routing" in generated["litellm_settings"]["callbacks"]
    assert generated["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"  # never the key itself


def test_the_proxy_config_states_litellms_router_settings_and_who_reads_its_metrics() -> None:
    """What LiteLLM's router is told, stated by hand: tag filtering for the plugin's pick, the context-window check
    before a call (model_info.max_input_tokens, only where an engine's is known), least-busy within the engines
    picked, one retry and then the fallback group, an engine cooled down for 10 s after a failure."""
    generated = litellm_config(routed_config())
    assert generated["router_settings"] == {
        "enable_tag_filtering": True,
        "enable_pre_call_checks": True,
        "routing_strategy": "least-busy",
        "num_retries": 1,
        "allowed_fails": 1,
        "cooldown_time": 10,
        "fallbacks": [{"m": ["m-fallback"]}],
    }
    assert [d["model_info"] for d in generated["model_list"] if d["model_name"] == "m"] == [
        {"id": "m/a", "batchlens_roles": ["main"]},
        {"id": "m/b", "batchlens_roles": ["interactive", "cold"]},
        {"id": "m/c", "batchlens_roles": ["long"], "max_input_tokens": 8192},
    ]
    assert "require_auth_for_metrics_endpoint" not in generated["litellm_settings"]  # metrics_auth: true by default
    opened = litellm_config(routed_config(metrics_auth=False))["litellm_settings"]
    assert opened["require_auth_for_metrics_endpoint"] is False


def test_a_proxy_config_needs_a_model_and_engines() -> None:
    with pytest.raises(ProxyConfigError, match=r"routing\.model is not set"):
        litellm_config(load_config(overrides={"engines": [{"url": "http://h:1"}]}, environ={}))
    with pytest.raises(ProxyConfigError, match="no engines"):
        litellm_config(load_config(overrides={"routing": {"model": "m"}}, environ={}))


def test_the_router_without_its_exporter_routes_by_role_and_counts_it() -> None:
    registry = CollectorRegistry()
    router = Router(routed_config(), registry=registry)

    async def run() -> list:
        try:
            await router.signals.refresh()  # what the background reader does every signals_ttl_seconds
            return [
                await router.decide(10, "interactive", ()),
                await router.decide(3000, None, ()),
                await router.decide(10, None, ("team",)),
            ]
        finally:
            await router.signals.close()

    interactive, long, main = asyncio.run(run())
    assert (interactive.route.role, interactive.priority) == ("interactive", 0)
    assert interactive.tags == ["batchlens-wanted:interactive", "batchlens-engine:b"]
    assert (long.route.engines, long.priority) == (("c",), None)  # c schedules first come, first served
    assert (main.route.engines, main.priority) == (("a",), 1)
    assert registry.get_sample_value("batchlens_routing_signal_errors_total", {"reason": "connect"}) >= 1
    assert registry.get_sample_value("batchlens_routing_signals_up") == 0
    labels = {"wanted": "long", "reason": "long_prompt", "role": "long", "fallback": ""}
    assert registry.get_sample_value("batchlens_routing_decisions_total", labels) == 1


DOOR_ROLES = {"main": ["a", "b", "c", "d"], "interactive": ["f"], "long": [], "cold": []}
REFUSAL, AGAIN = object(), object()  # the 503s a client would get


def door_retry(**fields) -> DoorRetry:
    return DoorRetry("main", since=100.0, **fields)


def test_a_door_refusal_is_retried_once_on_the_fallback_hop_on_another_engine_of_its_role_with_room() -> None:
    door = door_retry()
    states = {"b": SATURATED, "c": DOWN}  # d unknown: usable, as routing takes it
    everything = {"a", "b", "c", "d", "f"}
    assert door.route(100.1, 0.5, DOOR_ROLES, states, everything, hop=False) is None  # no refusal: as LiteLLM routes
    assert door.failed("a", REFUSAL) == ""
    assert door.route(100.1, 0.5, DOOR_ROLES, states, everything, hop=False) == ()  # its generic retry: nowhere
    assert door.route(100.2, 0.5, DOOR_ROLES, states, everything, hop=True) == ("d",)  # never a, b, c, nor f
    assert door.route(100.2, 0.5, DOOR_ROLES, {}, everything, hop=True) == ()  # once
    assert (door.answered(), door.answered(), door.outcome) == (SERVED, "", SERVED)
    assert door.said() == "the door of main engine a refused a request; retried on d, which served it"


def test_a_retry_refused_again_or_failing_ends_it_with_the_first_503() -> None:
    for failure, outcome in ((AGAIN, REFUSED_AGAIN), (None, "failed")):
        door = door_retry()
        door.failed("a", REFUSAL)
        assert door.route(100.1, 0.5, DOOR_ROLES, {}, {"a", "b"}, hop=True) == ("b",)  # c and d: LiteLLM's cooldown
        assert (door.failed("b", failure), door.failed("b", failure)) == (outcome, "")
        assert door.answer is REFUSAL and door.failed_on == ["a", "b"]
        assert door.route(100.2, 0.5, DOOR_ROLES, {}, {"a", "b", "c"}, hop=True) == ()
        assert door.answered() == "" and door.outcome == outcome


@pytest.mark.parametrize(("now", "expected"), [(100.49, ("b",)), (100.5, ()), (101.0, ())])
def test_no_retry_past_the_ttft_budget(now, expected) -> None:
    door = door_retry()
    door.failed("a", REFUSAL)
    assert door.route(now, 0.5, DOOR_ROLES, {}, {"a", "b"}, hop=True) == expected
    assert door.outcome == ("" if expected else PAST_BUDGET)


@pytest.mark.parametrize("states", [{"b": SATURATED, "c": DOWN, "d": SATURATED}, {"b": DOWN, "c": DOWN, "d": DOWN}])
def test_no_retry_without_another_engine_of_the_role_with_room(states) -> None:
    door = door_retry()
    door.failed("a", REFUSAL)
    assert door.route(100.1, 0.5, DOOR_ROLES, states, {"a", "b", "c", "d", "f"}, hop=True) == ()
    assert door.outcome == NO_ENGINE
    assert "not retried: no other main engine had room" in door.said()
    alone = DoorRetry("interactive", since=100.0)  # the only engine of its role: not the main ones beside it
    alone.failed("f", REFUSAL)
    assert alone.route(100.1, 0.5, DOOR_ROLES, {}, {"a", "b", "c", "d", "f"}, hop=True) == ()
    assert alone.outcome == NO_ENGINE


def test_an_engine_that_failed_otherwise_is_left_as_litellm_routes_and_never_retried_on() -> None:
    door = door_retry()
    assert door.failed("a", None) == ""  # down: LiteLLM's retry and its fallback group, as before
    assert door.route(100.1, 0.5, DOOR_ROLES, {}, {"a", "b", "c"}, hop=False) is None
    assert door.failed("b", REFUSAL) == ""  # its retry found a door
    assert door.route(100.2, 0.5, DOOR_ROLES, {}, {"a", "b", "c"}, hop=True) == ("c",)
    assert (door.refused_by, door.answer) == ("b", REFUSAL)


def test_the_record_is_the_plugins_alone_and_every_copy_of_the_metadata_shares_it() -> None:
    door = door_retry()
    metadata = {"tags": [], METADATA_KEY: door}
    for kwargs in ({"metadata": metadata}, {"metadata": dict(metadata)}, {"metadata": copy.deepcopy(metadata)}):
        assert door_of(kwargs) is door
    client = {"metadata": {METADATA_KEY: {"role": "interactive", "answer": "x", "since": 0}}}
    assert door_of(client) is door_of({}) is door_of(None) is door_of({"metadata": "x"}) is None


class LitellmError(Exception):  # the attributes LiteLLM's errors carry that the plugin reads
    def __init__(self, status_code: int | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status_code, self.message, self.litellm_response_headers = status_code, message, headers


@pytest.mark.parametrize("reason", sorted(MESSAGES))
def test_every_door_reason_is_a_refusal_and_its_retry_after_is_read(reason) -> None:
    body = f"OpenAIException - Error code: 503 - {{'error': {{'message': '{MESSAGES[reason]}', 'code': 503}}}}"
    assert door_refusal(LitellmError(503, body, {"Retry-After": "7"}))
    assert retry_after(LitellmError(503, body, {"retry-after": "7"})) == "7"
    assert retry_after(LitellmError(503, body)) is None


def test_other_errors_are_not_door_refusals() -> None:
    assert not door_refusal(LitellmError(503, "Error code: 503 - {'error': 'the server is shutting down'}"))
    assert not door_refusal(LitellmError(None, "APIConnectionError: Connection refused"))
    assert not door_refusal(LitellmError(500, MESSAGES["max_num_queued_reqs"]))


def test_the_door_retries_are_counted_per_role_and_outcome_from_the_start() -> None:
    registry = CollectorRegistry()
    Router(routed_config(), registry=registry)
    for role in ("main", "interactive", "long", "cold"):
        for outcome in OUTCOMES:
            labels = {"role": role, "outcome": outcome}
            assert registry.get_sample_value("batchlens_routing_door_retries_total", labels) == 0


def test_each_deployment_maps_to_its_engine_in_both_groups() -> None:
    config = routed_config()
    ids = {d["model_info"]["id"] for d in litellm_config(config)["model_list"]}
    assert deployment_engines(config.routing.model, config.engines) == {i: i.rsplit("/", 1)[1] for i in ids}


def test_build_writes_the_router_configs_and_check_keeps_them_fresh(tmp_path) -> None:
    config = tmp_path / "batchlens.yaml"
    config.write_text(yaml.safe_dump({
        "routing": {"model": "m"},
        "engines": [{"name": "main", "url": "http://10.0.0.1:8000"},
                    {"name": "fast", "url": "http://10.0.0.2:8000", "role": ["interactive", "cold"]},
                    {"name": "long", "url": "http://10.0.0.3:8000", "role": "long", "max_model_len": 32768}],
    }))  # fmt: skip
    root = tmp_path / "out"
    built = run_cli("build", "--config", str(config), "--root", str(root))
    assert built.exit_code == 0, built.output
    proxy = yaml.safe_load((root / "routing" / "litellm-config.yaml").read_text())
    # What LiteLLM must be told for this config, stated by hand: one deployment per engine under the model's
    # name with its tags and context window, the same engines again as the fallback group, tag routing on.
    deployed = [(d["model_name"], d["litellm_params"]["api_base"], d["litellm_params"]["tags"],
                 d["model_info"].get("max_input_tokens")) for d in proxy["model_list"]]  # fmt: skip
    assert deployed == [
        ("m", "http://10.0.0.1:8000/v1", ["batchlens-engine:main", "batchlens-role:main"], None),
        ("m", "http://10.0.0.2:8000/v1", ["batchlens-engine:fast", "batchlens-role:interactive",
                                          "batchlens-role:cold"], None),
        ("m", "http://10.0.0.3:8000/v1", ["batchlens-engine:long", "batchlens-role:long"], 32768),
        ("m-fallback", "http://10.0.0.1:8000/v1", ["default"], None),
        ("m-fallback", "http://10.0.0.2:8000/v1", ["default"], None),
        ("m-fallback", "http://10.0.0.3:8000/v1", ["default"], 32768),
    ]  # fmt: skip
    assert all(d["litellm_params"]["model"] == "hosted_vllm/m" for d in proxy["model_list"])
    assert proxy["router_settings"]["enable_tag_filtering"] is True
    assert proxy["router_settings"]["fallbacks"] == [{"m": ["m-fallback"]}]
    assert proxy["litellm_settings"]["callbacks"] == ["prometheus", "batchlens.routing.litellm_proxy.routing"]
    # Key aliases and key metadata are trust: nobody but the proxy's admin creates keys (LiteLLM lets every user)
    assert proxy["litellm_settings"]["key_generation_settings"] == {
        "personal_key_generation": {"allowed_user_roles": ["proxy_admin"]},
        "team_key_generation": {"allowed_team_member_roles": []},
    }
    assert proxy["general_settings"] == {"master_key": "os.environ/LITELLM_MASTER_KEY"}  # metrics_auth: true
    epp_text = (root / "routing" / "llm-d-epp.yaml").read_text()
    assert '#   long: llm-d.ai/context-length-range: "2049-32768"' in epp_text
    assert '#   fast: llm-d.ai/context-length-range: "0-2048"' in epp_text
    assert run_cli("build", "--config", str(config), "--root", str(root), "--check").exit_code == 0
    (root / "routing" / "litellm-config.yaml").write_text("stale\n")
    stale = run_cli("build", "--config", str(config), "--root", str(root), "--check")
    assert stale.exit_code != 0 and "routing/litellm-config.yaml" in stale.output
    # Without routing.model nothing is written for a router: the default build is unchanged.
    assert not any("routing/" in name for name in artifacts(load_config(None, {}, {})))


def test_the_llm_d_config_has_the_shape_the_endpoint_picker_reads() -> None:
    """Shape only (no endpoint picker runs here): its header, every profile's plugin defined once, a picker."""
    epp = epp_config(routed_config())
    assert (epp["apiVersion"], epp["kind"]) == ("inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")
    types = [p["type"] for p in epp["plugins"]]
    assert len(types) == len(set(types))
    for profile in epp["schedulingProfiles"]:
        refs = [p["pluginRef"] for p in profile["plugins"]]
        assert set(refs) <= set(types) and refs[-1] == "max-score-picker"
        assert all(isinstance(p.get("weight", 1), int | float) and p.get("weight", 1) > 0 for p in profile["plugins"])
    aware = next(p for p in epp["plugins"] if p["type"] == "context-length-aware")
    assert aware["parameters"] == {"label": "llm-d.ai/context-length-range", "enableFiltering": True}


@pytest.mark.parametrize(
    ("role", "max_model_len", "expected"),
    [(["main"], None, "0-2048"), (["long"], None, "2049-131072"), (["long"], 8192, "2049-8192"),
     (["main", "long"], 8192, "0-8192"), (["interactive", "cold"], 4096, "0-2048")],
)  # fmt: skip
def test_context_ranges_split_at_the_long_bound(role, max_model_len, expected) -> None:
    engine = Engine(url="http://h:1", role=role, max_model_len=max_model_len)
    assert context_range(engine, 2048) == expected


def test_a_request_never_waits_on_a_hanging_exporter() -> None:
    """The exporter accepts and never answers: decisions come at once, from what is known (nothing: by role)."""
    with socket.socket() as hanging:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen()
        port = hanging.getsockname()[1]
        router = Router(routed_config(exporter_url=f"http://127.0.0.1:{port}", signals_timeout_seconds=2),
                        registry=CollectorRegistry())  # fmt: skip

        async def run():
            try:
                # Well within the 2 s a read may take: a decision that waited for it would not be back.
                return [await asyncio.wait_for(router.decide(10, None, ()), timeout=1.0) for _ in range(3)]
            finally:
                await router.signals.close()

        decisions = asyncio.run(run())
    assert [d.route.engines for d in decisions] == [("a",)] * 3
