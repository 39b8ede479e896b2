"""kvpool storage tiers (DRAM today; RocksDB and S3 next). No networking."""

from kvpool.tiers.arena import ALIGN, Arena
from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.dram import DramTier, Entry, Slot
from kvpool.tiers.eviction import PrefixAwareLRU

__all__ = ["ALIGN", "Arena", "DramTier", "Entry", "PrefixAwareLRU", "Slot", "Tier", "TierStats"]
