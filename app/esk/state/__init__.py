"""State stores: RocksDB per partition, restored from the compacted changelog."""
