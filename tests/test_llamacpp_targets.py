"""llama.cpp beside the targets people bring: each row of the architecture matrix (tests/test_targets.py) as a tiny
random model at SmolLM2's vocabulary, converted by llama.cpp's own converter and served by llama-server with each
drafter family exported `--format gguf`. Greedy, 24 tokens: with the drafter the answer is the target's own in
llama.cpp. Where llama.cpp 11434 cannot serve a family beside a target, the export refuses in one line that says why
(export/gguf.py: NO_LAYER_INPUTS, BLOCK_CONVERTER_FAILS) instead of a GGUF that aborts llama-server at its first
request. Needs the llama.cpp build; skipped without it."""

import json

import pytest
import torch
from conftest import RECIPES, REPO, TINY
from omegaconf import OmegaConf
from test_targets import ARCHS, multimodal_gemma3, tokenizer_ids
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import load_target
from specdrafter.export.formats import export
from specdrafter.export.gguf import DRAFT_FILE
from specdrafter.inference.llama_server import LlamaServer
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import build_drafter
from specdrafter.models.targets import LLAMACPP_LAYOUT

pytestmark = pytest.mark.skipif(not llamacpp.installed(), reason="llama.cpp is not built (specdrafter-llamacpp install)")

SPEC_TYPES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash", "dspark": "draft-dspark", "draft_model": "draft-simple"}
LAYERS = ["drafter.eagle.aux_layer_ids=[1,2,3]", "drafter.block.aux_layer_ids=[1,2,3]"]  # the 4-layer targets'
OVERRIDES = {
    "eagle3": ["drafter.eagle.draft_vocab_size=0", "drafter.eagle.attention_bias=false"],  # gpt-oss's biases: below
    "dflash": ["drafter.block.draft_vocab_size=0", "drafter.block.init_from_target=false"],
    "dspark": ["drafter.block.draft_vocab_size=0", "drafter.block.init_from_target=false"],
    "draft_model": ["drafter.num_layers=1"],
}
NO_LAYER_INPUTS = "cannot serve .* its graph for that target does not expose the layer inputs"
REFUSED = {("gemma3", k): NO_LAYER_INPUTS for k in ("eagle3", "dflash", "dspark")}
REFUSED |= {("deepseek_v3", k): NO_LAYER_INPUTS for k in ("eagle3", "dflash", "dspark")}
REFUSED |= {("qwen2", k): NO_LAYER_INPUTS for k in ("eagle3", "dflash", "dspark")}  # qwen2.cpp records no t_layer_inp
REFUSED |= {("qwen3_moe", k): "converter fails on .* Qwen3-MoE target" for k in ("dflash", "dspark")}
# llama-server aborts at start-up on a 1-layer draft of Qwen3-Next (its one layer linear attention, no KV cache to
# allocate: GGML_ASSERT(buffer)), so the export refuses a draft model without a full-attention layer
REFUSED[("qwen3_next", "draft_model")] = "layers are all linear_attention, and llama-server aborts"
NAMES = [n for n in ARCHS if n != "llama"]  # Llama: tests/test_gguf.py
# llama.cpp's Gemma 3 and Mistral cells take what it assumes (models/targets.py:LLAMACPP_LAYOUT), where the matrix's
# tiny Gemma 3 alternates sliding and full layers with transformers' query_pre_attn_scalar of 256, and its Mistral has
# a window of 8
GEMMA3_LAYOUT = LLAMACPP_LAYOUT["gemma3"]
PROMPT = list(range(100, 120))
NEW = 24


@pytest.fixture(scope="module")
def tokenizer_of(smollm2_tokenizer):
    """The tokenizer of each row's target: SmolLM2's, and Qwen's own for Qwen2. transformers reads any tokenizer saved
    beside a qwen2 config as Qwen2Tokenizer, whose pre-tokenizer (Qwen's) makes SmolLM2's vocabulary a tokenizer
    llama.cpp's converter does not recognise, so that row takes the real one (llama.cpp's vocabulary test file)."""
    qwen = []

    def get(name):
        if name != "qwen2":
            return smollm2_tokenizer
        if not qwen:
            models = llamacpp.source_dir() / "models"
            tokenizer = AutoTokenizer.from_pretrained(str(models), gguf_file="ggml-vocab-qwen2.gguf")
            tokenizer.chat_template = (models / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
            tokenizer.eos_token = "<|im_end|>"
            qwen.append(tokenizer)
        return qwen[0]
    return get


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_of):
    """name → (HF folder, target GGUF, the target's greedy answer in llama-server), made once per architecture."""
    made = {}

    def make(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"llamacpp-{name}")
            tokenizer = tokenizer_of(name)
            config = ARCHS[name]()
            config.update(LLAMACPP_LAYOUT.get(name, {}))
            config.vocab_size = len(tokenizer)
            config.bos_token_id = tokenizer.bos_token_id
            config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
            config.tie_word_embeddings = False
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            with torch.no_grad():
                model.lm_head.weight.mul_(30.0)  # decisive greedy: no near-ties for rounding to flip
            model.save_pretrained(folder / "target")
            tokenizer.save_pretrained(folder / "target")
            gguf = folder / "target.gguf"
            llamacpp.convert(folder / "target", gguf)
            with LlamaServer(gguf, context=512, threads=1) as server:
                alone = server.complete(PROMPT, NEW)["tokens"]
            made[name] = (folder / "target", gguf, alone)
        return made[name]
    return make


