"""The targets people bring (models/targets.py), each a tiny random model of the real architecture built by
transformers from its own config class, its features on: MoE routing (Qwen3-MoE, gpt-oss, DeepSeek-V3), sliding
windows narrower than the test's sequence (Mistral, Gemma 3, gpt-oss: window 8 over 20-token prompts), attention sinks
(gpt-oss), MLA (DeepSeek-V3), linear-attention layers (Qwen3-Next). Through the real loops, rejections and rollbacks
included: greedy chain and tree decoding equal the target's own greedy decoding; at T = 1 the first two tokens follow
the target's law (χ², level 1e-4); a tree pass's logits equal a chain recompute (the sliding window applied to tree
masks); a tree over linear-attention layers is refused in one line."""

import copy
import json
from typing import Optional

import pytest
import torch
from conftest import REPO, assert_first_two_tokens_follow, sample_first_two_through_the_loop, small_data_recipe
from test_regression import TINY  # its 3-step training run: one layer, online features, fp32
from transformers import (
    AutoModelForCausalLM,
    Cohere2Config,
    DynamicCache,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    MinistralConfig,
    MixtralConfig,
    Phi3Config,
    Phi3ForCausalLM,
)

import specdrafter.jobs.train as train_loop
from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import ASDConfig
from specdrafter.data.assets import load_target
from specdrafter.data.chat import user_prompt_ids
from specdrafter.data.regenerate import generate_dataset
from specdrafter.data.shards import load_generated
from specdrafter.engines.evaluate import evaluate
from specdrafter.eval.job import load_sets
from specdrafter.export.engines import check_engine_target
from specdrafter.export.formats import export
from specdrafter.inference.block import BlockProposer
from specdrafter.inference.decode import speculative_generate, tree_pass, tree_speculative_generate
from specdrafter.inference.eagle import EagleProposer
from specdrafter.inference.proposers import DraftModelProposer, DraftModelTreeProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.inference.tree import tree_from_choices
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds.base import Family
from specdrafter.models.block import VARIANTS, BlockDrafter, block_config
from specdrafter.models.block_folders import load_block_drafter
from specdrafter.models.eagle import Eagle3Head, eagle3_config, load_eagle3
from specdrafter.models.features import capture_features
from specdrafter.models.targets import LINEAR, SLIDING, check_architecture, layer_types, tiny_config

V = 16  # a vocabulary small enough for the χ² test's V² cells
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8
ARCHS = {name: (lambda name=name: tiny_config(name, V, WINDOW)) for name in
         ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_next")}
PROMPT = [3 + (7 * i) % (V - 3) for i in range(20)]  # 20 tokens: longer than the window
NEW = 40
TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]


def build(name: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ARCHS[name]()).eval()


@pytest.fixture(scope="module")
def targets():
    return {name: build(name) for name in ARCHS}


