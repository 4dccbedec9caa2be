"""Every drafter kind loads every format it exports, and the EAGLE-3 layouts the public trainers write: a random
(train-free) tiny drafter → our exporter (export/formats.py) → our loader gives identical tensors and identical
logits on a fixed input. SpecForge / EAGLE-repo and speculators 0.9 folders are written here with those trainers'
own config keys and tensor names (not through our exporter), from a head whose logits they must reproduce; what our
head cannot compute is refused in one line naming it."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_llama_config
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.export.formats import export
from specdrafter.inference.decode import speculative_generate
from specdrafter.inference.sampling import SamplingParams
from specdrafter.jobs.decode import build_proposer
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, check_drafter_folder, drafter_path, kind_of, kind_of_config
from specdrafter.models.eagle import Eagle3Head, check_head_fits, eagle3_config, load_eagle3, save_eagle3
from specdrafter.models.medusa import MedusaHeads, load_medusa, medusa_config, save_medusa

RECIPES = {"eagle3": "smollm2-135m-eagle3", "medusa": "smollm2-135m-medusa", "draft_model": "smollm2-135m-draft"}
AUX, VD, T = [1, 2, 3], 64, 6  # our aux-layer ids (inputs to target layers 1..3), draft vocabulary, test positions


# ---------------------------------------------------------------------------------------------- fixtures
def tiny_target(folder: Path, tokenizer, layers: int):
    """A random Llama (hidden 32) with SmolLM2's tokenizer; its lm_head sharpened so greedy decoding is not noise."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), num_hidden_layers=layers, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target4(tmp_path_factory, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp("target4")
    return folder, tiny_target(folder, smollm2_tokenizer, 4)


@pytest.fixture(scope="module")
def target8(tmp_path_factory, smollm2_tokenizer):
    """8 layers: the trainers' default aux layers [2, L // 2, L − 3] = [2, 4, 5] are distinct and increasing."""
    folder = tmp_path_factory.mktemp("target8")
    return folder, tiny_target(folder, smollm2_tokenizer, 8)


def recipe(kind: str, target_dir: Path, run: Path, *extra):
    return load_recipe(REPO / "recipes" / f"{RECIPES[kind]}.yaml",
                       [f"output_dir={run}", f"target.model={target_dir}", f"train.data_dir={run / 'data'}",
                        "train.wandb.mode=disabled", "inference.k=3", *extra])


def training_checkpoint(run: Path, kind: str, target_dir: Path, save) -> Path:
    """A checkpoint folder as training leaves it (drafter/, recipe.yaml, trainer_state.json) around `save(folder)`."""
    folder = run / "checkpoints" / "step-000004"
    save(folder / "drafter")
    (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(recipe(kind, target_dir, run)))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "tokens": 100, "drafter": kind, "metrics": {}}))
    return folder


def random_eagle3_head(target, aux=AUX, vd=VD, rope_theta=10000.0) -> Eagle3Head:
    """Every tensor random (norm weights too, so a norm mapped to the wrong place shows), a draft vocabulary that
    is not the first Vd ids (or the identity maps of a full one)."""
    config = eagle3_config(target.config, aux, vd)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    torch.manual_seed(1)
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        V = target.config.vocab_size
        if vd < V:
            ids = torch.randperm(V)[:vd].sort().values
            head.d2t.copy_(ids - torch.arange(vd))
            head.t2d.zero_()
            head.t2d[ids] = True
        else:
            head.t2d.fill_(True)
    return head.eval()


def draft_logits(head: Eagle3Head) -> torch.Tensor:
    """The head's logits on a fixed input: seeded features of its aux layers and token embeddings, causal mask."""
    g = torch.Generator().manual_seed(0)
    features = {k: torch.randn(1, T, head.config.target_hidden_size, generator=g) for k in head.aux_layer_ids}
    embeds = torch.randn(1, T, head.config.hidden_size, generator=g)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        hidden, _ = head(head.fuse(features), embeds, torch.arange(T)[None], causal)
        return head.logits(hidden)  # [1, T, Vd]


