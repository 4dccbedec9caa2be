"""Export (export/formats.py, launch/export.py) on a tiny random Llama with SmolLM2's tokenizer: each format's config
fields and tensor names exactly as docs/formats.md lists them, the round trip back to our inference module with
identical draft logits and greedy decoding, SGLang's shifted aux-layer ids, the model card, no local paths or tokens
in any exported file, and one-line refusals of bad input and failed pushes (with the local export left intact)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2
import huggingface_hub.constants
import pytest
import torch
import yaml
from conftest import sharp_target
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.export.formats import export, push_to_hub
from specdrafter.inference.decode import speculative_generate
from specdrafter.inference.eagle import EagleProposer
from specdrafter.inference.medusa import MedusaProposer
from specdrafter.inference.proposers import DraftModelProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import build_drafter
from specdrafter.models.eagle import Eagle3Head, full_vocab_maps, load_eagle3
from specdrafter.models.medusa import MedusaConfig, MedusaHeads, load_medusa

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"draft_model": "smollm2-135m-draft", "medusa": "smollm2-135m-medusa", "eagle3": "smollm2-135m-eagle3",
           "eagle1": "smollm2-135m-eagle3"}
TINY = ["drafter.num_layers=2", "drafter.eagle.aux_layer_ids=[1,2,3]", "drafter.eagle.draft_vocab_size=1024",
        "drafter.medusa.num_heads=3", "inference.k=3", "train.wandb.mode=disabled"]
FAKE_TOKEN = "hf_" + "FakeTokenForTheLeakTest" * 2
GREEDY = SamplingParams(0.0)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 4-layer random Llama (hidden 32) with SmolLM2's tokenizer; its lm_head sharpened so decoding is not noise."""
    return sharp_target(tmp_path_factory.mktemp("export-target"), smollm2_tokenizer, num_hidden_layers=4)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, target_dir, target, smollm2_tokenizer):
    """checkpoint(kind, *overrides) → (run dir, checkpoint folder, trained module): a drafter built from the
    recipe, its weights moved off their initial values, saved as training saves it (step 4)."""
    made = {}

    def make(kind, *extra):
        key = (kind, extra)
        if key not in made:
            run = tmp_path_factory.mktemp(f"run-{kind}")
            cfg = load_recipe(REPO / "recipes" / f"{RECIPES[kind]}.yaml",
                              [f"output_dir={run}", f"target.model={target_dir}", f"train.data_dir={run / 'data'}",
                               f"drafter.kind={kind}", *TINY, *extra])
            drafter = build_drafter(cfg, target, None, smollm2_tokenizer)
            torch.manual_seed(1)
            with torch.no_grad():
                for q in drafter.module.parameters():
                    if q.requires_grad:
                        q.add_(0.05 * torch.randn_like(q))
                Vd = len(drafter.module.d2t) if kind == "eagle3" else 0
                if 0 < Vd < target.config.vocab_size:  # a draft vocabulary that is not just the first Vd ids
                    ids = torch.randperm(target.config.vocab_size)[:Vd].sort().values
                    drafter.module.d2t.copy_(ids - torch.arange(Vd))
                    drafter.module.t2d.zero_()
                    drafter.module.t2d[ids] = True
            folder = run / "checkpoints" / "step-000004"
            drafter.save(drafter.module, folder / "drafter", smollm2_tokenizer)
            (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
            (run / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
            metrics = {f"{m}/{n}": 0.5 - 0.1 * i for i, n in enumerate(drafter.prediction_names) for m in ("alpha", "top1")}
            (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "tokens": 1000, "drafter": kind,
                                                                   "metrics": metrics}))
            shutil.copytree(folder / "drafter", run / "drafter")
            made[key] = (run, folder, drafter.module.eval())
        return made[key]
    return make