def near_copy(model, noise: float = 0.02):
    """The model with every weight perturbed (seeded): it drafts mostly what the model would, so drafts are partly
    accepted — rollbacks after an accepted prefix run, and for Qwen3-Next the draft's own recurrent rollback too."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g) * (p.std() if p.numel() > 1 else 1.0))
    return draft.eval()


@torch.no_grad()
def greedy(model, prompt, n):
    """The target's own greedy decoding of n tokens, recomputed from scratch at every step (no cache, no EOS)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_each_architecture_has_its_features_on(targets):
    assert layer_types(targets["mistral"].config) == [SLIDING] * 4
    assert SLIDING in layer_types(targets["gpt_oss"].config) and "full_attention" in layer_types(targets["gpt_oss"].config)
    assert layer_types(targets["gemma3"].config) == [SLIDING, "full_attention"] * 2
    assert LINEAR in layer_types(targets["qwen3_next"].config)
    assert targets["deepseek_v3"].config.kv_lora_rank == 16 and targets["qwen3_moe"].config.num_experts == 4
    attention = targets["qwen2"].model.layers[0].self_attn  # Qwen2: biases on q, k, v (not on o), every layer full
    assert all(getattr(attention, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert attention.o_proj.bias is None and layer_types(targets["qwen2"].config) == ["full_attention"] * 4


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_chain_equals_the_targets_own_decoding(targets, name):
    target = targets[name]
    reference = greedy(target, PROMPT, NEW)
    accepted = []
    for k, proposer in ((3, DraftModelProposer(near_copy(target))), (2, DraftModelProposer(build("llama")))):
        result = speculative_generate(target, proposer, PROMPT, NEW, SamplingParams(0.0), k, [])
        assert result.tokens == reference
        accepted += [c.accepted for c in result.cycles]
    assert 0 in accepted and any(0 < a for a in accepted)  # rejections (rollbacks) and accepted drafts both ran


@pytest.mark.parametrize("name", [n for n in ARCHS if n != "qwen3_next"])
def test_greedy_tree_equals_the_targets_own_decoding_and_its_logits_a_chain_recompute(targets, name):
    target = targets[name]
    reference = greedy(target, PROMPT, NEW)
    shape = tree_from_choices(TREE)
    result = tree_speculative_generate(target, DraftModelTreeProposer(build("llama"), shape), PROMPT, NEW)
    assert result.tokens == reference
    cache, tokens = DynamicCache(), torch.tensor([PROMPT[-1], 5, 6, 7, 8, 9])
    with torch.no_grad():
        target(input_ids=torch.tensor([PROMPT[:-1]]), cache=cache, use_cache=True)
        logits = tree_pass(target, cache, shape, tokens, len(PROMPT) - 1)
        for node in range(shape.size):
            path, j = [], node
            while j > 0:
                path.append(int(tokens[j]))
                j = shape.parents[j]
            chain = target(input_ids=torch.tensor([PROMPT + path[::-1]])).logits[0, -1]
            torch.testing.assert_close(logits[node], chain, atol=1e-4, rtol=1e-4)


def test_a_tree_over_linear_attention_layers_is_refused_in_one_line(targets):
    proposer = DraftModelTreeProposer(build("llama"), tree_from_choices(TREE))
    with pytest.raises(SpecdrafterError, match=r"^tree verification needs every layer to attend through a mask, and "
                                               r"qwen3_next has linear-attention layers .*decode it with a chain"):
        tree_speculative_generate(targets["qwen3_next"], proposer, PROMPT, 4)
    with pytest.raises(SpecdrafterError, match=r"^drafting a tree with a draft model needs full-attention layers only, "
                                               r"and mistral has sliding_attention layers"):
        DraftModelTreeProposer(targets["mistral"], tree_from_choices(TREE))


@pytest.mark.parametrize("name", list(ARCHS))
def test_sampling_at_temperature_1_follows_the_targets_law(targets, name):
    target, n = targets[name], 1200
    counts, accepted, drafted = sample_first_two_through_the_loop(target, DraftModelProposer(near_copy(target, 0.3)),
                                                                  PROMPT, n, tree=False)
    assert 0 < accepted < drafted  # both the acceptance and the residual paths ran
    assert_first_two_tokens_follow(target, PROMPT, counts, n)


@pytest.mark.parametrize("name", list(ARCHS))
def test_feature_id_k_is_the_residual_stream_entering_layer_k_on_each_architecture(targets, name):
    """The convention every drafter's features follow and the engines capture (docs/targets.md#feature-layers): id 0
    is the embedding as the first layer reads it (Gemma's scaled by sqrt(hidden)), id k the residual stream entering
    layer k (HF's hidden_states[k]: MoE, sinks, MLA, sliding and linear-attention layers alike), id L the last
    layer's output before the final norm."""
    target = targets[name]
    n = target.config.num_hidden_layers
    ids = torch.tensor([PROMPT])
    with torch.no_grad(), capture_features(target, range(n + 1)) as captured:
        out = target(input_ids=ids, output_hidden_states=True)
        embedded = target.get_input_embeddings()(ids)
        final = target.model.norm(captured[n])
    assert torch.equal(captured[0], embedded)
    for k in range(n):
        assert torch.equal(captured[k], out.hidden_states[k]), k
    assert torch.allclose(final, out.hidden_states[n], atol=1e-6)


@pytest.mark.parametrize("name", list(ARCHS))
def test_an_eagle3_head_reads_each_architecture_and_decodes_exactly(targets, name):
    """The head's features are the inputs to the aux layers (pre-hooks on the decoder layers): it builds and decodes
    greedy-exactly on every architecture, rollbacks included."""
    target = targets[name]
    torch.manual_seed(1)
    head = Eagle3Head(eagle3_config(target.config, [1, 2, 4], V)).eval()
    result = speculative_generate(target, EagleProposer(head, target), PROMPT, NEW, SamplingParams(0.0), 3, [])
    assert result.tokens == greedy(target, PROMPT, NEW)


def block_drafter(target, variant: str) -> BlockDrafter:
    """A random 1-layer DFlash / DSpark drafter reading the inputs of target layers 1 and 3, its drafts sharpened and
    (DSpark) its Markov term strong enough to change what is drafted."""
    torch.manual_seed(1)
    config = block_config(target.config, VARIANTS[variant], num_layers=1, block_size=4, aux_layer_ids=[1, 3],
                          mask_token_id=V - 1, markov_rank=4 if variant == "dspark" else 0)
    drafter = BlockDrafter(config).eval()
    with torch.no_grad():
        drafter.norm.weight.mul_(4.0)
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w2.weight.mul_(40.0)
    return drafter


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_a_block_drafter_reads_each_architecture_and_decodes_exactly(targets, name, variant):
    """DFlash and DSpark read the inputs of the target's layers through the same pre-hooks on every architecture and
    decode greedy-exactly over it, rollbacks included (a block of 3 or 4 drafts over a vocabulary of 16: some drafts
    are accepted, most blocks are cut)."""
    target = targets[name]
    result = speculative_generate(target, BlockProposer(block_drafter(target, variant), target), PROMPT, NEW,
                                  SamplingParams(0.0), 3, [])
    assert result.tokens == greedy(target, PROMPT, NEW)
    assert any(c.accepted < c.drafted for c in result.cycles)  # rejections: the target's cache rolled back


@pytest.mark.parametrize("name", list(ARCHS))
def test_a_block_drafter_samples_each_architectures_law_at_temperature_1(targets, name):
    target, n = targets[name], 1200
    counts, accepted, drafted = sample_first_two_through_the_loop(
        target, BlockProposer(block_drafter(target, "dspark"), target), PROMPT, n, tree=False)
    assert 0 < accepted < drafted
    assert_first_two_tokens_follow(target, PROMPT, counts, n)


@pytest.mark.parametrize("name", list(ARCHS))
def test_asd_on_each_architecture_is_greedy_at_no_budget_and_charges_its_exact_regret(targets, name):
    """ASD (budgeted greedy mismatches): with no budget the target's own greedy output; with one, the regret
    max_v z(v) − z(x) of every emitted token, replayed through one plain target pass, sums to the ledger, within the
    budget — the rollback after an accepted mismatch keeps the target's cache (window, MLA, recurrent state) right."""
    target, reference = targets[name], greedy(targets[name], PROMPT, NEW)
    proposer = DraftModelProposer(near_copy(target, 0.3))
    strict = speculative_generate(target, proposer, PROMPT, NEW, SamplingParams(0.0), 3, [], asd=ASDConfig(budget=0.0))
    assert strict.tokens == reference and strict.asd_regret == 0
    asd = speculative_generate(target, proposer, PROMPT, NEW, SamplingParams(0.0), 3, [],
                               asd=ASDConfig(budget=2.0, gate=0.5, max_mismatches=2))
    assert len(asd.tokens) == NEW and asd.tokens != reference
    with torch.no_grad():
        z = target(torch.tensor([PROMPT + asd.tokens])).logits[0, len(PROMPT) - 1:-1].double()  # row i scores token i
    regret = [float(z[i].max() - z[i, x]) for i, x in enumerate(asd.tokens)]
    assert 0 < asd.asd_regret <= 2.0 and sum(regret) == pytest.approx(asd.asd_regret, abs=1e-4)


def multimodal_gemma3(vocab: int, text: Optional[dict] = None, **top):
    """A tiny Gemma3ForConditionalGeneration: the matrix's Gemma 3 as its language model (`text`: more or other keys
    of it, e.g. its bos, eos, pad ids), a 1-layer vision tower; `top`: more Gemma3Config keys."""
    text = {**COMMON, "vocab_size": vocab, "head_dim": 16, "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2, **(text or {})}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2, image_token_index=vocab - 1, **top)).eval()


def tokenizer_ids(tokenizer) -> dict:
    """SmolLM2's bos and eos ids (eos doubling as padding), as a config takes them."""
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.eos_token_id}


def test_a_multimodal_gemma3_target_loads_as_its_language_model_and_decodes_exactly(tmp_path, smollm2_tokenizer):
    """Gemma 3 from 4B up is saved as Gemma3ForConditionalGeneration (a vision tower beside the language model):
    load_target keeps its language model as a Gemma3ForCausalLM, the same modules, the vision tower dropped; its
    logits on text equal the multimodal model's and the chain loop decodes it exactly."""
    multimodal = multimodal_gemma3(len(smollm2_tokenizer))
    multimodal.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    target, _ = load_target(str(tmp_path))
    assert type(target).__name__ == "Gemma3ForCausalLM" and target.config.model_type == "gemma3_text"
    assert not [n for n, _ in target.named_parameters() if "vision" in n]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids).logits, multimodal(input_ids=ids).logits)
    result = speculative_generate(target, DraftModelProposer(near_copy(target, 0.3)), PROMPT, 24, SamplingParams(0.0),
                                  3, [])
    assert result.tokens == greedy(multimodal, PROMPT, 24)
    assert any(c.accepted < 3 for c in result.cycles)  # rejections rolled back