def assert_same_head(loaded: Eagle3Head, head: Eagle3Head) -> None:
    assert loaded.aux_layer_ids == head.aux_layer_ids
    assert set(loaded.state_dict()) == set(head.state_dict())
    for name, tensor in head.state_dict().items():
        assert loaded.state_dict()[name].dtype == tensor.dtype and torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(draft_logits(loaded), draft_logits(head))


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# ------------------------------------------------------------------------------------ our exports round trip
@pytest.mark.parametrize("vocab", ["pruned", "full"])
@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_each_eagle3_export_loads_back_identically(tmp_path, target4, fmt, vocab):
    target_dir, target = target4
    head = random_eagle3_head(target, vd=VD if vocab == "pruned" else target.config.vocab_size)
    ckpt = training_checkpoint(tmp_path / "run", "eagle3", target_dir, lambda f: save_eagle3(head, f))
    out = export(ckpt, fmt, tmp_path / fmt)
    assert kind_of_config(config_of(out)) is KINDS["eagle3"]
    check_drafter_folder(out, KINDS["eagle3"])  # what the decode CLI and the eval job check first
    assert_same_head(load_eagle3(out), head)  # sglang: its ids k − 1 read back as ours; full: identity maps filled in


@pytest.mark.parametrize("fmt", ["medusa-vllm", "medusa"])
def test_each_medusa_export_loads_back_identically(tmp_path, target4, fmt):
    target_dir, target = target4
    torch.manual_seed(2)
    heads = MedusaHeads(medusa_config(target.config, 5, 2))  # the Medusa repo's loader builds exactly 5 heads
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        if fmt == "medusa":  # the repo repeats one ResBlock per head: its export needs equal blocks
            for block in heads.blocks:
                block.layers[1].load_state_dict(block.layers[0].state_dict())
    ckpt = training_checkpoint(tmp_path / "run", "medusa", target_dir, lambda f: save_medusa(heads, f))
    out = export(ckpt, fmt, tmp_path / fmt)
    assert kind_of_config(config_of(out)) is KINDS["medusa"]
    check_drafter_folder(out, KINDS["medusa"])
    loaded = load_medusa(out)
    assert (loaded.num_heads, loaded.config.num_hidden_layers, loaded.config.medusa_fc_bias) == (5, 2, True)
    assert set(loaded.state_dict()) == set(heads.state_dict())
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hidden = torch.randn(1, T, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))


def test_the_hf_draft_export_loads_back_identically(tmp_path, target4, smollm2_tokenizer):
    target_dir, target = target4
    torch.manual_seed(3)
    draft = LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer), num_hidden_layers=1)).eval()

    def save(folder):
        draft.save_pretrained(folder)
        smollm2_tokenizer.save_pretrained(folder)
    ckpt = training_checkpoint(tmp_path / "run", "draft_model", target_dir, save)
    out = export(ckpt, "hf-draft", tmp_path / "hf-draft")
    assert kind_of_config(config_of(out)) is KINDS["draft_model"]
    served = recipe("draft_model", target_dir, tmp_path / "run", f"drafter.path={out}")
    loaded = kind_of(served).decoding.assistant_model(served, target, drafter_path(served))
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.tensor([[1, 9690, 198, 504, 3287, 314]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, draft(ids).logits)


# ------------------------------------------------------------------------------- layouts trained elsewhere
def layer_keys(config) -> dict:
    """The one-layer Llama settings a trainer writes for the head's decoder layer."""
    return {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
            "vocab_size": config.vocab_size, "num_hidden_layers": 1, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2}


def write_folder(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def speculators_folder(folder: Path, head: Eagle3Head, arch: str = "Eagle3DraftModel", config=None,
                       tensors=None) -> Path:
    """What speculators 0.9's save_pretrained writes for an Eagle3 draft model (Eagle3Speculator in earlier
    releases): its config (no model_type; the decoder layer in transformer_layer_config, RoPE as
    rope_parameters) and its tensors — layers.0.*, fc, norm, lm_head, d2t, t2d and the verifier's embed_tokens."""
    c = head.config
    layer = {**layer_keys(c), "model_type": "llama", "rope_parameters": dict(c.rope_parameters), "pretraining_tp": 1,
             "use_cache": True, "pad_token_id": None, "initializer_range": 0.02, "attention_dropout": 0.0,
             "transformers_version": "5.24.0"}
    written = {
        "architectures": [arch], "auto_map": {"": "config.Eagle3SpeculatorConfig"}, "dtype": "float32",
        "draft_vocab_size": c.draft_vocab_size, "eagle_aux_hidden_state_layer_ids": head.aux_layer_ids,
        "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": False, "norm_before_residual": False,
        "norm_output": False, "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": 3, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "some/target"}},
        "target_hidden_size": None, "tie_word_embeddings": False, "transformer_layer_config": layer,
        "transformers_version": "5.24.0", **(config or {})}
    weights = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in head.state_dict().items()}
    weights["embed_tokens.weight"] = torch.randn(c.vocab_size, c.hidden_size)  # the verifier's, frozen
    return write_folder(folder, written, {**weights, **(tensors or {})})


