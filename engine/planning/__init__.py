"""Planning: the document registry, prompt templates and plans, chunk keys (fingerprints), finding registered texts in prompts, learned passages."""
