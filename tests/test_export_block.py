"""Export of the block drafters (export/block.py through export/formats.py:export): DFlash and DSpark in the folders
vLLM, SGLang and the speculators library load. Every config key and tensor the engines read, exactly; the layer ids
each engine captures for a folder select the features the drafter was trained on (an off-by-one changes the draft
logits); a pruned vocabulary carries the target's lm_head rows where the engine reads them and is refused in one line
where it cannot; the model card's serving commands; a wrong-kind export is one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama_config
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.export.formats import export
from specdrafter.jobs.recipe import load_recipe
from specdrafter.models.block import DSPARK, VARIANTS, BlockDrafter, block_config
from specdrafter.models.block_folders import load_block_drafter, save_block_drafter

REPO = Path(__file__).resolve().parents[1]
V, L, B, R = 512, 6, 4, 8  # target vocabulary and layers, block size, Markov rank
IDS = [1, 3, 5]  # target layer inputs the drafters read (HF hidden_states[k]); DFlash's outputs: [0, 2, 4]
OUTPUTS = [k - 1 for k in IDS]  # dflash_config.target_layer_ids
Vd = 96  # the pruned draft vocabulary
DRAFTS = {"dflash": B - 1, "dspark": B}  # DFlash's anchor slot drafts nothing, DSpark's does
TOKENS = torch.tensor([[1, 40, 7, 300, 52, 9, 211, 18, 3]])

# The target layers each engine captures for an exported folder, as layer *inputs* (HF hidden_states[i]):
#   vLLM      v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:get_eagle3_aux_layers_from_config: dflash_config's
#             target_layer_ids + 1 (top-level target_layer_ids the same)
#   SGLang    srt/models/llama.py:set_dflash_layers_to_capture: layers_to_capture = [id + 1], captured before the layer
#   speculators (and vLLM reading it) aux_hidden_state_layer_ids as they are
ENGINE_CAPTURES = {"vllm": lambda c: [k + 1 for k in c["dflash_config"]["target_layer_ids"]],
                   "sglang": lambda c: [k + 1 for k in c["dflash_config"]["target_layer_ids"]],
                   "speculators": lambda c: c["aux_hidden_state_layer_ids"]}


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=L, tie_word_embeddings=False))
    folder = tmp_path_factory.mktemp("block-target")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(target_dir):
    return LlamaForCausalLM.from_pretrained(target_dir).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, target_dir, target):
    """checkpoint(variant, pruned) → (checkpoint folder, drafter): a drafter built with models/block.py, its weights
    moved off their initial values (a pruned vocabulary that is not the first Vd ids), saved as training saves it,
    beside the recipe that names the target."""
    made = {}

    def make(variant: str, pruned: bool = False):
        if (variant, pruned) not in made:
            torch.manual_seed(1)
            config = block_config(target.config, VARIANTS[variant], num_layers=2, block_size=B, aux_layer_ids=IDS,
                                  markov_rank=R if variant == "dspark" else 0, draft_vocab_size=Vd if pruned else 0)
            drafter = BlockDrafter(config).eval()
            with torch.no_grad():
                for p in drafter.parameters():
                    p.add_(0.05 * torch.randn_like(p))
                if pruned:
                    drafter.set_draft_vocab(torch.randperm(V)[:Vd].sort().values)
            run = tmp_path_factory.mktemp(f"run-{variant}{'-pruned' if pruned else ''}")
            folder = run / "checkpoints" / "step-000004"
            save_block_drafter(drafter, folder / "drafter")
            cfg = load_recipe(REPO / "recipes" / f"smollm2-135m-{variant}.yaml",
                              [f"output_dir={run}", f"target.model={target_dir}", f"train.data_dir={run / 'data'}",
                               "drafter.block.num_layers=2", f"drafter.block.block_size={B}",
                               "drafter.block.aux_layer_ids=[1,3,5]", f"drafter.block.markov_rank={R}",
                               f"drafter.block.draft_vocab_size={Vd if pruned else 0}", "inference.k=3",
                               "inference.k_max=3", "train.wandb.mode=disabled"])
            (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
            (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "tokens": 1000, "drafter": variant}))
            made[(variant, pruned)] = (folder, drafter)
        return made[(variant, pruned)]
    return make


def config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def hidden_states(target):
    with torch.no_grad():
        return target(TOKENS, output_hidden_states=True).hidden_states  # [k] = the input to layer k


def block_logits(drafter, target, inputs):
    """Our drafts of one block at position 4 after the context 0..3, the context's features being the inputs to
    target layers `inputs` (HF hidden_states[i]); DSpark's first draft with its heads (prev = the anchor)."""
    hs, t = hidden_states(target), 4
    features = torch.cat([hs[i][:, :t] for i in inputs], -1)  # [1, t, m·d]
    with torch.no_grad():
        cache = drafter.new_cache()
        drafter.extend_context(cache, features)
        block = drafter.draft_block(cache, TOKENS[0, t:t + 1], target)
        first, confidence = drafter.heads(block.logits[:, 0], block.hidden[:, 0], TOKENS[0, t:t + 1])
    return block.logits, first, confidence