def specforge_folder(folder: Path, head: Eagle3Head, sglang_ids=None, arch="LlamaForCausalLMEagle3", config=None,
                     tensors=None, embed=True) -> Path:
    """What SpecForge writes (configs/*-eagle3.json + its export; the EAGLE repo's the same with
    architectures LlamaForCausalLM): a Llama config with draft_vocab_size, legacy rope_theta, aux ids — if any —
    in eagle_config as layer outputs (SGLang's reading); tensors midlayer.*, fc, norm, lm_head, d2t, t2d and, in
    its HF export, the target's embed_tokens."""
    c = head.config
    written = {**layer_keys(c), "architectures": [arch], "model_type": "llama", "draft_vocab_size": c.draft_vocab_size,
               "rope_theta": c.rope_parameters["rope_theta"], "rope_scaling": None, "pad_token_id": 0,
               "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True, "transformers_version": "4.53.2",
               **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids}} if sglang_ids is not None else {}),
               **(config or {})}
    weights = dict(head.state_dict())
    if embed:
        weights["embed_tokens.weight"] = torch.randn(c.vocab_size, c.hidden_size)
    return write_folder(folder, written, {**weights, **(tensors or {})})


@pytest.mark.parametrize("arch", ["Eagle3DraftModel", "Eagle3Speculator"])
def test_a_speculators_checkpoint_loads_with_identical_logits(tmp_path, target4, arch):
    head = random_eagle3_head(target4[1], rope_theta=50000.0)  # a non-default RoPE base must come through
    folder = speculators_folder(tmp_path / "speculators", head, arch)
    assert kind_of_config(config_of(folder)) is KINDS["eagle3"]
    check_drafter_folder(folder, KINDS["eagle3"])
    loaded = load_eagle3(folder)
    assert loaded.config.rope_parameters["rope_theta"] == 50000.0 and loaded.config.target_hidden_size == 32
    assert_same_head(loaded, head)  # layers.0.* → midlayer.*, the verifier's embedding dropped


@pytest.mark.parametrize("source", ["specforge", "specforge-hf-export", "eagle-repo"])
def test_specforge_and_eagle_repo_checkpoints_load_with_identical_logits(tmp_path, target4, source):
    head = random_eagle3_head(target4[1], rope_theta=50000.0)
    arch = "LlamaForCausalLM" if source == "eagle-repo" else "LlamaForCausalLMEagle3"
    folder = specforge_folder(tmp_path / source, head, [k - 1 for k in AUX], arch, embed=source != "specforge")
    assert kind_of_config(config_of(folder)) is KINDS["eagle3"]
    check_drafter_folder(folder, KINDS["eagle3"])
    assert_same_head(load_eagle3(folder), head)  # SGLang's ids [0, 1, 2] are our [1, 2, 3]


