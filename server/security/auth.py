"""Who a client is: tokens -> tenant and role, and the key scoping that isolates tenants.

The tokens file (``--auth-tokens``, TOML) lists credentials and, optionally,
per-tenant quotas; SIGHUP reloads it (a file that fails to parse keeps the
previous table and logs why)::

    [[token]]
    token = "s3cr3t-acme-writer"   # or sha256 = "<hex sha256 of the token>"
    tenant = "acme"
    role = "write"                 # read | write | admin

    [tenant.acme]
    dram_quota = "4GiB"            # bytes of DRAM this tenant's chunks may hold
    ssd_quota = "64GiB"            # and of the SSD tier

No file: open mode (every client is an anonymous admin, keys are stored as
sent, the node warns at start-up). With a file, every data connection must
present a known token in HELLO and every admin route but the probes needs a
bearer token.

Isolation is by construction: a tenant's key ``k`` is stored under
``k[:8] || blake2b(k, key=tenant)[:8]``. The first 8 bytes (the ring
position) are kept, so placement and hand-off are unchanged; the rest is a
keyed hash, so no key another tenant can send maps to it (that takes a
2^64 second preimage). Reads, lookups, pins, deletes and TTLs all go through
the same mapping, so a tenant cannot even time another tenant's chunks. The
``shared`` scope is the same mapping under a tenant name no token can have.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.protocol.errors import ConfigError, PermissionDeniedError
from kvpool.protocol.frames import OP_FLAG_RAW, OP_FLAG_SHARED, SCOPE_FLAGS, Op
from kvpool.protocol.parsers import Scoper

__all__ = [
    "ANONYMOUS",
    "Principal",
    "Role",
    "TenantQuota",
    "TokenTable",
    "check",
    "load_tokens",
    "scope_key",
    "scoper_for",
    "stored_keys",
]

log = logging.getLogger("kvpool.server")

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_PERSON = b"kvpool.scope.v1"  # blake2b personalisation: these hashes mean nothing else
#: the scope name of the shared scope (not a valid tenant name, so no token can own it)
SHARED_SCOPE = ""


class Role(enum.IntEnum):
    READ = 1
    WRITE = 2
    ADMIN = 3


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. ``tenant`` None: open mode (keys are stored as sent)."""

    tenant: str | None
    role: Role
    name: str = ""  #: for logs: "tenant/role"

    @property
    def quota_tenant(self) -> str | None:
        """Whose quotas this caller's writes count against (admins: no one's)."""
        return None if self.role == Role.ADMIN else self.tenant

    def __str__(self) -> str:
        return self.name or ("anonymous" if self.tenant is None else f"{self.tenant}/"
                             f"{self.role.name.lower()}")


ANONYMOUS = Principal(None, Role.ADMIN, "anonymous")


@dataclass(frozen=True, slots=True)
class TenantQuota:
    dram_bytes: int = 0  #: 0 = no quota
    ssd_bytes: int = 0  #: 0 = no quota


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Token digests -> principals, and quotas by tenant. Empty: open mode."""

    entries: tuple[tuple[bytes, Principal], ...] = ()
    quotas: Mapping[str, TenantQuota] = field(default_factory=dict)
    source: str = ""

    @property
    def open(self) -> bool:
        return not self.entries

    @staticmethod
    def digest(token: object) -> bytes:
        return hashlib.sha256(str(token).encode("utf-8", "surrogatepass")).digest()

    def principal_of(self, digest: bytes) -> Principal | None:
        """Who a token digest stands for (None: no one). Constant time per entry."""
        found = None
        for known, principal in self.entries:  # every entry, found or not: no early exit
            if hmac.compare_digest(digest, known):
                found = principal
        return found

    def authenticate(self, token: object) -> Principal | None:
        """The principal ``token`` stands for (None: unknown). Constant time per entry."""
        if not isinstance(token, str) or not token:
            return None
        return self.principal_of(self.digest(token))


def load_tokens(path: str | Path) -> TokenTable:
    """Parse a tokens file; ConfigError naming the file and the bad entry."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read tokens file {where}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"tokens file {where} is not valid TOML: {exc}") from None
    unknown = set(doc) - {"token", "tenant"}
    if unknown:
        raise ConfigError(f"tokens file {where}: unknown section(s) {sorted(unknown)}")
    raw_tokens = doc.get("token", [])
    if not isinstance(raw_tokens, list) or not raw_tokens:
        raise ConfigError(f"tokens file {where} has no [[token]] entries")
    entries: list[tuple[bytes, Principal]] = []
    seen: set[bytes] = set()
    for i, item in enumerate(raw_tokens):
        entries.append(_entry(item, f"{where}: [[token]] #{i + 1}"))
        if entries[-1][0] in seen:
            raise ConfigError(f"{where}: [[token]] #{i + 1} repeats an earlier token")
        seen.add(entries[-1][0])
    quotas = {}
    for tenant, section in doc.get("tenant", {}).items():
        quotas[tenant] = _quota(tenant, section, f"{where}: [tenant.{tenant}]")
    return TokenTable(tuple(entries), quotas, where)


