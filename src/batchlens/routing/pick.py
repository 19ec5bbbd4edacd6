"""From the role a request wants to the engines it may go to, with fallbacks. Pure.

A role's engines are its candidates unless every one of them is down or
saturated; then the role's fallbacks are tried in order (``routing.fallbacks``).
No request is ever dropped here: when every role in the chain is out, a
saturated engine of the wanted role still takes it (it queues there), and when
all are down, every engine is offered and the proxy's own retries and
fallbacks decide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchlens.config import Routing
from batchlens.routing.signals import DOWN, SATURATED


@dataclass(frozen=True)
class Route:
    role: str  # the role whose engines were chosen
    engines: tuple[str, ...]
    fallback: str = ""  # why the wanted role was left: down, saturated or no_engine; empty: it was not


def pick(wanted: str, roles: Mapping[str, Sequence[str]], states: Mapping[str, str], rules: Routing) -> Route:
    """``roles`` maps each role to its engines' names; ``states`` each engine to its signal state."""
    why = ""
    for role in (wanted, *rules.fallbacks.get(wanted, ())):
        engines = tuple(roles.get(role, ()))
        usable = tuple(e for e in engines if states.get(e) not in (DOWN, SATURATED))
        if usable:
            return Route(role, usable, why)
        if not why:
            why = _why(engines, states)
    queued = tuple(e for e in roles.get(wanted, ()) if states.get(e) == SATURATED)
    if queued:
        return Route(wanted, queued, why)
    # the wanted role's engines are all down here (a live one was usable or queued above): any role will do
    everything = tuple(dict.fromkeys(e for es in roles.values() for e in es))
    alive = tuple(e for e in everything if states.get(e) != DOWN)
    return Route("any", alive or everything, why)


def _why(engines: Sequence[str], states: Mapping[str, str]) -> str:
    if not engines:
        return "no_engine"
    return SATURATED if any(states.get(e) == SATURATED for e in engines) else DOWN
