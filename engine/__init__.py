"""The embedded paged inference engine: block pool, chunk cache, model, attention backends, runner."""
