"""drafter.kind=mtp (train/mtp.py, docs/algorithms.md §MTP): a target's own MTP layer, read from the tensors
transformers drops, computes the engines' step; greedy decoding through the loop is the target's own and sampling at
T = 1 follows the target's distribution (χ²); training moves only the MTP layer, offline features train as online
ones do, and the saved folder holds the target's own tensor names; a target without MTP layers is one line."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_first_two_tokens_follow, sample_first_two_through_the_loop
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import Recipe
from specdrafter.inference.decode import speculative_generate
from specdrafter.inference.mtp import MtpProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.kinds import KINDS, kind_of_config
from specdrafter.models.features import capture_features
from specdrafter.models.targets import tiny_config
from specdrafter.train.batches import Batch
from specdrafter.train.drafters import run_target
from specdrafter.train.mtp import WEIGHTS, MtpDrafter, load_mtp, split_experts, to_module
from specdrafter.train.objectives import Objective

ARCHS = ["deepseek_v3", "qwen3_next"]
# The checkpoint names of each architecture's MTP layer (DeepSeek-V3's model.layers.61.*, Qwen3-Next's mtp.*) at 4 layers
OWN = {"deepseek_v3": {"model.layers.4.enorm.weight", "model.layers.4.hnorm.weight", "model.layers.4.eh_proj.weight",
                       "model.layers.4.shared_head.norm.weight"},
       "qwen3_next": {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                      "mtp.norm.weight"}}
BLOCK = {"deepseek_v3": "model.layers.4.", "qwen3_next": "mtp.layers.0."}
PROMPTS = [[5, 7, 3, 9], [1, 4, 6, 8, 10, 12], [11, 3]]


def mtp_target(folder, name, vocab=16, layers=4, mimic=True):
    """A tiny random target of `name` saved with an MTP layer in its checkpoint layout, written by hand here: the last
    decoder layer's tensors under the MTP block's names, and the MTP's own norms and projection (`mimic`: eh_proj
    passes h_t on, so that drafts are partly accepted)."""
    torch.manual_seed(0)
    config = tiny_config(name, vocab_size=vocab)
    config.num_hidden_layers = layers
    if name == "qwen3_next":
        config.layer_types = ["linear_attention"] * (layers - 1) + ["full_attention"]
        config.mtp_num_hidden_layers = 1
    else:
        config.num_nextn_predict_layers = 1
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)  # a sharp target: few tokens carry its mass
    model.save_pretrained(folder)
    main = load_file(str(folder / "model.safetensors"))
    d, last = config.hidden_size, f"model.layers.{layers - 1}."
    prefix = BLOCK[name].replace("4", str(layers)) if name == "deepseek_v3" else BLOCK[name]
    mtp = {prefix + k[len(last):]: v.clone() for k, v in main.items() if k.startswith(last)}
    eh = torch.cat([torch.zeros(d, d), torch.eye(d)], 1) if mimic else torch.randn(d, 2 * d) * 0.1
    top = f"model.layers.{layers}." if name == "deepseek_v3" else "mtp."
    names = ["enorm", "hnorm", "eh_proj", "shared_head.norm"] if name == "deepseek_v3" else \
        ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"]
    zero_centred = name == "qwen3_next"  # Qwen3-Next's norms scale by 1 + w
    for n in (names[0], names[1], names[3]):
        mtp[f"{top}{n}.weight"] = (0.3 * torch.randn(d)) if zero_centred else (1 + 0.3 * torch.randn(d))
    mtp[f"{top}{names[2]}.weight"] = eh
    for k in list(mtp):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            mtp[k] = mtp[k] * 0.1
    if name == "deepseek_v3":  # DeepSeek-V3 ships copies of the embedding and head inside its MTP layer
        mtp[f"{top}embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        mtp[f"{top}shared_head.head.weight"] = main["lm_head.weight"].clone()
    save_file(mtp, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in main},
                                            **{k: "model-mtp.safetensors" for k in mtp}}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return model, mtp


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model, mtp = mtp_target(folder, request.param)
    return request.param, folder, model, mtp


# ------------------------------------------------------------------------------------------ the layer
def test_the_layer_reads_the_checkpoint_names_and_computes_the_engines_step(arch):
    """Every checkpoint tensor reaches the layer (the per-expert tensors fused as transformers fuses them); one step
    is block(eh_proj(concat(enorm(e), hnorm(norm(h_L))))) read by the target's lm_head after the MTP norm."""
    name, folder, target, mtp = arch
    layer = load_mtp(folder, target)
    assert OWN[name] <= set(mtp)
    state = layer.state_dict()
    fused = to_module(mtp, __import__("specdrafter.train.mtp", fromlist=["LAYOUTS"]).LAYOUTS[name],
                      "model.layers.4." if name == "deepseek_v3" else "mtp.")
    assert set(fused) == set(state) and all(torch.equal(fused[k], state[k]) for k in state)
    block = {k[len(BLOCK[name]):]: v for k, v in mtp.items() if k.startswith(BLOCK[name])
             and not k[len(BLOCK[name]):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    ours = split_experts({k[len("block."):]: v for k, v in state.items() if k.startswith("block.")})
    assert set(ours) == set(block) and all(torch.equal(ours[k], block[k]) for k in block)
    # the fused experts equal transformers' own loading of the same tensors in the target's last layer
    torch.testing.assert_close(layer.block.mlp.experts.gate_up_proj, target.model.layers[-1].mlp.experts.gate_up_proj)

    ids = torch.tensor([PROMPTS[1]])
    with capture_features(target, [4]) as feats:
        target(input_ids=ids)
    h = target.model.norm(feats[4])  # [1, T, d] after the final norm
    e = target.get_input_embeddings()(torch.tensor([PROMPTS[1][1:] + [0]]))
    positions = torch.arange(6)[None]
    mask = torch.zeros(1, 1, 6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    rope = target.model.rotary_emb(e, positions)
    with torch.no_grad():
        state, normed = layer(h, e, rope, positions, mask, None)
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], -1))
        out = layer.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    torch.testing.assert_close(normed, layer.norm(out))
    torch.testing.assert_close(state, layer.norm(out) if name == "qwen3_next" else out)  # what the chain feeds back


