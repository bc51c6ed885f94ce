from moeserve.cache.kv_pool import MLAKVPool, kv_capacity_tokens
from moeserve.cache.page_pool import PagePool

__all__ = ["MLAKVPool", "PagePool", "kv_capacity_tokens"]
