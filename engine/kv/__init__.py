"""The KV cache: blocks and their pool, block tables, the chunk cache and its eviction policies."""
