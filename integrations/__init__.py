"""Framework integrations (LlamaIndex, LangChain, FAISS). Each module imports its framework lazily."""