def test_a_head_without_aux_layer_ids_gets_the_trainers_default_and_decodes_exactly(tmp_path, target8,
                                                                                     smollm2_tokenizer):
    target_dir, target = target8
    head = random_eagle3_head(target, aux=[2, 4, 5])  # what SpecForge captures by default on an 8-layer target
    folder = specforge_folder(tmp_path / "specforge", head)  # its stock configs name no aux layers
    loaded = load_eagle3(folder)
    assert loaded.aux_layer_ids == []  # the default depends on the target
    check_head_fits(loaded, target)
    assert_same_head(loaded, head)
    cfg = recipe("eagle3", target_dir, tmp_path / "run", f"drafter.path={folder}")
    proposer = build_proposer(cfg, target)  # the kind's proposer, as jobs/decode.py:load_decoder builds it
    assert proposer.feature_layers == [2, 4, 5]
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about rivers."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    result = speculative_generate(target, proposer, prompt, 12, SamplingParams(0.0), 3)
    plain = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert result.tokens == plain  # greedy speculative decoding through the loaded head = the target's own


REFUSED = [  # (layout, config changes, extra tensors, what the one line must say)
    ("speculators", {"norm_before_residual": True}, {}, r"norm_before_residual = true \(the normalised hidden state as "
                                                        r"the residual\)"),
    ("speculators", {"norm_before_fc": True, "fc_norm": True},  # EAGLE-3.1's norms alone load: tests/test_eagle31.py
     {"input_norm.weight": torch.ones(96), **{f"fc_norm.{i}.weight": torch.ones(32) for i in range(3)}},
     r"fc_norm and norm_before_fc are both true"),
    ("speculators", {"fc_norm": True}, {}, r"missing fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight"),
    ("speculators", {"embed_requires_grad": True}, {}, r"embed_requires_grad = true \(a token embedding trained"),
    ("speculators", {"layer": {"model_type": None}}, {}, r"transformer_layer_config.model_type = 'qwen3'"),
    ("speculators", {"layer": {"num_hidden_layers": 2}}, {"layers.1.input_layernorm.weight": torch.ones(32)},
     r"transformer_layer_config.num_hidden_layers = 2; specdrafter's head has one decoder layer"),
    ("speculators", {"speculators_model_type": "eagle"}, {}, r"is not an EAGLE-3 head checkpoint .*"
                                                             r"speculators_model_type: 'eagle'"),
    ("specforge", {}, {f"fc_norm.{i}.weight": torch.ones(32) for i in range(3)},
     r"fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight have no counterpart"),
    ("specforge", {}, {"midlayer.self_attn.q_norm.weight": torch.ones(8)},
     r"do not fit an EAGLE-3 head of its config.json: midlayer.self_attn.q_norm.weight has no counterpart"),
    ("specforge", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, {},
     r"eagle_config.eagle_aux_hidden_state_layer_ids = \[1, 2\]; an EAGLE-3 head reads three target layers"),
]


@pytest.mark.parametrize("layout, changes, tensors, message", REFUSED, ids=[f"{r[0]}-{r[3][:24]}" for r in REFUSED])
def test_what_our_head_cannot_compute_is_refused_in_one_line(tmp_path, target4, layout, changes, tensors, message):
    head = random_eagle3_head(target4[1])
    if layout == "speculators":
        folder = speculators_folder(tmp_path / layout, head, tensors=tensors,
                                    config={k: v for k, v in changes.items() if k != "layer"})
        if "layer" in changes:
            config = config_of(folder)
            layer = {**config["transformer_layer_config"], **changes["layer"]}
            config["transformer_layer_config"] = {k: v for k, v in layer.items() if v is not None}
            (folder / "config.json").write_text(json.dumps(config))
    else:
        folder = specforge_folder(tmp_path / layout, head, [0, 1, 2], config=changes, tensors=tensors)
    with pytest.raises(SpecdrafterError, match=message) as e:
        load_eagle3(folder)
    assert "\n" not in str(e.value) and str(folder) in str(e.value)
