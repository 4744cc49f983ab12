"""Value types every layer may import: configs, sampling parameters, documents, chat messages,
outputs and errors. Nothing here imports torch or another lazyattn_rag layer."""
