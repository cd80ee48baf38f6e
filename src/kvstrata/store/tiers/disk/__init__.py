"""L3, the disk tier: see :mod:`.tier` for what it guarantees and the parts it is made of."""

from kvstrata.store.tiers.disk.files import block_path, parse_file_name
from kvstrata.store.tiers.disk.tier import DiskTier, open_disk_tier

__all__ = ["DiskTier", "block_path", "open_disk_tier", "parse_file_name"]
