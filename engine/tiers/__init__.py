"""Storage tiers below the KV pool: the host arena, the disk store, Redis, and the chunk byte format they share."""
