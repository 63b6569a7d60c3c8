"""One memory budget for every RocksDB store in a process.

Per-store caches multiply with partitions (the classic container OOM). Here all stores
share ONE LRU block cache and ONE write buffer manager charged to that cache, and index
and filter blocks live in the cache too, so the budget bounds them all.
"""

from __future__ import annotations

from rocksdict import BlockBasedOptions, Cache, DBCompressionType, Options, WriteBufferManager

MB = 1024 * 1024


class StoreResources:
    def __init__(self, memory_budget_mb: int) -> None:
        budget = max(memory_budget_mb, 16) * MB
        self.budget_bytes = budget
        self.cache = Cache(budget)
        # Memtables may take up to half the budget; their memory is charged to the cache.
        self.write_buffers = WriteBufferManager.new_write_buffer_manager_with_cache(budget // 2, True, self.cache)
        self.write_buffer_size = max(budget // 16, 2 * MB)

    def options(self) -> Options:
        table = BlockBasedOptions()
        table.set_block_cache(self.cache)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        table.set_pin_top_level_index_and_filter(True)
        table.set_bloom_filter(10, False)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.create_missing_column_families(True)
        options.set_block_based_table_factory(table)
        options.set_write_buffer_manager(self.write_buffers)
        options.set_write_buffer_size(self.write_buffer_size)
        options.set_max_write_buffer_number(2)
        options.set_compression_type(DBCompressionType.lz4())
        options.set_max_open_files(256)
        return options

    def usage_bytes(self) -> int:
        return int(self.cache.get_usage())
