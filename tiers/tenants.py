"""Tenant quotas of one tier: the bytes each tenant's chunks hold, against its quota.

The DRAM tier and the SSD tier each keep one. The sums and the rule (how much must
go before a value fits) are here; which chunks go is the tier's own choice (DRAM:
the tenant's least recently used, unread ones; SSD: the tenant's oldest writes).
"""

from __future__ import annotations

__all__ = ["TenantBytes"]


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
