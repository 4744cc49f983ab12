"""A replica refuses a call that was sent before a document's delete (issue 37): a request that
waited in Ray Serve's queue while the document was deleted must not register and compute it
again (it would come back into the KV pool and the tiers). The replica class runs here without
Ray, over the tiny engine."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

pytest.importorskip("ray.serve")

from lazyattn_rag.serve.replica import EngineReplica  # noqa: E402
from tests.tiny import tiny_llm, words  # noqa: E402

TEXT = words(40, start=31)


@pytest.fixture
def replica():
    made = EngineReplica(build=tiny_llm)
    yield made
    made.llm.close()


def payload(issued_at: float, doc_id: str = "memo") -> dict:
    return {"messages": [{"role": "user", "content": "w5 w6"}], "documents": [[doc_id, TEXT]], "placed": [doc_id],
            "sampling": {"max_tokens": 2}, "namespace": "team-a", "transient": [], "issued_at": issued_at}


async def events(replica, body) -> list[dict]:
    return [e async for e in replica.generate(body)]


def test_a_call_sent_before_the_delete_is_refused_and_computes_nothing(replica):
    async def run():
        before = time.time()
        assert "error" not in (await replica.register([("memo", TEXT)], "team-a", issued_at=before))
        assert (await events(replica, payload(before)))[-1]["finish_reason"] == "length"
        removed = await replica.forget("memo", TEXT, "team-a")
        assert removed["num_kv_blocks"] == 3 and not removed["cached"]
        late = await events(replica, payload(before))  # queued before the delete, run after it
        assert late == [{"error": {"message": "document 'memo' in namespace 'team-a' was deleted while this request "
                                              "waited", "type": "UnknownDocumentError", "status": 404,
                                   "code": "document_not_found"}}]
        for call in (replica.register, replica.warm):
            assert (await call([("memo", TEXT)], "team-a", issued_at=before))["error"]["status"] == 404
        assert (await replica.holds(TEXT, "team-a"))["where"] == []
        assert not replica.llm.has_document("memo", "team-a")
        after = time.time()  # registered again after the delete: served
        assert "error" not in (await replica.register([("memo", TEXT)], "team-a", issued_at=after))
        assert (await events(replica, payload(after)))[-1]["finish_reason"] == "length"
        assert (await events(replica, payload(before, "other")))[-1]["finish_reason"] == "length"  # another id

    asyncio.run(run())


def test_the_replica_sets_its_process_switch_interval():
    """``ServeConfig.switch_interval_ms`` reaches the replica's process; ``None`` leaves it."""
    before = sys.getswitchinterval()
    try:
        made = EngineReplica(build=tiny_llm, switch_interval_ms=0.25)
        made.llm.close()
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
        sys.setswitchinterval(0.004)
        made = EngineReplica(build=tiny_llm)
        made.llm.close()
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)
