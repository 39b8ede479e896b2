"""The cold tier: the node's handle on the SSD worker process (RocksDB, and S3 below it),
and the tier manager over DRAM and it.
"""