# ------------------------------------------------------------------------------------------ exactness
def test_greedy_decoding_is_token_identical_to_target_generate(arch):
    name, folder, target, _ = arch
    proposer, accepted = MtpProposer(load_mtp(folder, target), target), []
    for prompt in PROMPTS:
        reference = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=[2],
                                    pad_token_id=0)[0, len(prompt):].tolist()
        result = speculative_generate(target, proposer, prompt, 10, SamplingParams(0.0), 3, [2])
        assert result.tokens == reference
        accepted += [c.accepted for c in result.cycles]
    assert min(accepted) < max(accepted)  # drafts accepted and rejected: rollbacks ran


def test_decoding_at_temperature_1_samples_the_first_two_tokens_from_the_target(tmp_path, one_thread):
    """χ² (level 1e-4, fixed seeds) of the first two tokens the real loop emits at T = 1 with k = 2, so the second
    draft comes from the layer's own fed-back state (DeepSeek-V3's layout: the state before the norm)."""
    target, _ = mtp_target(tmp_path, "deepseek_v3", vocab=8, layers=2)
    proposer = MtpProposer(load_mtp(tmp_path, target), target)
    prompt, n = [3, 5], 1500
    counts, accepted, drafted = sample_first_two_through_the_loop(target, proposer, prompt, n, False)
    assert 0 < accepted < drafted
    assert_first_two_tokens_follow(target, prompt, counts, n)


# ------------------------------------------------------------------------------------------ training
def recipe(folder, steps=2):
    cfg = OmegaConf.structured(Recipe)
    cfg.target.model, cfg.drafter.kind, cfg.drafter.mtp.steps = str(folder), "mtp", steps
    return cfg


def test_training_moves_only_the_mtp_layer_and_offline_equals_online(arch, tmp_path):
    name, folder, target, mtp = arch
    for p in target.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = MtpDrafter(recipe(folder), target)
    ids = torch.tensor([[1, 5, 7, 3, 9, 4, 6, 8, 10, 12], [1, 11, 3, 5, 7, 9, 2, 4, 6, 13]])
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids))
    online = run_target(target, batch, [4])
    offline = run_target(target, Batch(ids, batch.loss_mask, batch.attention_mask, {4: online.features[4]}), [4])
    objective = Objective.of(recipe(folder).train)
    losses = []
    opt = torch.optim.AdamW(drafter.module.parameters(), lr=1e-2)
    for step in range(6):
        out = drafter.predictions(drafter.module, batch, offline if step % 2 else online)
        assert [p.name for p in out] == ["step0", "step1"] and [p.weight for p in out] == [1.0, 0.6]
        loss = sum(p.loss(objective)[0] for p in out)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # the target stays as it was
    drafter.save(drafter.module, tmp_path / "drafter", None)
    saved = load_file(str(tmp_path / "drafter" / WEIGHTS))
    assert set(saved) == set(mtp)  # the target's own names, the kept copies too
    assert not torch.equal(saved[next(iter(OWN[name]))], mtp[next(iter(OWN[name]))])  # trained
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert kind_of_config(config) is KINDS["mtp"]
    reloaded = load_mtp(tmp_path / "drafter", target, torch.float32)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in drafter.module.state_dict().items())


def test_online_and_offline_predictions_match(arch):
    name, folder, target, _ = arch
    drafter = MtpDrafter(recipe(folder, steps=3), target)
    ids = torch.tensor([[1, 5, 7, 3, 9, 4, 6, 8]])
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids))
    online = run_target(target, batch, [4])
    offline = run_target(target, Batch(ids, batch.loss_mask, batch.attention_mask, {4: online.features[4]}), [4])
    a, b = drafter.predictions(drafter.module, batch, online), drafter.predictions(drafter.module, batch, offline)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.draft_logits, y.draft_logits)
    # step 0 at position t equals one engine step at t (the chain's later steps see step 0's keys up to t)
    h = target.model.norm(online.features[4])
    e = target.get_input_embeddings()(torch.tensor([[5, 7, 3, 9, 4, 6, 8, 0]]))
    positions = torch.arange(8)[None]
    mask = torch.zeros(1, 1, 8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        _, normed = drafter.module(h, e, target.model.rotary_emb(e, positions), positions, mask, None)
    torch.testing.assert_close(a[0].draft_logits, target.lm_head(normed[0, :6]).float(), atol=1e-5, rtol=1e-5)
    assert F.softmax(a[0].draft_logits, -1).shape[-1] == target.config.vocab_size


# ------------------------------------------------------------------------------------------ bad input
def test_a_target_without_mtp_layers_is_one_line(tmp_path):
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config("qwen3_next")).eval()
    target.save_pretrained(tmp_path)
    with pytest.raises(SpecdrafterError, match=r"has no MTP layers \(no mtp\.\* tensors"):
        load_mtp(tmp_path, target)
    llama = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    with pytest.raises(SpecdrafterError, match="the MTP layers of llama targets are not mapped"):
        load_mtp(tmp_path, llama)


def test_the_kind_refuses_a_tree_and_exports_nothing_else(arch):
    kind = KINDS["mtp"]
    assert kind.decoding.trees == () and kind.export.formats == ()
    assert "target's own layout" in kind.export.why