def drafter_run(tmp_path, folder, kind, tokenizer, overrides=None):
    """A run folder with one checkpoint of the kind's drafter (random) for the target in `folder`; returns it and
    the drafter."""
    cfg = load_recipe(REPO / "recipes" / f"{RECIPES[kind]}.yaml", [
        f"output_dir={tmp_path / kind}", f"target.model={folder}", f"drafter.kind={kind}", *TINY, *LAYERS,
        *(OVERRIDES[kind] if overrides is None else overrides)])
    target, _ = load_target(str(folder))
    drafter = build_drafter(cfg, target, None, tokenizer)
    checkpoint = tmp_path / kind / "checkpoints" / "step-000004"
    drafter.save(drafter.module, checkpoint / "drafter", tokenizer)
    (checkpoint / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 4, "drafter": kind, "metrics": {}}))
    return tmp_path / kind, drafter


@pytest.mark.parametrize("kind", list(SPEC_TYPES))
@pytest.mark.parametrize("name", NAMES)
def test_each_family_serves_each_target_in_llamacpp_as_the_target_alone_or_is_refused(
        name, kind, served, tmp_path, tokenizer_of, one_thread):
    folder, gguf, alone = served(name)
    run, _ = drafter_run(tmp_path, folder, kind, tokenizer_of(name))
    if (name, kind) in REFUSED:
        with pytest.raises(SpecdrafterError, match=REFUSED[name, kind]):
            export(run, "gguf", tmp_path / "gguf")
        assert not (tmp_path / "gguf").exists()  # nothing half-written
        return
    out = export(run, "gguf", tmp_path / "gguf")
    with LlamaServer(gguf, draft=out / DRAFT_FILE, spec_type=SPEC_TYPES[kind], n_max=3, context=512, threads=1) as server:
        drafted = server.complete(PROMPT, NEW)
    assert len(alone) == NEW and drafted["tokens"] == alone
    assert drafted["timings"]["draft_n"] > 0  # the drafter drafted, and a random one is mostly rejected: rollbacks ran


def test_an_eagle3_head_with_attention_biases_is_refused_for_llamacpp(served, tmp_path, smollm2_tokenizer):
    """gpt-oss's attention has biases, so a head built as its target has them (drafter.eagle.attention_bias null);
    llama.cpp's EAGLE-3 layer has none and would refuse the GGUF at load: one line naming the key."""
    folder, _, _ = served("gpt_oss")
    run, drafter = drafter_run(tmp_path, folder, "eagle3", smollm2_tokenizer, ["drafter.eagle.draft_vocab_size=0"])
    assert drafter.module.config.attention_bias is True
    with pytest.raises(SpecdrafterError, match="drafter.eagle.attention_bias=false"):
        export(run, "gguf", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def test_a_multimodal_gemma3_target_converts_and_serves_a_draft_model_in_llamacpp(tmp_path, smollm2_tokenizer,
                                                                                   one_thread):
    """Gemma 3 from 4B up is published as Gemma3ForConditionalGeneration (a vision tower beside the language model).
    llama.cpp's converter takes its language model (the vision tower goes to a separate --mmproj file, not made
    here); our draft model, built from the language model load_target keeps, serves beside it greedy-exactly. EAGLE-3
    is refused for it as for the text-only Gemma 3 (no layer inputs in llama.cpp's graph)."""
    model = multimodal_gemma3(len(smollm2_tokenizer), {**tokenizer_ids(smollm2_tokenizer), **GEMMA3_LAYOUT},
                              tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # decisive greedy: no near-ties for rounding to flip
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    gguf = tmp_path / "target.gguf"
    llamacpp.convert(folder, gguf)
    run, _ = drafter_run(tmp_path, folder, "draft_model", smollm2_tokenizer)
    out = export(run, "gguf", tmp_path / "gguf")
    with LlamaServer(gguf, context=512, threads=1) as server:
        alone = server.complete(PROMPT, NEW)["tokens"]
    with LlamaServer(gguf, draft=out / DRAFT_FILE, spec_type="draft-simple", n_max=3, context=512, threads=1) as server:
        drafted = server.complete(PROMPT, NEW)
    assert len(alone) == NEW and drafted["tokens"] == alone and drafted["timings"]["draft_n"] > 0
    eagle, _ = drafter_run(tmp_path, folder, "eagle3", smollm2_tokenizer)
    with pytest.raises(SpecdrafterError, match=NO_LAYER_INPUTS):
        export(eagle, "gguf", tmp_path / "eagle-gguf")


@pytest.mark.parametrize("name, change, refused", [
    ("gemma3", {"query_pre_attn_scalar": 16},
     r"llama.cpp assumes every 6th layer full attention .* llama-server would compute another model"),
    ("gemma3", {**GEMMA3_LAYOUT, "query_pre_attn_scalar": 256},
     r"scales Gemma3ForCausalLM's attention by 1/√16 .* query_pre_attn_scalar is 256"),
    ("mistral", {}, r"converts MistralForCausalLM as Llama, .* see only the last 8 \(sliding_window\); beyond 8 tokens"),
])
def test_a_target_llamacpp_would_run_as_another_model_is_refused_in_one_line(name, change, refused, tmp_path,
                                                                               smollm2_tokenizer):
    """llama.cpp's Gemma 3 converter writes no layer types and its graph takes every 6th layer as full attention, and
    it converts Mistral as Llama, with no sliding window: the matrix's tiny Gemma 3 (sliding and full alternating) and
    Mistral (window 8) would be served as other models, with no error (found by benchmarks/llamacpp_sampling.py: the
    target alone's first two tokens left its law, p = 0); so would a Gemma 3 whose attention scale
    (query_pre_attn_scalar) is not its head size, as llama.cpp takes it. The conversion is refused in one line,
    nothing written."""
    config = ARCHS[name]()
    config.update(change)
    config.vocab_size = len(smollm2_tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    with pytest.raises(SpecdrafterError, match=refused):
        llamacpp.convert(tmp_path / "target", tmp_path / "target.gguf")
    assert not (tmp_path / "target.gguf").exists()
