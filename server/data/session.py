"""A data connection's state on the node: who authenticated on it (HELLO), what of the
shared-memory fast path it was granted, and the leases it holds. The connection owns
one and hands it to the op table with each request (the wire's ``Request`` carries
nothing of the node's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.server.security.auth import ANONYMOUS, Principal

__all__ = ["Session"]


@dataclass(slots=True, eq=False)
class Session:
    """Per data connection: whether it may use the arena, and its open leases."""

    shm: bool = False
    #: granted a writable mapping: may PUT through the arena (PUT_SHM, COMMIT)
    write: bool = False
    leases: set[int] = field(default_factory=set)
    #: may map the arena (open mode, admin tokens): it holds every tenant's chunks, so
    #: with tenants configured a non-admin tenant is never offered it
    any_uid: bool = True
    #: who authenticated on this connection (set by HELLO)
    principal: Principal = ANONYMOUS
    #: sha256 of the token it presented (b"" in open mode); a reload that drops it closes us
    token_digest: bytes = b""
    #: offered the arena index (its keys are stored as sent: no tenant scope)
    index: bool = False
