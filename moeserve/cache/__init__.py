from moeserve.cache.kv_pool import KVLayout, MLAKVPool, kv_capacity_tokens
from moeserve.cache.page_pool import PagePool

__all__ = ["KVLayout", "MLAKVPool", "PagePool", "kv_capacity_tokens"]
