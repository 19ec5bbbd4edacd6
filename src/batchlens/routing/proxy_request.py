"""What the router needs from a LiteLLM proxy request (the ``data`` dict its hooks get). Pure.

The prompt's length, the headers, and the LiteLLM tags, wherever the client put them. Token ids (what
``batchlens load`` and ``replay`` send) are counted exactly; text is counted by the function given, which
in the proxy is LiteLLM's ``token_counter``.
"""

from __future__ import annotations

from typing import Any

from batchlens.queued_caps import PRIORITY_HEADER
from batchlens.routing.trust import Caller

LITELLM_TAGS_HEADER = "x-litellm-tags"


def prompt_tokens(data: dict[str, Any], count_text) -> int | None:
    """The prompt's length in tokens: exact for token ids; else ``count_text`` on the text; None: no prompt."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return max(len(p) for p in prompt)
    if isinstance(prompt, str):
        return count_text(model=data.get("model", ""), text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return max(count_text(model=data.get("model", ""), text=p) for p in prompt)
    messages = data.get("messages")
    if isinstance(messages, list) and messages:
        return count_text(model=data.get("model", ""), messages=messages)
    return None


def headers_of(data: dict[str, Any]) -> dict[str, str]:
    raw = (data.get("proxy_server_request") or {}).get("headers") or {}
    return {str(k).lower(): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def request_tags(data: dict[str, Any], headers: dict[str, str]) -> tuple[str, ...]:
    """The request's LiteLLM tags, wherever the client put them: metadata, the body, or the header."""
    metadata = data.get("metadata") or {}
    found: list[str] = []
    for tags in (metadata.get("tags") if isinstance(metadata, dict) else None, data.get("tags")):
        if isinstance(tags, list):
            found.extend(str(t) for t in tags)
    found.extend(t.strip() for t in headers.get(LITELLM_TAGS_HEADER, "").split(",") if t.strip())
    return tuple(dict.fromkeys(found))


def caller_of(auth: Any, *, metadata_tags: bool = True) -> Caller:
    """Who sent the request, from LiteLLM's ``UserAPIKeyAuth``; read by attribute, so a field a release lacks
    counts as absent (the master key's record has ``user_role`` proxy_admin). ``metadata_tags``: whether tags in a
    personal key's or a team's metadata count (``routing.trust_metadata_tags``)."""
    role = str(getattr(auth, "user_role", None) or "")
    team = getattr(auth, "team_id", None)
    tags: list[str] = []
    # A team key's own metadata is its team admin's to edit (trust.py): only the team's counts then.
    own = None if team else getattr(auth, "metadata", None)
    for metadata in (own, getattr(auth, "team_metadata", None)) if metadata_tags else ():
        if isinstance(metadata, dict) and isinstance(metadata.get("tags"), list):
            tags.extend(str(t) for t in metadata["tags"])
    alias, token = getattr(auth, "key_alias", None), getattr(auth, "token", None)
    return Caller(
        admin=role.rsplit(".", 1)[-1].lower() == "proxy_admin",
        key_alias=str(alias) if alias else None,
        teams=frozenset({str(team)} if team else ()),  # its id: an org admin may rename a team
        tags=frozenset(tags),
        team_key=bool(team),
        key_hash=token if isinstance(token, str) and token else None,  # LiteLLM hashes the key into ``token``
    )


def client_priority(data: dict[str, Any]) -> bool:
    """Whether the client set vLLM's priority itself (``extra_body``, which LiteLLM forwards to the engine)."""
    extra = data.get("extra_body")
    return isinstance(extra, dict) and "priority" in extra


def drop_claims(data: dict[str, Any], tags: set[str], priority: bool) -> None:
    """Take ignored claims out of the request, so that LiteLLM's tag filtering and vLLM never see them."""
    metadata = data.get("metadata")
    for holder in (metadata if isinstance(metadata, dict) else {}, data):
        if isinstance(holder.get("tags"), list):
            holder["tags"] = [t for t in holder["tags"] if str(t) not in tags]
    if priority and isinstance(data.get("extra_body"), dict):
        data["extra_body"] = {k: v for k, v in data["extra_body"].items() if k != "priority"}


def with_door_priority(data: dict[str, Any], priority: int) -> dict[str, Any]:
    """``data`` with the door priority batchlens gives it, over any copy a client sent, in any letter case: every
    request leaves the proxy with exactly one, so none claims critical past the door."""
    sent = data.get("extra_headers")
    kept = {k: v for k, v in sent.items() if str(k).lower() != PRIORITY_HEADER} if isinstance(sent, dict) else {}
    data["extra_headers"] = {**kept, PRIORITY_HEADER: str(priority)}
    return data
