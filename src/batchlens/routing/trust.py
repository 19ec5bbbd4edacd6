"""Who may claim what: the interactive class, an engine or role of its choice, vLLM's priority. Pure.

Any holder of a proxy key can send a latency header, a tag or an ``extra_body`` priority. On a shared
proxy that would let every tenant jump every other tenant's queue, so such claims count only from a
trusted caller:

- the proxy's admin (its master key);
- a key by its hash in ``routing.trusted_key_hashes``, a personal key's alias in ``routing.trusted_keys``, or a
  team id in ``routing.trusted_teams``;
- everyone, where ``routing.trust_clients`` says the proxy serves one tenant.

Tags that the proxy's admin set on a key or on its team (LiteLLM's key and team metadata) are config
rules, trusted whoever sends the request. From anyone else, a claim is dropped from the request and
counted. Giving a claim up is always allowed: a header that names a class other than interactive stays.

A team key is the exception: its alias and its own metadata are its team's to edit, since LiteLLM's
``/key/update`` lets a team's admins, and the members they grant it, change them. On a team key they are the
tenant's claims, so neither ``routing.trusted_keys`` nor the key's tags count; its team's id and tags do (a
team's metadata only the proxy's or the organization's admin edits, and its alias an organization's admin
too, so a team is trusted by id). A personal key only the proxy's admin edits, since only it creates keys
(proxy_config.py); but a team's admin can detach a team key from its team, making it personal, and an
organization's admin can edit its teams' metadata, so where tenants are team or organization admins,
``routing.trust_metadata_tags: false`` and no ``trusted_keys``: trust then rests on what no tenant can change,
the master key, key hashes and team ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchlens.config import Routing

#: The prefix of every tag that batchlens routes by (an engine's, a role's, the wanted class's), wherever it
#: appears in a tag: LiteLLM's own markers ("&" required, "!" excluded) and routing prefixes go before it.
BATCHLENS_TAG = "batchlens-"
#: What a claim that was ignored is counted as.
CLAIMS = ("latency_header", "latency_tag", "engine_tag", "priority")


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the proxy authenticated it."""

    admin: bool = False  # the proxy's master key
    key_alias: str | None = None
    teams: frozenset[str] = frozenset()  # the key's team id (an alias may be renamed by its organization's admin)
    tags: frozenset[str] = frozenset()  # the tags the proxy's admin set on the key or its team
    team_key: bool = False  # a team's key: its alias is the team admin's to change, and names it only
    key_hash: str | None = None  # LiteLLM's SHA-256 of the key: what no key edit changes


@dataclass(frozen=True)
class Screened:
    latency_class: str | None  # the latency header's value that stands (None: no header, or one ignored)
    tags: tuple[str, ...]  # the request's tags that stay on it, and that classification reads
    priority: bool  # whether a priority the client set itself may stay
    ignored: tuple[str, ...]  # the claims dropped, each kind once (CLAIMS)


def is_trusted(caller: Caller, rules: Routing) -> bool:
    if rules.trust_clients or caller.admin:
        return True
    trusted_key = not caller.team_key and caller.key_alias in rules.trusted_keys
    hashed = caller.key_hash is not None and caller.key_hash.lower() in rules.trusted_key_hashes
    return trusted_key or hashed or bool(caller.teams & set(rules.trusted_teams))


def screen(
    caller: Caller, rules: Routing, *, latency_class: str | None, tags: tuple[str, ...], priority: bool
) -> Screened:
    """What of a request's own claims stands, given who sent it."""
    if is_trusted(caller, rules):
        return Screened(latency_class, tags, priority, ())
    ignored: list[str] = []
    if latency_class is not None and latency_class.strip().lower() in {c.lower() for c in rules.latency_classes}:
        ignored.append("latency_header")
        latency_class = None
    routing = [t for t in tags if t not in caller.tags and BATCHLENS_TAG in t]
    latency = [t for t in tags if t not in caller.tags and t.lstrip("&!") == rules.latency_tag]
    if latency:
        ignored.append("latency_tag")
    if routing:
        ignored.append("engine_tag")
    if priority:
        ignored.append("priority")
    dropped = {*routing, *latency}
    return Screened(latency_class, tuple(t for t in tags if t not in dropped), False, tuple(ignored))
