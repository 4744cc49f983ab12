"""lazyattn-rag."""
