"""Bearer API keys with scopes ``rollout`` (sessions, /generate), ``trainer`` (batches),
``admin`` (weights, replicas) and ``replica`` (a sidecar's heartbeats, nothing else).

Keys come from ``MIXFLEET_API_KEYS`` (a JSON object ``{"<token>": ["rollout", ...]}``) or a file
holding the same JSON. Tokens are compared in constant time against every configured key.
Without a key a request gets 401, with a key lacking the scope 403.
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from core.errors import UserError
from router.config import SCOPES

ENV_VAR = "MIXFLEET_API_KEYS"
BEARER_DOC = "API key; scopes rollout, trainer, admin, replica"
_bearer = HTTPBearer(auto_error=False, description=BEARER_DOC)


def parse_keys(text: str, where: str) -> dict[str, frozenset[str]]:
    """Parse the JSON key map. Raises :class:`UserError` naming ``where`` and the problem."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise UserError(f'{where}: expected a non-empty JSON object {{"<token>": ["rollout", ...]}}')
    keys: dict[str, frozenset[str]] = {}
    for token, scopes in data.items():
        if not isinstance(token, str) or len(token) < 16:
            raise UserError(f"{where}: every token must be a string of at least 16 characters")
        if isinstance(scopes, str):
            scopes = [scopes]
        if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
            raise UserError(f"{where}: scopes of ...{token[-4:]} must be a list of strings")
        bad = sorted(set(scopes) - set(SCOPES))
        if bad:
            raise UserError(f"{where}: unknown scope(s) {bad} (known: {', '.join(SCOPES)})")
        keys[token] = frozenset(scopes)
    return keys


def load_keys(file: str | Path | None = None) -> dict[str, frozenset[str]]:
    """Keys from ``file`` if given, else from ``$MIXFLEET_API_KEYS``; empty dict if neither."""
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise UserError(f"API key file not found: {path}")
        return parse_keys(path.read_text(), str(path))
    text = os.environ.get(ENV_VAR)
    if text is None or not text.strip():
        return {}
    return parse_keys(text, ENV_VAR)


def scopes_for(token: str, keys: dict[str, frozenset[str]]) -> frozenset[str] | None:
    """The scopes of ``token``; compares against every key in constant time per key."""
    found: frozenset[str] | None = None
    given = token.encode()
    for candidate, scopes in keys.items():
        if hmac.compare_digest(given, candidate.encode()):
            found = scopes
    return found


def require(*scopes: str):
    """A FastAPI dependency that admits requests whose key carries any of ``scopes``
    (``"any"``: any valid key); every request when auth is disabled."""
    if not scopes or any(s not in SCOPES and s != "any" for s in scopes):
        raise ValueError(scopes)
    wanted = frozenset(scopes)

    async def check(
        request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> None:
        config = request.app.state.ctx.config
        if config.auth_disabled:
            return
        if creds is None or not creds.credentials:
            raise HTTPException(
                401, "missing API key (Authorization: Bearer <key>)", headers={"WWW-Authenticate": "Bearer"}
            )
        have = scopes_for(creds.credentials, config.api_keys)
        if have is None:
            raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        if "any" not in wanted and not wanted & have:
            raise HTTPException(403, f"API key lacks the {' or '.join(repr(x) for x in scopes)} scope")

    return check