def _entry(item: Any, where: str) -> tuple[bytes, Principal]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where} is not a table")
    unknown = set(item) - {"token", "sha256", "tenant", "role"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
    tenant = item.get("tenant")
    if not isinstance(tenant, str) or not _TENANT.match(tenant):
        raise ConfigError(f"{where}: tenant must be 1-64 of A-Z a-z 0-9 . _ - (starting with a "
                          f"letter or digit), got {tenant!r}")
    role_name = item.get("role", "write")
    try:
        role = Role[str(role_name).upper()]
    except KeyError:
        raise ConfigError(f"{where}: role must be read, write or admin, got {role_name!r}") \
            from None
    if ("token" in item) == ("sha256" in item):
        raise ConfigError(f"{where}: give exactly one of token or sha256")
    if "token" in item:
        token = item["token"]
        if not isinstance(token, str) or len(token) < 16:
            raise ConfigError(f"{where}: a token must be a string of at least 16 characters")
        digest = hashlib.sha256(token.encode()).digest()
    else:
        try:
            digest = bytes.fromhex(str(item["sha256"]))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"{where}: sha256 must be 64 hex characters")
    return digest, Principal(tenant, role, f"{tenant}/{role.name.lower()}")


def _quota(tenant: str, section: Any, where: str) -> TenantQuota:
    from kvpool.server.config import parse_size

    if not _TENANT.match(tenant):
        raise ConfigError(f"{where}: not a valid tenant name")
    if not isinstance(section, dict) or set(section) - {"dram_quota", "ssd_quota"}:
        raise ConfigError(f"{where}: the keys are dram_quota and ssd_quota")
    dram, ssd = parse_size(section.get("dram_quota", 0)), parse_size(section.get("ssd_quota", 0))
    if dram < 0 or ssd < 0:
        raise ConfigError(f"{where}: quotas must be >= 0")
    return TenantQuota(dram_bytes=dram, ssd_bytes=ssd)


def scope_key(scope: str, key: bytes) -> bytes:
    """``key`` as stored in ``scope`` (a tenant name, or SHARED_SCOPE)."""
    return _scoped(key, scope.encode())


def _scoped(key: bytes, scope: bytes) -> bytes:
    return key[:8] + hashlib.blake2b(key, digest_size=8, key=scope, person=_PERSON).digest()


#: ops a read-only token may send
READ_OPS = frozenset({Op.HELLO, Op.GET, Op.GET_SHM, Op.RELEASE, Op.TOUCH, Op.EXISTS, Op.LOOKUP,
                      Op.STATS, Op.CLUSTER})


def check(principal: Principal, op: int, scope: int) -> str | None:
    """Why ``principal`` may not send ``op`` in ``scope`` (None: it may)."""
    if principal.role == Role.ADMIN:
        return None
    if scope & OP_FLAG_RAW:
        return "only admin tokens may address stored keys (raw scope)"
    if op in READ_OPS:
        return None
    if scope & OP_FLAG_SHARED:
        return "only admin tokens may write to the shared scope"
    if principal.role < Role.WRITE:
        return f"a read token may not send {Op(op).name}"
    return None


def stored_keys(principal: Principal, keys: list[bytes], scope: str, op: Op) -> list[bytes]:
    """``keys`` as ``principal`` addresses them in ``scope`` ("", "shared" or "raw") to do
    what ``op`` does on the data port.

    For the admin API, which takes the same scope names as the SDK and asks the same
    table (:func:`check`) as the data port. Raises PermissionDeniedError where the data
    port would answer PERMISSION_DENIED, ConfigError for a bad scope name.
    """
    flags = SCOPE_FLAGS.get(scope or "tenant")
    if flags is None:
        raise ConfigError(f"scope must be tenant, shared or raw, got {scope!r}")
    why = check(principal, op, flags)
    if why is not None:
        raise PermissionDeniedError(why)
    scoper = scoper_for(principal)
    return keys if scoper is None else [scoper(k, flags) for k in keys]


def scoper_for(principal: Principal) -> Scoper | None:
    """The parser's key mapping for ``principal``'s connection (None: keys as sent)."""
    if principal.tenant is None:
        return None
    own, shared = principal.tenant.encode(), SHARED_SCOPE.encode()

    def scoper(key: bytes, scope: int) -> bytes:
        if scope & OP_FLAG_RAW:
            return key  # admins only (anyone else is refused before a handler runs)
        return _scoped(key, shared if scope & OP_FLAG_SHARED else own)

    return scoper
