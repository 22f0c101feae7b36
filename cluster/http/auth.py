"""Who may call the HTTP edge: the inference keys (each a tenant), the admin key, and the keys file.

:class:`KeyRing` answers, for an ``Authorization`` header, which tenant it names (the per-tenant limits
of ``cluster/http/quotas.py`` count by that name) and whether it is the admin key. Keys are kept only as
SHA-256 digests and compared in constant time; no message, log line or repr here ever holds a key.

The keys file (``server.api_keys_file``): one key per line, ``name:key`` or a bare ``key`` (named
``key-<line>``); blank lines and lines starting with ``#`` are skipped.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cluster.config import ServerConfig
from cluster.http.errors import ApiError

DEFAULT_TENANT = "default"  # the name of the single ``api_key``
MAX_KEYS = 4096  # NOTE: a typo guard (a keys file pointed at a big file); each request checks every key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _bearer(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def load_keys_file(path: str) -> dict[str, str]:
    """The tenants of a keys file, name -> key. Raises ValueError naming the file and line (never the
    key) for a malformed line, a duplicate name or key, no key, or more than MAX_KEYS keys."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"server.api_keys_file {path!r} cannot be read: {e.strerror}") from None
    keys: dict[str, str] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        name, key = (name.strip(), key.strip()) if sep else (f"key-{number}", line)
        if not name or not key or any(c.isspace() for c in key):
            raise ValueError(f"{path}:{number}: expected 'name:key' or 'key' (no spaces in a key)")
        if name in keys:
            raise ValueError(f"{path}:{number}: tenant name {name!r} appears twice")
        if key in keys.values():
            raise ValueError(f"{path}:{number}: this key appears twice (tenant {name!r})")
        keys[name] = key
    if not keys:
        raise ValueError(f"server.api_keys_file {path!r} holds no key")
    if len(keys) > MAX_KEYS:
        raise ValueError(f"server.api_keys_file {path!r} holds {len(keys)} keys; at most {MAX_KEYS}")
    return keys


def read_key_file(path: str, what: str) -> str:
    """A single key stored alone in a file (surrounding whitespace stripped); ValueError naming ``what``."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from None
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{what} {path!r} must hold one key (no spaces)")
    return key


def admin_key(server: ServerConfig) -> str | None:
    """The admin key: ``server.admin_key`` ($PDSERVE_ADMIN_KEY), else ``server.admin_key_file``'s."""
    if server.admin_key:
        return server.admin_key
    return read_key_file(server.admin_key_file, "server.admin_key_file") if server.admin_key_file else None


@dataclass(frozen=True)
class KeyRing:
    """The edge's keys, as digests. ``tenants``: digest -> tenant name (empty: inference is open);
    ``admin``: the admin key's digest (None: the admin routes are off)."""

    tenants: Mapping[bytes, str]
    admin: bytes | None

    @classmethod
    def create(cls, api_keys: Mapping[str, str] | None, admin_key: str | None) -> KeyRing:
        """From tenant name -> key and the admin key; ValueError if two tenants share a key or the admin
        key is also an API key (it would make that tenant an admin)."""
        tenants = {_digest(key): name for name, key in (api_keys or {}).items()}
        if len(tenants) != len(api_keys or {}):
            raise ValueError("two tenants share one API key")
        admin = _digest(admin_key) if admin_key else None
        if admin is not None and admin in tenants:
            raise ValueError("the admin key must differ from every API key")
        return cls(tenants, admin)

    @classmethod
    def from_config(cls, server: ServerConfig) -> KeyRing:
        """The keys of a ``server:`` config: ``api_key`` (one tenant, named ``default``) and the tenants of
        ``api_keys_file``; the admin key ``admin_key`` ($PDSERVE_ADMIN_KEY), else ``admin_key_file``'s.
        ValueError (never naming a key) for a bad file, a clash or a shared key."""
        tenants = load_keys_file(server.api_keys_file) if server.api_keys_file else {}
        if server.api_key is not None:
            if DEFAULT_TENANT in tenants:
                raise ValueError(f"tenant name {DEFAULT_TENANT!r} is taken by the single API key; rename it")
            tenants[DEFAULT_TENANT] = server.api_key
        return cls.create(tenants, admin_key(server))

    @property
    def is_open(self) -> bool:
        return not self.tenants

    def tenant(self, authorization: str, client_host: str | None) -> str:
        """The tenant a request counts against: its key's name, or (no keys configured) its client
        address. Raises ApiError 401 (never naming the key given) for a missing or unknown key."""
        if self.is_open:
            return f"address:{client_host or 'unknown'}"
        found = self._match(_bearer(authorization))
        if found is None:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)")
        return found

    def check_admin(self, authorization: str) -> None:
        """Admin routes: 404 when no admin key is configured (the routes are off), 401 for a missing or
        wrong key, 403 for an inference key (a valid key without the admin right)."""
        if self.admin is None:
            # NOTE: 404, not 403: without an admin key no request can ever succeed here, so the route
            # does not exist on this server (and a scanner learns nothing about which keys exist).
            raise ApiError(
                404,
                "admin routes are off on this server (start it with an admin key: server.admin_key, "
                "$PDSERVE_ADMIN_KEY or --admin-key-file)",
                code="admin_disabled",
            )
        token = _bearer(authorization)
        given = _digest(token) if token is not None else b""
        if hmac.compare_digest(given, self.admin):
            return
        if self._match(token) is not None:
            raise ApiError(403, "this route needs the admin key, not an API key", code="admin_key_required")
        raise ApiError(401, "invalid or missing admin key (send Authorization: Bearer <admin key>)")

    def _match(self, token: str | None) -> str | None:
        """The tenant whose key is ``token``; every stored digest is compared (no early exit)."""
        given = _digest(token) if token is not None else b""
        found: str | None = None
        for digest, name in self.tenants.items():
            if hmac.compare_digest(given, digest):
                found = name
        return found