def loaded_back(folder: Path, drafter: BlockDrafter) -> BlockDrafter:
    """A drafter of the same config holding the export's tensors, loaded strictly (every name and shape ours); a
    full-vocabulary export has no d2t / t2d (the identity maps) and a pruned one an lm_head we borrow from the target."""
    weights = load_file(str(folder / "model.safetensors"))
    weights.pop("lm_head.weight", None)
    again = BlockDrafter(drafter.config).eval()
    for name in ("d2t", "t2d"):
        weights.setdefault(name, again.state_dict()[name])
    again.load_state_dict(weights)
    return again


# ------------------------------------------------------------------------------ vLLM and SGLang: one layout
@pytest.mark.parametrize("variant", ["dflash", "dspark"])
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_vllm_and_sglang_folders_hold_what_their_loaders_read(tmp_path, variant, fmt, checkpoint, target):
    folder, drafter = checkpoint(variant)
    out = export(folder, fmt, tmp_path / fmt)
    c = config(out)
    assert c["architectures"] == [{"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}[variant]]
    assert c["model_type"] == "qwen3" and c["tie_word_embeddings"] is False
    assert (c["block_size"], c["num_target_layers"], c["target_hidden_size"], c["draft_vocab_size"]) == (B, L, 32, V)
    assert c["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": OUTPUTS}  # layer outputs: ours − 1
    layer = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 512, "vocab_size": V, "hidden_act": "silu", "attention_bias": False}
    assert {k: c[k] for k in layer} == layer
    heads = {"markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True, "sample_from_anchor": True}
    assert {k: c.get(k) for k in heads} == (heads if variant == "dspark" else dict.fromkeys(heads))
    for ours in ("variant", "aux_layer_ids", "mask_token_id", "_name_or_path"):  # only the engines' keys
        assert ours not in c

    weights = load_file(str(out / "model.safetensors"))
    expected = {k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}  # full vocabulary
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    if variant == "dspark":
        assert weights["markov_head.markov_w1.weight"].shape == (V, R) and weights["markov_head.markov_w2.weight"].shape == (V, R)
        assert weights["confidence_head.proj.weight"].shape == (1, 32 + R)  # [h ; W1[prev]]
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)  # borrowed from the target


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_the_layers_each_engine_captures_are_the_ones_trained_on(tmp_path, variant, fmt, checkpoint, target):
    folder, drafter = checkpoint(variant)
    out = export(folder, fmt, tmp_path / fmt)
    captured = ENGINE_CAPTURES[fmt](config(out))
    assert captured == drafter.feature_layers == IDS  # what each engine captures = what the drafter trained on
    ours = block_logits(drafter, target, drafter.feature_layers)
    theirs = block_logits(loaded_back(out, drafter), target, captured)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    shifted = block_logits(drafter, target, [i + 1 for i in captured])  # a folder one layer off drafts otherwise
    assert not torch.equal(shifted[0], ours[0])


# ------------------------------------------------------------------------------------------- speculators
@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_speculators_folder(tmp_path, variant, checkpoint, target_dir):
    folder, drafter = checkpoint(variant)
    out = export(folder, "speculators", tmp_path / "s")
    c = config(out)
    assert c["architectures"] == [{"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}[variant]]
    assert c["speculators_model_type"] == variant
    assert c["speculators_config"] == {
        "algorithm": variant, "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": DRAFTS[variant], "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": target_dir.name, "architectures": ["LlamaForCausalLM"]}}
    assert c["aux_hidden_state_layer_ids"] == IDS  # speculators names a layer's input, as we do
    assert (c["draft_vocab_size"], c["target_hidden_size"], c["block_size"], c["mask_token_id"]) == (V, 32, B, 16)
    assert c["sample_from_anchor"] is (variant == "dspark")  # vLLM's speculators adapter defaults it to false
    layer = c["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["hidden_size"], layer["rope_theta"]) == ("qwen3", 2, 32,
                                                                                                          10000.0)
    assert "dflash_config" not in c and not {"variant", "aux_layer_ids", "block_size", "num_target_layers"} & set(layer)
    heads = {"markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True}
    assert {k: c.get(k) for k in heads} == (heads if variant == "dspark" else dict.fromkeys(heads))
    weights = load_file(str(out / "model.safetensors"))
    assert sorted(weights) == sorted(k for k in drafter.state_dict() if k not in ("d2t", "t2d"))


def as_speculators_trainer_saves(folder: Path, variant: str, **changes) -> Path:
    """Our speculators export rewritten as speculators 0.9.0's trainer saves it (DFlashDraftModel.save_pretrained /
    DSparkDraftModel's, checked against a real save): the model class in `architectures`, transformers 5's
    rope_parameters, every draft layer's attention type, its own bookkeeping keys; `changes` override top-level keys
    (a dotted "transformer_layer_config.key" the layer's)."""
    c = config(folder)
    layer = c["transformer_layer_config"]
    layer["rope_parameters"] = {"rope_theta": layer.pop("rope_theta"), "rope_type": "default"}
    layer.update(layer_types=["full_attention"] * layer["num_hidden_layers"], sliding_window=None,
                 use_sliding_window=False, max_window_layers=28)
    name = {"dflash": "DFlash", "dspark": "DSpark"}[variant]
    c.update(architectures=[f"{name}DraftModel"], auto_map={"": f"config.{name}SpeculatorConfig"},
             speculators_version="0.9.0", sliding_window_non_causal=False, target_hidden_size=None, dtype="float32")
    for key, value in changes.items():
        (layer if key.startswith("transformer_layer_config.") else c)[key.split(".")[-1]] = value
    (folder / "config.json").write_text(json.dumps(c))
    return folder


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_a_speculators_trainers_own_save_loads_with_the_same_drafts(tmp_path, variant, checkpoint, target):
    folder, drafter = checkpoint(variant)
    theirs = load_block_drafter(as_speculators_trainer_saves(export(folder, "speculators", tmp_path / "s"), variant))
    assert theirs.config.variant == variant and theirs.feature_layers == IDS
    for a, b in zip(block_logits(theirs, target, IDS), block_logits(drafter, target, IDS)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("variant, changes, refusal", [
    ("dspark", {"transformer_layer_config.layer_types": ["sliding_attention", "full_attention"],
                "transformer_layer_config.sliding_window": 2048},
     r'transformer_layer_config.layer_types = \["sliding_attention", "full_attention"\]: draft layer 0 attends '
     r"through a sliding window of 2048 \(causal inside a block"),
    ("dflash", {"transformer_layer_config.layer_types": ["full_attention", "sliding_attention"],
                "sliding_window_non_causal": True},
     r"layer_types = .*: draft layer 1 attends through a sliding window of None \(bidirectional inside a block"),
    ("dspark", {"sample_from_anchor": False}, r"sample_from_anchor = false: a dspark drafter drafts from the anchor"),
    ("dflash", {"sample_from_anchor": True}, r"sample_from_anchor = true: a dflash drafter drafts from the masked"),
    ("dspark", {"markov_head_type": "gated"}, r'markov_head_type = "gated": our Markov head is the vanilla one'),
    ("dspark", {"confidence_head_with_markov": False}, r"confidence_head_with_markov = false: our confidence head"),
])
def test_a_speculators_setting_we_do_not_compute_is_refused_in_one_line(tmp_path, variant, changes, refusal,
                                                                         checkpoint):
    folder, _ = checkpoint(variant)
    out = as_speculators_trainer_saves(export(folder, "speculators", tmp_path / "s"), variant, **changes)
    with pytest.raises(SpecdrafterError, match=refusal + r".*; refused rather than drafted wrongly$") as e:
        load_block_drafter(out)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------ pruned vocabulary
@pytest.mark.parametrize("variant", ["dflash", "dspark"])
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_pruned_vocabulary_carries_the_targets_lm_head_rows_and_d2t(tmp_path, variant, fmt, checkpoint, target):
    folder, drafter = checkpoint(variant, pruned=True)
    out = export(folder, fmt, tmp_path / fmt)
    weights, c = load_file(str(out / "model.safetensors")), config(out)
    assert c["draft_vocab_size"] == Vd
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight[drafter.draft_ids])  # [Vd, d]
    assert torch.equal(weights["d2t"], drafter.d2t) and torch.equal(weights["t2d"], drafter.t2d)
    assert not torch.equal(drafter.draft_ids, torch.arange(Vd))  # not just the first Vd ids
    if variant == "dspark":
        assert weights["markov_head.markov_w2.weight"].shape == (Vd, R)
    ours = block_logits(drafter, target, drafter.feature_layers)
    theirs = block_logits(loaded_back(out, drafter), target, ENGINE_CAPTURES[fmt](c))
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_sglang_refuses_a_pruned_vocabulary_in_one_line(tmp_path, variant, checkpoint):
    folder, _ = checkpoint(variant, pruned=True)
    with pytest.raises(SpecdrafterError, match=rf"--format sglang cannot express .*: its draft vocabulary is pruned "
                                               rf"\({Vd} of {V} tokens\), and SGLang's {variant.upper()} drafts over "
                                               r"the target's full lm_head .* export --format vllm or speculators") as e:
        export(folder, "sglang", tmp_path / "s")
    assert "\n" not in str(e.value) and not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("settings, why", [({"markov_rank": 0}, "refuses markov_rank 0"),
                                           ({"enable_confidence_head": False}, "builds the confidence head whatever")])
def test_sglang_refuses_a_dspark_drafter_its_loader_cannot_build(tmp_path, settings, why, target):
    config = block_config(target.config, DSPARK, num_layers=1, block_size=B, aux_layer_ids=IDS,
                          **{"markov_rank": R, **settings})
    folder = save_block_drafter(BlockDrafter(config), tmp_path / "bare")
    with pytest.raises(SpecdrafterError, match=f"--format sglang cannot express .*: SGLang's DSPARK {why}"):
        export(folder, "sglang", tmp_path / "s")
    assert (export(folder, "vllm", tmp_path / "v") / "config.json").is_file()  # written (not checked against vLLM)


def test_a_pruned_vocabulary_without_the_targets_weights_is_refused(tmp_path, checkpoint):
    folder, _ = checkpoint("dspark", pruned=True)
    bare = shutil.copytree(folder / "drafter", tmp_path / "bare")  # no recipe: the target is unknown
    with pytest.raises(SpecdrafterError, match=r"drafts over a pruned vocabulary \(96 of 512 tokens\), whose rows of "
                                               r"the target's lm_head .* are not on this machine") as e:
        export(bare, "vllm", tmp_path / "v")
    assert "\n" not in str(e.value) and not (tmp_path / "v").exists()


# --------------------------------------------------------------------------------------------- the card
@pytest.mark.parametrize("variant, algorithm, since", [("dflash", "DFLASH", "0.22.0"), ("dspark", "DSPARK", "0.28.0")])
def test_cards_give_each_engines_serving_command(tmp_path, variant, algorithm, since, checkpoint, target_dir):
    folder, _ = checkpoint(variant)
    drafts, target = DRAFTS[variant], f"<path to {target_dir.name}>"
    spec = json.dumps({"method": variant, "model": "./v", "num_speculative_tokens": drafts})
    card = (export(folder, "vllm", tmp_path / "v") / "README.md").read_text()
    assert f"vllm serve {target} --speculative-config '{spec}'" in card
    assert f"**Engine versions:** vLLM {since} or later (`qwen3_{variant}.py`, method `{variant}`" in card
    assert "## Layer-id convention" in card and f"`dflash_config.target_layer_ids` = {OUTPUTS}" in card
    assert "capture the inputs to layers [1, 3, 5]" in card and f"- {variant}" in card  # the Hub tag
    card = (export(folder, "sglang", tmp_path / "s") / "README.md").read_text()
    assert (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path ./s --speculative-num-draft-tokens {drafts + 1}") in card
    card = (export(folder, "speculators", tmp_path / "p") / "README.md").read_text()
    assert "`aux_hidden_state_layer_ids` = [1, 3, 5]" in card and "the outputs of layers [0, 2, 4]" in card
    spec = json.dumps({"method": variant, "model": "./p", "num_speculative_tokens": drafts})
    assert f"holds only its folder name `{target_dir.name}`" in card  # a local target: `vllm serve ./p` alone fails
    assert f"vllm serve {target} --speculative-config '{spec}'" in card and "vllm serve ./p\n" not in card
    card = (export(*checkpoint(variant, pruned=True)[:1], "vllm", tmp_path / "pv") / "README.md").read_text()
    assert "SGLang cannot serve this drafter's pruned vocabulary" in card and "sglang.launch_server" not in card


def test_a_block_drafter_refuses_another_kinds_format_in_one_line(tmp_path, checkpoint):
    folder, _ = checkpoint("dflash")
    with pytest.raises(SpecdrafterError, match=r"--format medusa exports Medusa heads, but .* holds a DFlash block "
                                               r"drafter \(drafter kind dflash\); use --format vllm or sglang or "
                                               r"speculators") as e:
        export(folder, "medusa", tmp_path / "m")
    assert "\n" not in str(e.value) and not any(tmp_path.iterdir())


@pytest.mark.parametrize("variant, pruned, fmt", [("dflash", False, "vllm"), ("dspark", False, "sglang"),
                                                  ("dspark", True, "vllm"), ("dflash", True, "speculators"),
                                                  ("dspark", False, "speculators")])
def test_an_engine_folder_loads_back_as_the_drafter_it_came_from(tmp_path, checkpoint, target, variant, pruned, fmt):
    """z-lab / DeepSpec / speculators folders decode here too: every tensor and the drafts of one block are ours."""
    from specdrafter.kinds import KINDS, kind_of_config
    from specdrafter.models.block_folders import load_block_drafter
    folder, drafter = checkpoint(variant, pruned)
    out = export(folder, fmt, tmp_path / fmt)
    assert kind_of_config(config(out)) is KINDS[variant]
    loaded = load_block_drafter(out, VARIANTS[variant])
    assert loaded.config.aux_layer_ids == IDS and loaded.config.mask_token_id == drafter.config.mask_token_id
    mine, theirs = drafter.state_dict(), loaded.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    torch.testing.assert_close(block_logits(loaded, target, IDS), block_logits(drafter, target, IDS))
    from specdrafter.inference.block import BlockProposer
    BlockProposer(loaded, target)  # speculators records no target depth: the decoder checks the ids against this one
    assert loaded.config.num_target_layers == L
