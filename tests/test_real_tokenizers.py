"""A target with a real non-Llama tokenizer: Qwen3's byte-level BPE of 151,936 rows with its ChatML turn markers,
read from the vocabulary file llama.cpp's source tree ships for its own tokenizer tests, with Qwen3's real chat
template from the same tree. A tiny random Qwen3 model at that vocabulary goes the whole way: the data job regenerates
two-turn conversations through it, EAGLE-3 (pruned vocabulary) and DSpark (the Qwen3-8B recipe's mask row 151669)
train on them, both export --format gguf through llama.cpp's converter (whose pre-tokenizer check must recognise
the tokenizer), and llama-server decodes with each exactly as the target alone at T = 0. Needs the llama.cpp build;
skipped without it."""

import pytest
import torch
from conftest import REPO, small_data_recipe
from test_regression import TINY
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

import specdrafter.jobs.train as train_loop
from specdrafter.core import llamacpp
from specdrafter.data.regenerate import generate_dataset
from specdrafter.data.shards import load_generated
from specdrafter.export.formats import export
from specdrafter.export.gguf import DRAFT_FILE
from specdrafter.inference.llama_server import LlamaServer
from specdrafter.jobs.recipe import load_recipe

VOCAB_FILE = "ggml-vocab-qwen35.gguf"  # Qwen's tokenizer (Qwen2 to Qwen3.5 share it)
TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
pytestmark = pytest.mark.skipif(
    not llamacpp.installed() or not (llamacpp.source_dir() / "models" / VOCAB_FILE).is_file(),
    reason="llama.cpp is not built (specdrafter-llamacpp install)")
LAYERS = ["drafter.eagle.aux_layer_ids=[1,2,3]", "drafter.block.aux_layer_ids=[1,2,3]"]


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    """A 4-layer random Qwen3 (width 64, untied lm_head × 30 so greedy is decisive) with Qwen's real tokenizer and
    Qwen3's chat template; <|im_end|> closes a turn, as in Qwen3's instruct models."""
    models = llamacpp.source_dir() / "models"
    tokenizer = AutoTokenizer.from_pretrained(str(models), gguf_file=VOCAB_FILE)
    tokenizer.chat_template = (models / "templates" / TEMPLATE).read_text()
    tokenizer.eos_token = "<|im_end|>"
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    folder = tmp_path_factory.mktemp("qwen3-real-tokenizer") / "target"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_a_qwen3_target_with_its_real_tokenizer_trains_exports_and_serves_in_llamacpp(
        qwen3_target, tmp_path, prompt_file, one_thread, in_process_training):
    folder, tokenizer = qwen3_target
    assert len(tokenizer) == 151936 and tokenizer.eos_token_id == 151645
    stats = generate_dataset(small_data_recipe(tmp_path / "data", folder, prompt_file, "data.max_turns=2"))
    assert stats["conversations"] >= 8
    rows = load_generated(tmp_path / "data")
    assert len(rows) >= 8 and all(sum(r["loss_mask"]) == r["num_response_tokens"] > 0 for r in rows)
    prompt = rows[0]["input_ids"][:rows[0]["num_prompt_tokens"]]
    assert tokenizer.decode(prompt).startswith("<|im_start|>user\n") and tokenizer.decode(prompt).endswith(
        "<|im_start|>assistant\n")
    target_gguf = tmp_path / "target.gguf"
    llamacpp.convert(folder, target_gguf)
    with LlamaServer(target_gguf, context=512, threads=1) as server:
        alone = server.complete(prompt, 24)["tokens"]
    assert len(alone) == 24
    for kind, spec_type, extra in (("eagle3", "draft-eagle3", []),
                                   ("dspark", "draft-dspark", ["drafter.block.mask_token_id=151669"])):
        run = tmp_path / kind
        train_loop.train(load_recipe(REPO / "recipes" / f"smollm2-135m-{kind}.yaml", [
            f"output_dir={run}", f"target.model={folder}", f"train.data_dir={tmp_path / 'data'}", *TINY, *LAYERS,
            *extra]))
        out = export(run, "gguf", tmp_path / f"{kind}-gguf")
        with LlamaServer(target_gguf, draft=out / DRAFT_FILE, spec_type=spec_type, n_max=3, context=512,
                         threads=1) as server:
            drafted = server.complete(prompt, 24)
        assert drafted["tokens"] == alone and drafted["timings"]["draft_n"] > 0, kind