# ------------------------------------------------------------------------------- data, training and export
# every non-Llama row, and Gemma 3 as published from 4B up (multimodal: Gemma3ForConditionalGeneration)
PIPELINE = ["qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "gemma3_mm", "gpt_oss", "deepseek_v3", "qwen3_next"]


# Targets whose last layer a DSpark layer cannot start from: Qwen3-Next's gated attention (q_proj twice a plain
# layer's) and DeepSeek-V3's MLA (o_proj reads heads × v_head_dim, not heads × head_dim).
UNFIT_LAYERS = {"qwen3_next": r"self_attn.q_proj.weight is \[128, 64\]", "deepseek_v3": r"self_attn.o_proj.weight is \[64, 64\]"}


# Targets beside which the engine serving a format cannot feed the drafter its trained features (export/engines.py):
# vLLM 0.33.0's Gemma 3 has no EAGLE-3 interface (it also serves the speculators format).
ENGINE_REFUSED = {name: "vLLM 0.33.0 cannot serve .* beside a Gemma 3 target .* no EAGLE-3 interface"
                  for name in ("gemma3", "gemma3_mm")}
# vLLM 0.33.0 cannot capture id 0 (the embedding) beside DeepSeek-V3: its head reads layers 1..3 (TINY's are 0..2)
EAGLE_IDS = {"deepseek_v3": ["drafter.eagle.aux_layer_ids=[1,2,3]"]}


TIE = 1e-2  # a top-2 logit margin this small may flip between a verify pass over k + 1 tokens and one-token steps


def assert_greedy_up_to_a_tie(target, prompt, answer):
    """`answer` is the target's greedy decoding of `prompt`, or leaves it only where the target's top two logits are
    within TIE, for the runner-up. A random target at SmolLM2's vocabulary of 49152 has flat logits (margins of 1e-3
    happen), and Qwen3-Next's linear attention rounds a chunk of k + 1 tokens differently from one-token steps."""
    reference = greedy(target, prompt, len(answer))
    at = next((i for i, (x, y) in enumerate(zip(answer, reference)) if x != y), None)
    if at is None:
        return
    with torch.no_grad():
        top = target(input_ids=torch.tensor([list(prompt) + answer[:at]])).logits[0, -1].double().topk(2)
    assert int(top.indices[1]) == answer[at] and float(top.values[0] - top.values[1]) < TIE, (at, top)


def saved_target(name, folder, tokenizer):
    """The architecture's tiny model at SmolLM2's vocabulary, saved with SmolLM2's tokenizer and chat template."""
    if name == "gemma3_mm":
        multimodal_gemma3(len(tokenizer), tokenizer_ids(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder
    config = ARCHS[name]()
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", PIPELINE)
def test_each_architecture_runs_the_data_job_trains_exports_and_decodes_exactly(
        name, tmp_path, prompt_file, smollm2_tokenizer, one_thread, in_process_training):
    """The path a user takes with a non-Llama target: the data job regenerates answers through it, EAGLE-3 and DSpark
    train on them (online features, the end-of-training decode check included), the vLLM / speculators exports load
    back, the exported drafters decode it greedy-exactly, and the eval job measures the EAGLE-3 run. Starting DSpark
    from the last layer of Qwen3-Next or DeepSeek-V3 is refused in one line that names the key to turn it off, and so
    is an export for an engine that cannot feed the drafter beside the target (Gemma 3 in vLLM): the checkpoint's own
    folder decodes there instead."""
    folder = saved_target(name, tmp_path / "target", smollm2_tokenizer)
    generate_dataset(small_data_recipe(tmp_path / "data", folder, prompt_file))
    if name in UNFIT_LAYERS:
        with pytest.raises(SpecdrafterError, match=rf"cannot copy target layer 3 into drafter layer 0: {UNFIT_LAYERS[name]}"
                                                   r" .*drafter.block.init_from_target=false"):
            train_loop.train(load_recipe(REPO / "recipes" / "smollm2-135m-dspark.yaml", [
                f"output_dir={tmp_path / 'refused'}", f"target.model={folder}", f"train.data_dir={tmp_path / 'data'}",
                *TINY]))
    rows = load_generated(tmp_path / "data")
    assert len(rows) == 8 and all(sum(r["loss_mask"]) == r["num_response_tokens"] > 0 for r in rows)
    # the folder's own tokenizer: beside a qwen2 config transformers reads SmolLM2's as Qwen2Tokenizer, whose
    # pre-tokenizer (Qwen's) splits digits and newlines otherwise
    target, tokenizer = load_target(str(folder))
    prompt = rows[0]["input_ids"][:rows[0]["num_prompt_tokens"]]
    reference = greedy(target, prompt, 16)
    fresh = ["drafter.block.init_from_target=false"] if name in UNFIT_LAYERS else []
    for kind, fmt in (("eagle3", "vllm"), ("dspark", "speculators")):
        run = tmp_path / kind
        train_loop.train(load_recipe(REPO / "recipes" / f"smollm2-135m-{kind}.yaml", [
            f"output_dir={run}", f"target.model={folder}", f"train.data_dir={tmp_path / 'data'}", *TINY, *fresh,
            *(EAGLE_IDS.get(name, []) if kind == "eagle3" else [])]))
        if name in ENGINE_REFUSED:
            with pytest.raises(SpecdrafterError, match=ENGINE_REFUSED[name]):
                export(run, fmt, tmp_path / f"{kind}-{fmt}")
            assert not (tmp_path / f"{kind}-{fmt}").exists()  # nothing half-written
            out = run / "drafter"
        else:
            out = export(run, fmt, tmp_path / f"{kind}-{fmt}")
        proposer = (EagleProposer(load_eagle3(out), target) if kind == "eagle3"
                    else BlockProposer(load_block_drafter(out), target))
        result = speculative_generate(target, proposer, prompt, 16, SamplingParams(0.0), 3, [])
        assert result.tokens == reference, kind
    # the eval job through our loop on the EAGLE-3 run: α and τ in range, every T = 0 answer the target's own (up to
    # a numerical tie: see assert_greedy_up_to_a_tie)
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-eagle3.yaml", [
        f"output_dir={tmp_path / 'eagle3'}", f"target.model={folder}", *TINY, f"eval.checkpoint={tmp_path / 'eagle3'}",
        f"eval.output_dir={tmp_path / 'eval'}", "eval.sets=[mtbench]", "eval.num_prompts=2", "eval.max_new_tokens=8",
        "eval.temperatures=[0]", "eval.verifiers=[chain]", "eval.k_sweep=[]", "eval.repeats=1"])
    out = evaluate(cfg)
    (cell,) = json.loads((out / "results.json").read_text())["cells"]
    assert 0 <= cell["alpha"] <= 1 and cell["tau"] >= 1
    answers = [json.loads(line)["tokens"] for line in (out / cell["outputs"]).read_text().splitlines()]
    prompts = [user_prompt_ids(tokenizer, r["turns"][0]) for r in load_sets(cfg.eval)["mtbench"]]
    assert len(answers) == 2 and all(answers)
    for answer, p in zip(answers, prompts):
        assert_greedy_up_to_a_tie(target, p, answer)


@pytest.mark.parametrize("fmt, family, arch, ids, refused", [
    ("vllm", Family.eagle, "Gemma3ForCausalLM", [2, 3], "vLLM 0.33.0 cannot serve .* no EAGLE-3 interface"),
    ("speculators", Family.block, "Gemma3ForConditionalGeneration", None, "vLLM 0.33.0 cannot serve"),
    ("sglang", Family.eagle, "Gemma3ForCausalLM", [2, 3], "last branch output, not the residual stream"),
    ("sglang", Family.block, "Gemma3ForCausalLM", None, "has no DFlash/DSpark capture"),
    ("vllm", Family.eagle, "DeepseekV3ForCausalLM", [0, 2, 3], "aux layer id 0 .* drafter.eagle.aux_layer_ids from 1"),
    ("speculators", Family.eagle, "DeepseekV3ForCausalLM", [0, 2, 3], "aux layer id 0"),
    ("vllm", Family.eagle, "DeepseekV3ForCausalLM", [1, 2, 3], None),
    ("vllm", Family.block, "Qwen3NextForCausalLM", None, None),
    ("sglang", Family.eagle, "GptOssForCausalLM", [1, 2, 3], None),
    ("gguf", Family.eagle, "Gemma3ForCausalLM", [1, 2, 3], None),  # export/gguf.py has llama.cpp's own checks
    ("hf-draft", Family.hf, "Gemma3ForCausalLM", None, None),  # a draft model reads no target features
    ("sglang", Family.block, "Qwen2ForCausalLM", None, "Qwen2 model .* has no DFlash/DSpark capture .* stops at start-up"),
    ("sglang", Family.eagle, "Qwen2ForCausalLM", [1, 2, 3], None),
    ("vllm", Family.block, "Qwen2ForCausalLM", None, None),
])
def test_an_engine_that_cannot_feed_the_drafter_its_features_is_one_line(fmt, family, arch, ids, refused):
    """export/engines.py: read from vLLM 0.33.0's and SGLang 0.5.23's source (docs/targets.md#feature-layers)."""
    if refused is None:
        check_engine_target(fmt, family, "a drafter", [arch], ids)
    else:
        with pytest.raises(SpecdrafterError, match=refused):
            check_engine_target(fmt, family, "a drafter", [arch], ids)


# ------------------------------------------------------------------------------------------- the matrix's edge
@pytest.mark.parametrize("name", list(ARCHS))
def test_every_architecture_of_the_matrix_is_accepted(name):
    check_architecture(ARCHS[name]())


@pytest.mark.parametrize("config, nearest", [
    (lambda: MinistralConfig(**COMMON, sliding_window=None), "mistral"),  # by name
    (lambda: Phi3Config(**COMMON), "llama"),  # nothing alike: the Llama row
    (lambda: MixtralConfig(**COMMON, num_local_experts=4), "qwen3_moe"),  # experts, no window
    (lambda: Cohere2Config(**COMMON, sliding_window=WINDOW), "gemma3_text"),  # sliding + full layers
])
def test_an_architecture_outside_the_matrix_is_one_line_naming_the_nearest(config, nearest, tmp_path,
                                                                           smollm2_tokenizer):
    cfg = config()
    with pytest.raises(SpecdrafterError, match=rf"{cfg.model_type!r} is not in the target matrix .* nearest "
                                               rf"supported one is {nearest!r}.*untested_architecture=true"):
        check_architecture(cfg)
    check_architecture(cfg, untested_ok=True)


def test_load_target_refuses_an_unlisted_architecture_unless_asked(tmp_path, smollm2_tokenizer):
    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(**{**COMMON, "vocab_size": len(smollm2_tokenizer)})).save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(SpecdrafterError, match="'phi3' is not in the target matrix"):
        load_target(str(tmp_path))
    model, _ = load_target(str(tmp_path), untested_architecture=True)
    assert model.config.model_type == "phi3"
