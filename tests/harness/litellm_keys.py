"""Named proxy keys without LiteLLM's key database, as a LiteLLM ``custom_auth`` (Postgres cannot run here).

Fake boundary: LiteLLM's key store. The proxy, its tag routing and the batchlens plugin are real; only the
lookup of a key's record (its alias, team, and the tags the proxy's admin set on it) is answered from this
table. LitellmProxy copies this file next to the proxy's config, where LiteLLM imports it from.
"""

import os

from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth

KEYS = {
    os.environ["LITELLM_MASTER_KEY"]: {"user_role": LitellmUserRoles.PROXY_ADMIN},
    "sk-tenant-a": {"key_alias": "tenant-a", "team_id": "team-a"},
    "sk-ops-console": {"key_alias": "ops-console"},
    "sk-kiosk": {"key_alias": "kiosk", "metadata": {"tags": ["interactive"]}},  # the admin marked it interactive
    # A team key that its team's admin renamed to a trusted alias and tagged interactive (LiteLLM's /key/update)
    "sk-team-a-renamed": {"key_alias": "ops-console", "team_id": "team-a", "metadata": {"tags": ["interactive"]}},
}


async def user_api_key_auth(request, api_key: str) -> UserAPIKeyAuth:
    fields = KEYS.get(api_key)
    if fields is None:
        raise ValueError("unknown key")
    return UserAPIKeyAuth(api_key=api_key, **fields)
