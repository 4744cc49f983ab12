"""LangChain's own standard VectorStore suite (``langchain-tests``) against
``langchain_store.FaissVectorStore``: what LangChain asks of a ``VectorStore``."""

import pytest
from langchain_tests.integration_tests.vectorstores import VectorStoreIntegrationTests

from lazyattn_rag.integrations.langchain_store import FaissVectorStore


class TestFaissVectorStoreStandard(VectorStoreIntegrationTests):
    @pytest.fixture()
    def vectorstore(self):
        yield FaissVectorStore(self.get_embeddings())