def weight_shapes(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def prompt_ids(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about rivers."}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def eagle3_from_export(folder: Path, fmt: str) -> Eagle3Head:
    """Map an engine folder back onto our Eagle3Head: speculators' layers.0.* → midlayer.*, SGLang's ids + 1."""
    c, weights = config(folder), load_file(str(folder / "model.safetensors"))
    if fmt == "speculators":
        layer, ids = c["transformer_layer_config"], c["eagle_aux_hidden_state_layer_ids"]
        weights = {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in weights.items()}
    else:
        layer, ids = c, c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        if fmt == "sglang":
            ids = [k + 1 for k in ids]
    head = Eagle3Head(LlamaConfig(**{**layer, "draft_vocab_size": c["draft_vocab_size"], "target_hidden_size":
                                     c["target_hidden_size"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}))
    head.load_state_dict(full_vocab_maps(head, weights))  # a full-vocabulary export has no d2t / t2d
    return head.eval()


def medusa_from_repo_layout(folder: Path) -> MedusaHeads:
    c, weights = config(folder), load_file(str(folder / "medusa_lm_head.safetensors"))
    L = c["medusa_num_layers"]
    d, V = weights["0.0.linear.weight"].shape[0], weights[f"0.{L}.weight"].shape[0]
    heads = MedusaHeads(MedusaConfig(num_heads=c["medusa_num_heads"], num_hidden_layers=L, hidden_size=d, vocab_size=V,
                                     medusa_fc_bias=True))
    ours = {}
    for name, t in weights.items():
        i, j, rest = name.split(".", 2)
        ours[f"blocks.{i}.layers.{j}.{rest.split('.')[-1]}" if int(j) < L else f"lm_heads.{i}.weight"] = t
    heads.load_state_dict(ours)
    return heads.eval()


def eagle_logits(head, target, ids):
    """Draft logits of a head fed the target's features of `ids` (one step, all positions)."""
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        features = {k: out.hidden_states[k] for k in head.aux_layer_ids}  # HF hidden_states[k] = input to layer k
        embeds = target.get_input_embeddings()(torch.roll(ids, -1, 1))
        hidden, _ = head(head.fuse(features), embeds, torch.arange(ids.shape[1])[None])
        return head.logits(hidden)


IDS = torch.tensor([[1, 9690, 198, 504, 3287, 314, 253, 2114]])


# ------------------------------------------------------------------------------------------------ EAGLE-3
EAGLE3_LAYER = {"self_attn.q_proj.weight": (32, 64), "self_attn.k_proj.weight": (16, 64), "self_attn.v_proj.weight": (16, 64),
                "self_attn.o_proj.weight": (32, 32), "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
                "mlp.down_proj.weight": (32, 64), "input_layernorm.weight": (32,), "hidden_norm.weight": (32,),
                "post_attention_layernorm.weight": (32,)}  # q/k/v read 2 × hidden (embedding ‖ hidden state)


def eagle3_weights(prefix: str, V: int) -> dict:
    return {**{prefix + k: (s, "F32") for k, s in EAGLE3_LAYER.items()}, "fc.weight": ((32, 96), "F32"),
            "norm.weight": ((32,), "F32"), "lm_head.weight": ((1024, 32), "F32"), "d2t": ((1024,), "I64"),
            "t2d": ((V,), "BOOL")}


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_eagle3_exports_load_back_with_identical_logits(tmp_path, fmt, checkpoint, target, target_dir, smollm2_tokenizer):
    _, folder, head = checkpoint("eagle3")
    out = export(folder, fmt, tmp_path / fmt)
    c, V = config(out), target.config.vocab_size
    assert weight_shapes(out / "model.safetensors") == eagle3_weights("layers.0." if fmt == "speculators" else "midlayer.", V)
    if fmt == "speculators":
        assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
        assert c["speculators_config"] == {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target_dir.name, "architectures": ["LlamaForCausalLM"]}}  # a local target: its name
        layer = c["transformer_layer_config"]
        assert (c["draft_vocab_size"], c["target_hidden_size"], c["eagle_aux_hidden_state_layer_ids"]) == (1024, 32, [1, 2, 3])
        assert c["norm_before_residual"] is False  # our residual is the un-normalised hidden state; speculators defaults to true
    else:
        layer = c
        assert c["architectures"] == ["LlamaForCausalLMEagle3"]
        assert (c["draft_vocab_size"], c["target_hidden_size"], c["tie_word_embeddings"]) == (1024, 32, False)
        assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3] if fmt == "vllm" else [0, 1, 2],
                                     "use_aux_hidden_state": True}  # SGLang: ours − 1; no key only we would read
        assert c.get("eagle_aux_hidden_state_layer_ids") == ([1, 2, 3] if fmt == "vllm" else None)  # vLLM's top-level key
    expected = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
                "vocab_size": V, "tie_word_embeddings": False}
    assert {k: layer[k] for k in expected} == expected

    reloaded = load_eagle3(out) if fmt == "vllm" else eagle3_from_export(out, fmt)  # vllm: our own loader, unchanged
    assert reloaded.aux_layer_ids == [1, 2, 3]
    torch.testing.assert_close(eagle_logits(reloaded, target, IDS), eagle_logits(head, target, IDS), rtol=0, atol=0)
    if fmt == "vllm":  # decoding through the exported head = through the trained one = the target's greedy output
        assert_decodes_alike(target, EagleProposer(reloaded, target), EagleProposer(head, target), smollm2_tokenizer)


