"""Tenant quotas of one tier: the bytes each tenant's chunks hold, against its quota.

The DRAM tier and the SSD tier each keep a :class:`TenantBytes`: the sums and the rule
(how much must go before a value fits). Which chunks go is the tier's own choice. DRAM:
the tenant's least recently used, unread ones, from its ledger's order. The SSD (the
node's side of it, ``server/cold/ssd.py``): the tenant's oldest writes, from
:class:`TenantChunks`.
"""

from __future__ import annotations

__all__ = ["TenantBytes", "TenantChunks"]


class TenantBytes:
    """Bytes held per tenant, the quotas, and how often a quota made room or refused."""

    __slots__ = ("evictions", "quotas", "rejections", "used")

    def __init__(self) -> None:
        #: most bytes each tenant's chunks may hold; absent: no quota
        self.quotas: dict[str, int] = {}
        #: bytes each tenant's chunks hold now (no entry: none)
        self.used: dict[str, int] = {}
        #: chunks dropped to make room within their tenant's quota
        self.evictions = 0
        #: values refused because their tenant's quota could not make room
        self.rejections = 0

    def charge(self, tenant: str | None, nbytes: int) -> None:
        """``tenant``'s chunks hold ``nbytes`` more (less, when negative); None: no one's."""
        if tenant is not None:
            left = self.used.get(tenant, 0) + nbytes
            if left:
                self.used[tenant] = left
            else:
                self.used.pop(tenant, None)

    def excess(self, tenant: str | None, nbytes: int) -> int | None:
        """How many of ``tenant``'s bytes must go before ``nbytes`` more fit its quota: 0
        when they fit (or it has no quota), None when they never can (over the quota)."""
        if tenant is None or (quota := self.quotas.get(tenant)) is None:
            return 0
        if nbytes > quota:
            return None
        return max(0, self.used.get(tenant, 0) + nbytes - quota)


class TenantChunks:
    """The chunks a tier holds for each tenant with a quota, oldest write first, their
    bytes against the quotas (:attr:`tenants`), and writes still on their way (counted as
    written). The SSD's quotas: a tenant over its quota drops its own oldest chunks."""

    __slots__ = ("_owned", "_owner", "_queued", "tenants")

    def __init__(self) -> None:
        self.tenants = TenantBytes()
        self._owned: dict[str, dict[bytes, int]] = {}  # tenant -> key -> bytes, oldest first
        self._owner: dict[bytes, str] = {}
        self._queued: dict[str, int] = {}  # bytes of writes on their way, by tenant

    def limits(self, tenant: str | None) -> bool:
        """Whether ``tenant`` has a quota here."""
        return tenant is not None and tenant in self.tenants.quotas

    def victims(self, tenant: str, nbytes: int) -> list[bytes] | None:
        """``tenant``'s oldest chunks to drop before ``nbytes`` more (beside its writes on
        their way) fit its quota: [] when they fit; None when they never can (they would
        exceed the quota even with nothing else held)."""
        need = self.tenants.excess(tenant, nbytes + self._queued.get(tenant, 0))
        if need is None:
            return None
        victims = []
        for key, length in self._owned.get(tenant, {}).items():
            if need <= 0:
                break
            victims.append(key)
            need -= length
        return victims if need <= 0 else None

    def queue(self, tenant: str, nbytes: int) -> None:
        """A write of ``nbytes`` for ``tenant`` is on its way."""
        self._queued[tenant] = self._queued.get(tenant, 0) + nbytes

    def arrived(self, tenant: str | None, nbytes: int) -> None:
        """A queued write ended (stored or not)."""
        if tenant is not None and tenant in self._queued:
            self._queued[tenant] -= nbytes

    def add(self, key: bytes, tenant: str, nbytes: int) -> None:
        """``key`` (``nbytes``) is held for ``tenant`` now (the newest of its chunks)."""
        self.forget(key)
        self._owner[key] = tenant
        self._owned.setdefault(tenant, {})[key] = nbytes
        self.tenants.charge(tenant, nbytes)

    def forget(self, key: bytes) -> None:
        tenant = self._owner.pop(key, None)
        if tenant is not None:
            self.tenants.charge(tenant, -self._owned[tenant].pop(key))