def assert_decodes_alike(target, exported, trained, tokenizer):
    """Greedy decoding through the exported drafter = through the trained one (cycle by cycle) = the target's own."""
    prompt = prompt_ids(tokenizer)
    mine = speculative_generate(target, exported, prompt, 16, GREEDY, 3)
    theirs = speculative_generate(target, trained, prompt, 16, GREEDY, 3)
    plain = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    assert mine.tokens == theirs.tokens == plain
    assert [s.accepted for s in mine.cycles] == [s.accepted for s in theirs.cycles]


def test_sglang_cannot_express_the_embeddings_as_an_aux_layer(tmp_path, checkpoint):
    _, folder, _ = checkpoint("eagle3", "drafter.eagle.aux_layer_ids=[0,2,3]")
    out = export(folder, "vllm", tmp_path / "v")
    assert config(out)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    card = (out / "README.md").read_text()
    assert "id 0 is the token embedding, which vLLM captures" in card and "cannot capture" not in card
    with pytest.raises(SpecdrafterError, match="aux layer id 0 .* cannot be written for SGLang .* unverified"):
        export(folder, "sglang", tmp_path / "s")
    assert not (tmp_path / "s").exists() and [p.name for p in tmp_path.iterdir()] == ["v"]  # no temp folder left


def test_sglang_cannot_express_the_last_layers_output(tmp_path, checkpoint):
    _, folder, _ = checkpoint("eagle3", "drafter.eagle.aux_layer_ids=[1,2,4]")  # 4 = the tiny target's last layer
    with pytest.raises(SpecdrafterError, match=r"aux layer id 4 \(the last layer's output\) cannot be written for "
                                               r"SGLang .* input to layer 4, which its 4-layer loop never reaches.* "
                                               r"--format vllm and speculators carry id 4") as e:
        export(folder, "sglang", tmp_path / "s")
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()
    for fmt in ("vllm", "speculators"):
        assert config(export(folder, fmt, tmp_path / fmt))["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    bare = tmp_path / "bare" / "drafter"  # no recipe beside it: the target's layer count is unknown
    shutil.copytree(folder / "drafter", bare)
    with pytest.raises(SpecdrafterError, match="--format sglang checks the aux layer ids against the target's layer "
                                               "count, but no config.json of the target"):
        export(bare, "sglang", tmp_path / "s")


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_a_full_vocabulary_head_exports_without_d2t_and_t2d(tmp_path, fmt, checkpoint, target):
    _, folder, head = checkpoint("eagle3", "drafter.eagle.draft_vocab_size=0")  # the schema's default: Vd = V
    out = export(folder, fmt, tmp_path / fmt)
    V, tensors = target.config.vocab_size, weight_shapes(out / "model.safetensors")
    assert "d2t" not in tensors and "t2d" not in tensors and tensors["lm_head.weight"][0] == (V, 32)
    assert config(out)["draft_vocab_size"] == V  # vLLM then has no draft-to-target map: a d2t tensor would fail
    reloaded = load_eagle3(out) if fmt == "vllm" else eagle3_from_export(out, fmt)  # identity maps filled in
    assert torch.equal(reloaded.d2t, head.d2t) and torch.equal(reloaded.t2d, head.t2d)
    torch.testing.assert_close(eagle_logits(reloaded, target, IDS), eagle_logits(head, target, IDS), rtol=0, atol=0)
    if fmt == "vllm":  # a full vocabulary whose d2t is not the identity cannot be written without d2t
        bad = shutil.copytree(folder, tmp_path / "bad")
        weights = load_file(str(bad / "drafter" / "model.safetensors"))
        weights["d2t"][0] = 1
        save_file(weights, str(bad / "drafter" / "model.safetensors"))
        with pytest.raises(SpecdrafterError, match="has a full draft vocabulary .* but d2t/t2d are not the identity"):
            export(bad, fmt, tmp_path / "b")


@pytest.mark.parametrize("ids, what", [([3, 1, 2], "are not in increasing order"), ([1, 1, 3], "repeat a layer")])
def test_a_head_with_unsorted_or_repeated_aux_ids_is_refused(tmp_path, ids, what, checkpoint):
    _, folder, _ = checkpoint("eagle3")
    bad = shutil.copytree(folder, tmp_path / "ckpt")
    c = config(bad / "drafter")
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (bad / "drafter" / "config.json").write_text(json.dumps(c))
    for fmt in ("vllm", "sglang", "speculators"):
        with pytest.raises(SpecdrafterError, match=re.escape(f"drafter.eagle.aux_layer_ids = {ids} {what}: engines "
                                                             "capture each aux layer once, in layer order") +
                           ".*retrain the head") as e:
            export(bad, fmt, tmp_path / fmt)
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_each_engine_export_says_what_the_other_engine_would_capture(tmp_path, checkpoint):
    _, folder, _ = checkpoint("eagle3")
    v, s = export(folder, "vllm", tmp_path / "v"), export(folder, "sglang", tmp_path / "s")
    assert "aux_layer_id_convention" not in (v / "config.json").read_text() + (s / "config.json").read_text()
    assert "eagle_aux_hidden_state_layer_ids" not in config(s)  # the top-level key is vLLM's: SGLang reads eagle_config
    card = (v / "README.md").read_text()
    assert "**Served by SGLang**" in card and "inputs to layers [2, 3, 4], one layer later than trained" in card
    card = (s / "README.md").read_text()
    assert "**Served by vLLM**" in card and "the head was trained on [1, 2, 3]" in card
    assert "one layer earlier than trained" in card and "falls back to its default layers" in card


def test_cards_name_the_engine_versions_that_load_each_export(tmp_path, checkpoint):
    _, eagle, _ = checkpoint("eagle3")
    _, medusa, _ = checkpoint("medusa")

    def card(folder, fmt):
        return (export(folder, fmt, tmp_path / fmt) / "README.md").read_text()
    both, library = "vLLM 0.32.0 and 0.33.0", "the speculators library's own loader"
    sglang = ("SGLang 0.5.23 loads this folder unchanged: its weight loader maps every tensor (checked on CPU; its module "
              "needs CUDA and was not built; other versions are not checked).")
    for fmt, engines in [("vllm", f"{both} load this folder unchanged (other versions are not checked)."),
                         ("speculators", f"{both} and {library} load this folder unchanged (other versions are not checked)."),
                         ("sglang", sglang)]:
        text = card(eagle, fmt)
        assert f"**Engine versions:** {engines}" in text
        assert "The EAGLE repo's own `EaModel` is not supported" in text
    text = card(medusa, "medusa-vllm")
    assert "vLLM 0.32.0 loads this folder unchanged; vLLM 0.33 has no Medusa method" in text
    assert "pin `vllm==0.32.0`" in text
    assert "`drafter.kind=eagle3`" in text and "EaModel" not in text


def test_speculators_names_the_hub_id_of_a_converted_builtin_target_and_explains_a_local_one(tmp_path, checkpoint,
                                                                                            target_dir):
    _, folder, _ = checkpoint("eagle3")
    local = export(folder, "speculators", tmp_path / "local")
    card = (local / "README.md").read_text()
    assert config(local)["speculators_config"]["verifier"]["name_or_path"] == target_dir.name
    assert f"holds only its folder name `{target_dir.name}`" in card and "```bash\nvllm serve ./local\n```" not in card
    assert f"vllm serve <path to {target_dir.name}> --speculative-config" in card
    converted = tmp_path / "cache" / "SmolLM2-135M-Instruct"  # specdrafter's converted copy of the built-in target
    shutil.copytree(target_dir, converted)
    (converted / "conversion_check.json").write_text(json.dumps({"identical": True}))
    ckpt = shutil.copytree(folder, tmp_path / "ckpt")
    recipe = OmegaConf.load(ckpt / "recipe.yaml")
    recipe.target.model = str(converted)
    (ckpt / "recipe.yaml").write_text(OmegaConf.to_yaml(recipe))
    out = export(ckpt, "speculators", tmp_path / "hub")
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config(out)["speculators_config"]["verifier"] == {"name_or_path": hub_id, "architectures": ["LlamaForCausalLM"]}
    card = (out / "README.md").read_text()
    assert front_matter(card)["base_model"] == hub_id and "```bash\nvllm serve ./hub\n```" in card
    assert yaml.safe_load((out / "recipe.yaml").read_text())["target"]["model"] == hub_id


# ------------------------------------------------------------------------------------------------- Medusa
@pytest.mark.parametrize("fmt", ["medusa-vllm", "medusa"])
def test_medusa_exports_load_back_and_decode_like_the_target(tmp_path, fmt, checkpoint, target, target_dir,
                                                             smollm2_tokenizer):
    n = 5 if fmt == "medusa" else 3  # the Medusa repo's loader builds 5 heads whatever the config says
    _, folder, heads = checkpoint("medusa", *([f"drafter.medusa.num_heads={n}"] if n != 3 else []))
    out = export(folder, fmt, tmp_path / fmt)
    c, V = config(out), target.config.vocab_size
    if fmt == "medusa-vllm":
        assert {k: c[k] for k in ("architectures", "model_type", "num_heads", "num_hidden_layers", "hidden_size",
                                  "vocab_size", "medusa_fc_bias")} == {
            "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1,
            "hidden_size": 32, "vocab_size": V, "medusa_fc_bias": True}
        assert weight_shapes(out / "model.safetensors") == {
            **{f"blocks.{i}.layers.0.weight": ((32, 32), "F32") for i in range(3)},
            **{f"blocks.{i}.layers.0.bias": ((32,), "F32") for i in range(3)},
            **{f"lm_heads.{i}.weight": ((V, 32), "F32") for i in range(3)}}
        reloaded = load_medusa(out)
    else:
        assert c == {"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": target_dir.name}
        assert not (out / "model.safetensors").exists()
        assert weight_shapes(out / "medusa_lm_head.safetensors") == {
            **{f"{i}.0.linear.weight": ((32, 32), "F32") for i in range(5)},
            **{f"{i}.0.linear.bias": ((32,), "F32") for i in range(5)},
            **{f"{i}.1.weight": ((V, 32), "F32") for i in range(5)}}
        reloaded = medusa_from_repo_layout(out)
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(reloaded(hidden), heads(hidden), rtol=0, atol=0)
    assert_decodes_alike(target, MedusaProposer(reloaded, target), MedusaProposer(heads, target), smollm2_tokenizer)


def test_medusa_repo_layout_refuses_distinct_resblocks_it_would_tie(tmp_path, checkpoint):
    _, folder, _ = checkpoint("medusa", "drafter.medusa.num_layers=2", "drafter.medusa.num_heads=5")
    with pytest.raises(SpecdrafterError, match=r"repeats one ResBlock per head .* --format medusa-vllm"):
        export(folder, "medusa", tmp_path / "m")
    shapes = weight_shapes(export(folder, "medusa-vllm", tmp_path / "v") / "model.safetensors")
    assert shapes["blocks.2.layers.1.bias"][0] == (32,)


@pytest.mark.parametrize("heads, lost", [(3, "heads 4..5 would stay untrained"), (6, "head 6 would be dropped")])
def test_medusa_repo_layout_refuses_a_head_count_its_loader_cannot_build(tmp_path, heads, lost, checkpoint):
    _, folder, _ = checkpoint("medusa", *([f"drafter.medusa.num_heads={heads}"] if heads != 3 else []))
    with pytest.raises(SpecdrafterError, match=rf"--format medusa cannot express {heads} heads: the Medusa repo's "
                                               rf"loader builds 5 .*strict=False, so {lost}; train "
                                               r"drafter.medusa.num_heads=5 or export --format medusa-vllm") as e:
        export(folder, "medusa", tmp_path / "m")
    assert "\n" not in str(e.value) and not (tmp_path / "m").exists()


def test_medusa2_exports_the_backbone_to_serve_as_the_target(tmp_path, checkpoint, target):
    _, folder, module = checkpoint("medusa", "drafter.medusa.stage=2", "drafter.lora.r=4")
    out = export(folder, "medusa-vllm", tmp_path / "m2")
    backbone = AutoModelForCausalLM.from_pretrained(out / "backbone").eval()
    with torch.no_grad():
        torch.testing.assert_close(backbone(IDS).logits, module.backbone(input_ids=IDS).logits, atol=1e-5, rtol=1e-5)
    assert (out / "backbone" / "tokenizer.json").is_file() and (out / "backbone" / "generation_config.json").is_file()
    for name, value in module.heads.state_dict().items():
        assert torch.equal(load_medusa(out).state_dict()[name], value), name
    card = (out / "README.md").read_text()
    assert "must be served as the target model" in card and "vllm serve ./m2/backbone --speculative-config" in card


# -------------------------------------------------------------------------------------------- draft model
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_hf_draft_export_is_a_plain_causal_lm_that_decodes_like_the_checkpoint(tmp_path, lora, checkpoint, target,
                                                                                smollm2_tokenizer):
    _, folder, module = checkpoint("draft_model", *(["drafter.lora.r=4"] if lora else []))
    out = export(folder, "hf-draft", tmp_path / "d")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "generation_config.json",
                                              "tokenizer.json", "tokenizer_config.json", "README.md", "recipe.yaml"}
    assert config(out)["architectures"] == ["LlamaForCausalLM"] and config(out)["num_hidden_layers"] == 2
    V = target.config.vocab_size
    layer = {"self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32), "self_attn.v_proj.weight": (16, 32),
             "self_attn.o_proj.weight": (32, 32), "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
             "mlp.down_proj.weight": (32, 64), "input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,)}
    assert weight_shapes(out / "model.safetensors") == {  # a LoRA adapter is merged: no lora_* tensors
        "model.embed_tokens.weight": ((V, 32), "F32"), "model.norm.weight": ((32,), "F32"), "lm_head.weight": ((V, 32), "F32"),
        **{f"model.layers.{i}.{k}": (s, "F32") for i in range(2) for k, s in layer.items()}}
    draft = AutoModelForCausalLM.from_pretrained(out).eval()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == smollm2_tokenizer.get_vocab()
    with torch.no_grad():
        torch.testing.assert_close(draft(IDS).logits, module(input_ids=IDS).logits, atol=1e-5, rtol=1e-5)
    prompt = prompt_ids(smollm2_tokenizer)
    mine = speculative_generate(target, DraftModelProposer(draft), prompt, 16, GREEDY, 3)
    plain = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    assert mine.tokens == plain


# ---------------------------------------------------------------------------------------- card and leaks
def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---")[1])


def test_card_recipe_and_step_with_no_paths_or_tokens(tmp_path, monkeypatch, checkpoint):
    original, _, _ = checkpoint("eagle3")
    run = shutil.copytree(original, tmp_path / "run")
    folder = run / "checkpoints" / "step-000004"
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    recipe = OmegaConf.load(folder / "recipe.yaml")
    recipe.target.model = "smollm2-135m-instruct"  # a built-in target: the card names its Hub id
    recipe.drafter.path = str(Path.home() / "somewhere" / "drafter")
    (run / "recipe.yaml").write_text(OmegaConf.to_yaml(recipe))
    newer = run / "checkpoints" / "step-000008"  # incomplete (no trainer_state.json): never exported
    shutil.copytree(folder / "drafter", newer / "drafter")
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "results.json").write_text(json.dumps({"schema": 1, "cells": [
        {"checkpoint": "step-000004", "step": 4, "set": "mtbench", "temperature": 0.0, "verifier": "chain", "k": 3,
         "alpha": 0.612, "tau": 2.25, "speedup_drift_corrected": 1.71, "sweep": False},
        {"checkpoint": "step-000004", "step": 4, "set": "mtbench", "temperature": 0.0, "verifier": "chain", "k": 5,
         "alpha": 0.5, "tau": 2.0, "speedup_drift_corrected": 1.5, "sweep": True},
        {"checkpoint": "step-000002", "step": 2, "set": "mtbench", "temperature": 0.0, "verifier": "chain", "k": 7,
         "alpha": 0.4, "tau": 1.9, "speedup_drift_corrected": 1.4, "sweep": False}]}))
    shutil.copy(run / "recipe.yaml", folder / "recipe.yaml")
    out = export(run, "speculators", tmp_path / "card", repo_id="someone/smol-eagle3")  # a run dir: its newest complete

    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "library_name": "vllm",
                    "tags": ["speculative-decoding", "eagle3"]}
    assert config(out)["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "training step 4" in card and json.loads((out / "trainer_state.json").read_text())["step"] == 4
    assert "| set | T | verifier | k | α | τ | speedup |" in card and "| mtbench | 0 | chain | 3 | 0.612 | 2.25 | 1.71 |" in card
    assert "Measured on this checkpoint" in card and "| 5 |" not in card and "| 7 |" not in card  # no sweep, no other step
    assert "α: accepted drafts / draft positions tried" in card  # the eval job's α, whatever k was
    assert "vllm serve someone/smol-eagle3" in card and "input** to target layer k" in card
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved["target"]["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and saved["drafter"]["path"] == "drafter"
    assert saved["output_dir"] == original.name and saved["train"]["data_dir"] == "data"  # absolute paths → final component
    assert "```yaml" in card and "aux_layer_ids" in card
    for path in out.rglob("*"):
        text = path.read_bytes() if path.suffix != ".safetensors" else path.read_bytes()[:50_000]
        for needle in (str(tmp_path), str(original), "/root", "/home", "/tmp", FAKE_TOKEN):
            assert needle.encode() not in text, (path.name, needle)


def test_held_out_metrics_fill_the_card_without_an_evaluation(tmp_path, checkpoint):
    _, folder, _ = checkpoint("medusa", "drafter.medusa.num_heads=5")
    card = (export(folder, "medusa", tmp_path / "m") / "README.md").read_text()
    assert front_matter(card)["tags"] == ["speculative-decoding", "medusa"] and "base_model" not in front_matter(card)
    assert "| prediction | α̂ | top-1 |" in card and "| head1 | 0.5 | 0.5 |" in card and "| head3 | 0.3 | 0.3 |" in card
    assert "text-generation-launcher --model-id ./m" in card
    assert "reads only `medusa_lm_head.pt` and builds 5 heads, as many as this export has" in card


def test_a_token_in_the_recipe_stops_the_export(tmp_path, checkpoint):
    _, folder, _ = checkpoint("draft_model")
    bad = tmp_path / "ckpt"
    shutil.copytree(folder, bad)
    recipe = OmegaConf.load(bad / "recipe.yaml")
    recipe.train.wandb.name = "hf_" + "A1b2" * 8
    (bad / "recipe.yaml").write_text(OmegaConf.to_yaml(recipe))
    with pytest.raises(SpecdrafterError, match="contains a token; nothing was written"):
        export(bad, "hf-draft", tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input_is_refused_in_one_line(tmp_path, checkpoint):
    _, eagle, _ = checkpoint("eagle3")
    with pytest.raises(SpecdrafterError, match="checkpoint .*nowhere.* does not exist"):
        export(tmp_path / "nowhere", "vllm", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdrafterError, match="is not a checkpoint, a drafter folder or a run directory"):
        export(tmp_path / "empty", "vllm", tmp_path / "o")
    with pytest.raises(SpecdrafterError, match="--format medusa exports Medusa heads, but .* holds an EAGLE-3 head "
                                               r"\(drafter kind eagle3\); use --format vllm or sglang or speculators"):
        export(eagle, "medusa", tmp_path / "o")
    _, eagle1, _ = checkpoint("eagle1")
    with pytest.raises(SpecdrafterError, match="EAGLE-1 head, which has no engine format here"):
        export(eagle1, "vllm", tmp_path / "o")
    with pytest.raises(SpecdrafterError, match="would replace the checkpoint"):
        export(eagle, "vllm", eagle, overwrite=True)

    out = export(eagle, "sglang", tmp_path / "o")
    with pytest.raises(SpecdrafterError, match="exists; pass --overwrite"):
        export(eagle / "drafter", "vllm", out)  # a checkpoint's drafter/ folder is accepted too
    assert "exported as `sglang`" in (out / "README.md").read_text()
    export(eagle / "drafter", "vllm", out, overwrite=True)  # an earlier export is replaced whole
    assert (out / "model.safetensors").is_file() and "exported as `vllm`" in (out / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "o"]  # no temp folder left beside it


def test_overwrite_replaces_only_an_export_and_never_a_users_files(tmp_path, checkpoint):
    """Issue 54: --overwrite deleted whatever --out named (a user's folder), and a file as --out was a traceback."""
    _, eagle, _ = checkpoint("eagle3")
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "sub" / "data.csv").write_text("1,2")
    before = fingerprint(mine)
    with pytest.raises(SpecdrafterError, match=r"'.*mine' is not an export folder specdrafter wrote \(it holds "
                                               r"notes.txt, sub\); choose another --out or remove it yourself"):
        export(eagle, "vllm", mine, overwrite=True)
    assert fingerprint(mine) == before and (mine / "sub").is_dir()

    out = export(eagle, "vllm", tmp_path / "o")
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("added to an export by hand")
    with pytest.raises(SpecdrafterError, match=r"is not an export folder specdrafter wrote \(it holds sub\)"):
        export(eagle, "sglang", out, overwrite=True)
    assert (out / "sub" / "notes.txt").is_file()
    shutil.rmtree(out / "sub")
    export(eagle, "sglang", out, overwrite=True)
    assert "exported as `sglang`" in (out / "README.md").read_text()
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes == {".": 0o755, **{name: 0o644 for name in modes if name != "."}}  # served by another user too

    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    done = subprocess.run([sys.executable, "launch/export.py", str(eagle), "--format", "vllm", "--out", str(a_file),
                           "--overwrite"], cwd=REPO, capture_output=True, text=True, env={**os.environ,
                           "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 1 and done.stderr.strip() == (f"error: --out {str(a_file)!r} is a file, not a folder; "
                                                            "choose another --out")
    assert a_file.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "mine", "o"]  # no temp folder left beside them


def fingerprint(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def http_error(status: int) -> HfHubHTTPError:
    request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
    return HfHubHTTPError(f"{status} Client Error", response=httpx2.Response(status, request=request))


def test_failed_pushes_say_why_and_leave_the_export_intact(tmp_path, monkeypatch, checkpoint):
    _, folder, _ = checkpoint("medusa")
    out = export(folder, "medusa-vllm", tmp_path / "m")
    before = fingerprint(out)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setenv("HF_TOKEN", "")
    for name in ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SpecdrafterError, match="cannot push to me/m: no Hugging Face token .*export .* is complete"):
        push_to_hub(out, "me/m")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecdrafterError, match="cannot push to me/m: HF_HUB_OFFLINE is set"):
        push_to_hub(out, "me/m")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    for error, message in [(http_error(403), "this token may not write to me/m"),
                           (http_error(409), "me/m conflicts with an existing repository"),
                           (http_error(401), "the token was rejected"),
                           (httpx2.ConnectError(f"cannot connect ({FAKE_TOKEN})"), r"could not reach the Hub .*\*\*\*")]:
        def refuse(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(HfApi, "create_repo", refuse)
        with pytest.raises(SpecdrafterError, match=message) as e:
            push_to_hub(out, "me/m", private=True)
        assert "\n" not in str(e.value) and FAKE_TOKEN not in str(e.value)
    assert fingerprint(out) == before

    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create", repo_id, kwargs))
        return f"https://hf.co/{repo_id}"

    def upload_folder(self, **kwargs):
        calls.append(("upload", kwargs["repo_id"], Path(kwargs["folder_path"])))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert push_to_hub(out, "me/m", private=True) == "https://hf.co/me/m"
    assert calls == [("create", "me/m", {"private": True, "exist_ok": True, "repo_type": "model"}), ("upload", "me/m", out)]


def test_launcher_push_without_a_token_prints_one_line_and_keeps_the_export(tmp_path, checkpoint):
    _, folder, _ = checkpoint("eagle3")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf-home")}
    for name in ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "launch/export.py", str(folder), "--format", "vllm", "--out", str(tmp_path / "o"),
                           "--push-to-hub", "me/smol-eagle3"], cwd=REPO, capture_output=True, text=True, env=env,
                          check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("error: cannot push to me/smol-eagle3: no Hugging Face token")
    assert done.stdout.strip() == f"exported vllm: {tmp_path / 'o'}"
    assert {p.name for p in (tmp_path / "o").iterdir()} == {"config.json", "model.safetensors", "README.md",
                                                            "recipe.yaml", "trainer_state.json"}
