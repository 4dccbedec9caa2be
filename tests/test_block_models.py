"""Block drafters' models (models/block.py, docs/block-drafters.md): DFlash and DSpark on one backbone. All blocks of a
batch in one pass equal each block run alone on its own context; the decode cache grows by committed positions and
drafts what a fresh computation drafts; DSpark's label shift, Markov and confidence heads; the layer-id convention
against HF's hidden_states; folders round-trip and bad settings are one line."""

import json

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.models.block import (
    DFLASH,
    VARIANTS,
    BlockDrafter,
    _rotate,
    block_config,
    context_mask,
    copy_target_layers,
    default_aux_layer_ids,
    slot_mask,
)
from specdrafter.models.block_folders import load_block_drafter, save_block_drafter
from specdrafter.models.eagle import Eagle3Head, eagle3_config, save_eagle3
from specdrafter.models.features import capture_features

V, L, S, T = 256, 8, 4, 12  # vocabulary, target layers, block size, sequence length
IDS = [1, 3, 6]  # target layer inputs the test drafters read


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=L)).eval()


def make_drafter(target, kind, seed=1, **overrides):
    torch.manual_seed(seed)
    settings = dict(num_layers=2, block_size=S, aux_layer_ids=IDS, markov_rank=8 if kind == "dspark" else 0)
    settings.update(overrides)
    return BlockDrafter(block_config(target.config, VARIANTS[kind], **settings)).eval()


@pytest.fixture(scope="module")
def batch(target):
    """Target features of two random sequences, their tokens and overlapping anchors (0 has no context at all)."""
    torch.manual_seed(2)
    tokens = torch.randint(3, V, (2, T))
    with capture_features(target, IDS) as captured, torch.no_grad():
        target(input_ids=tokens)
        features = torch.cat([captured[k] for k in IDS], dim=-1)  # [2, T, 3·d]
    anchors = torch.tensor([[0, 3, 4, 9], [2, 5, 6, 8]])  # blocks of 4 overlap: 3..6 and 4..7
    return features, tokens, anchors


def run(drafter, target, features, tokens, anchors):
    with torch.no_grad():
        return drafter(features, drafter.block_inputs(tokens, anchors), anchors, target,
                       drafter.teacher_prev(tokens, anchors))


# ---------------------------------------------------------------------------------------- config and names
def test_default_layers_names_and_slots(target):
    assert default_aux_layer_ids(30) == [2, 9, 15, 21, 28]  # SmolLM2: round(linspace(1, 27, 5)) + 1, half to even
    assert default_aux_layer_ids(L) == [2, 3, 4, 5, 6]
    with pytest.raises(SpecdrafterError, match="no 5 distinct default feature layers"):
        default_aux_layer_ids(6)
    dflash, dspark = make_drafter(target, "dflash"), make_drafter(target, "dspark")
    assert dflash.feature_layers == [1, 3, 6] and dflash.num_drafts == S - 1 and dspark.num_drafts == S
    assert dflash.config.architectures == ["DFlashDraftModel"] and dspark.config.architectures == ["Qwen3DSparkModel"]
    assert dspark.config.markov_rank == 8
    assert dspark.config.enable_confidence_head and not dflash.config.enable_confidence_head
    keys = set(dspark.state_dict())
    layer = {f"layers.1.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    layer |= {f"layers.1.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    layer |= {"layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight"}
    heads = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
             "confidence_head.proj.bias"}
    assert layer | heads | {"fc.weight", "hidden_norm.weight", "norm.weight", "d2t", "t2d"} <= keys
    assert not any(k.startswith(("embed", "lm_head")) for k in keys)  # the target's, passed in
    assert not heads & set(dflash.state_dict())
    assert dspark.fc.weight.shape == (32, 3 * 32) and dspark.markov_head.markov_w1.weight.shape == (V, 8)
    assert dspark.confidence_head.proj.weight.shape == (1, 32 + 8)


def test_weights_start_as_hf_initialises_them(target):
    drafter = make_drafter(target, "dspark", num_layers=1, markov_rank=64)
    for w in (drafter.fc.weight, drafter.layers[0].mlp.gate_proj.weight, drafter.markov_head.markov_w1.weight):
        assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(drafter.confidence_head.proj.bias, torch.zeros(1))
    assert all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in (drafter.norm, drafter.layers[0].self_attn.q_norm))


def test_feature_ids_are_layer_inputs_and_the_last_one_is_post_norm(target, batch):
    """Id k is HF hidden_states[k], the input to layer k (models/features.py); id L would be HF's post-norm state."""
    tokens = batch[1]
    drafter = make_drafter(target, "dflash")
    with capture_features(target, drafter.feature_layers + [L]) as captured, torch.no_grad():
        hf = target(input_ids=tokens, output_hidden_states=True).hidden_states
    for k in IDS:
        torch.testing.assert_close(captured[k], hf[k], atol=0, rtol=0)
    assert not torch.allclose(captured[L], hf[L])  # hidden_states[L] went through the final norm
    torch.testing.assert_close(target.model.norm(captured[L]), hf[L])


# ------------------------------------------------------------------------------------ the training pass
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_all_blocks_in_one_pass_equal_each_block_alone(target, batch, kind):
    features, tokens, anchors = batch
    drafter = make_drafter(target, kind)
    together = run(drafter, target, features, tokens, anchors)
    assert together.logits.shape == (2, 4, drafter.num_drafts, V)
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            alone = run(drafter, target, features[b:b + 1, :a], tokens[b:b + 1], anchors[b:b + 1, n:n + 1])
            torch.testing.assert_close(together.logits[b, n], alone.logits[0, 0], atol=1e-5, rtol=0)
            torch.testing.assert_close(together.hidden[b, n], alone.hidden[0, 0], atol=1e-5, rtol=0)
            if kind == "dspark":
                torch.testing.assert_close(together.confidence[b, n], alone.confidence[0, 0], atol=1e-5, rtol=0)


def test_the_mask_sees_the_context_before_the_anchor_only():
    assert context_mask(torch.tensor([[3, 4]]), 6).tolist() == [[[True] * 3 + [False] * 3, [True] * 4 + [False] * 2]]


def test_block_attention_equals_dense_attention_under_the_full_mask(target):
    """BlockAttention scores each slot over [context, own block] only; the same layer through torch's SDPA with the
    dense [N·S, T + N·S] mask (context by position, slots by block) and grouped-query heads gives the same output."""
    drafter = make_drafter(target, "dspark", block_size=3)
    attention = drafter.layers[0].self_attn
    torch.manual_seed(3)
    B, T, S, d = 2, 7, 3, drafter.config.hidden_size
    anchors = torch.tensor([[0, 3, 4], [2, 2, 6]])  # overlapping blocks, one with no context, two at one anchor
    N = anchors.shape[1]
    x, context = torch.randn(B, N * S, d), torch.randn(B, T, d)
    positions = (anchors[..., None] + torch.arange(S)).reshape(B, N * S)
    rope = drafter.rotary_emb(x, positions)
    ctx = attention.keys_values(context, drafter.rotary_emb(context, torch.arange(T).expand(B, T)))
    with torch.no_grad():
        ours = attention(x, rope, ctx, S, slot_mask(context_mask(anchors, T), S))  # [B, N·S, d]
        block = torch.arange(N).repeat_interleave(S)
        dense = torch.cat([context_mask(anchors, T).repeat_interleave(S, 1),
                           (block[:, None] == block[None]).expand(B, -1, -1)], -1)[:, None]  # [B, 1, N·S, T + N·S]
        q = attention.q_norm(attention.q_proj(x).view(B, N * S, -1, attention.head_dim)).transpose(1, 2)
        k, v = attention.keys_values(x, rope)
        out = torch.nn.functional.scaled_dot_product_attention(
            _rotate(q, *rope), torch.cat([ctx[0], k], 2), torch.cat([ctx[1], v], 2), attn_mask=dense, enable_gqa=True)
        reference = attention.o_proj(out.transpose(1, 2).reshape(B, N * S, -1))
    assert attention.num_kv_heads < attention.num_heads  # the grouped-query head mapping is exercised
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_block_inputs_labels_and_teacher_prev(target):
    tokens = torch.arange(20, 30)[None]  # [1, 10]
    anchors = torch.tensor([[2, 8]])
    dflash, dspark = make_drafter(target, "dflash"), make_drafter(target, "dspark")
    m = dflash.config.mask_token_id
    assert dflash.block_inputs(tokens, anchors).tolist() == [[[22, m, m, m], [28, m, m, m]]]
    assert dflash.draft_labels(tokens, anchors).tolist() == [[[23, 24, 25], [29, -100, -100]]]
    assert dspark.draft_labels(tokens, anchors).tolist() == [[[23, 24, 25, 26], [29, -100, -100, -100]]]
    assert dspark.teacher_prev(tokens, anchors).tolist() == [[[22, 23, 24, 25], [28, 29, m, m]]]


def test_dspark_shifts_the_labels_of_the_same_backbone(target, batch):
    """With DSpark's backbone weights, DFlash's draft j is DSpark's draft j + 1's slot: DFlash slot k predicts
    x_{a+k}, DSpark slot k predicts x_{a+k+1}, so DSpark's anchor slot drafts too."""
    features, tokens, anchors = batch
    dspark, dflash = make_drafter(target, "dspark"), make_drafter(target, "dflash", seed=5)
    backbone = {k: v for k, v in dspark.state_dict().items() if not k.startswith(("markov_head", "confidence_head"))}
    dflash.load_state_dict(backbone)
    with torch.no_grad():
        a = dflash.backbone(features, dflash.block_inputs(tokens, anchors), anchors, target)
        b = dspark.backbone(features, dspark.block_inputs(tokens, anchors), anchors, target)
    torch.testing.assert_close(a.hidden, b.hidden[:, :, 1:], atol=0, rtol=0)
    torch.testing.assert_close(a.logits, b.logits[:, :, 1:], atol=0, rtol=0)


def test_markov_head_reads_the_previous_token_and_w2_zero_is_the_backbone(target, batch):
    features, tokens, anchors = batch
    drafter = make_drafter(target, "dspark")
    blocks, prev = drafter.block_inputs(tokens, anchors), drafter.teacher_prev(tokens, anchors)
    other = prev.clone()
    other[:, :, 2] = (prev[:, :, 2] + 1) % V  # another previous token for draft 2 only
    with torch.no_grad():
        backbone = drafter.backbone(features, blocks, anchors, target)
        one, two = drafter(features, blocks, anchors, target, prev), drafter(features, blocks, anchors, target, other)
    assert (one.logits[:, :, 2] - two.logits[:, :, 2]).abs().amax(-1).min() > 1e-4  # every block's draft 2 moved
    assert not torch.allclose(one.confidence[:, :, 2], two.confidence[:, :, 2])
    keep = [0, 1, 3]
    torch.testing.assert_close(one.logits[:, :, keep], two.logits[:, :, keep], atol=0, rtol=0)
    torch.testing.assert_close(one.logits, backbone.logits + drafter.markov_head.markov_w2(
        drafter.markov_head.markov_w1(prev)), atol=1e-6, rtol=0)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()
        zeroed = drafter(features, blocks, anchors, target, other)
    torch.testing.assert_close(zeroed.logits, backbone.logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="previous token"):
        drafter(features, blocks, anchors, target)


def test_a_pruned_vocabulary_keeps_the_target_rows_of_its_tokens(target, batch):
    features, tokens, anchors = batch
    full, pruned = make_drafter(target, "dflash"), make_drafter(target, "dflash", draft_vocab_size=40)
    pruned.load_state_dict({k: v for k, v in full.state_dict().items() if k not in ("d2t", "t2d")}, strict=False)
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40].sort().values
    pruned.set_draft_vocab(keep)
    assert torch.equal(pruned.draft_ids, keep) and int(pruned.t2d.sum()) == 40 and bool(pruned.t2d[keep].all())
    a, b = run(full, target, features, tokens, anchors), run(pruned, target, features, tokens, anchors)
    torch.testing.assert_close(b.logits, a.logits[..., keep], atol=1e-6, rtol=0)
    cache = pruned.new_cache()
    pruned.extend_context(cache, features[:1, :5])
    head = pruned.draft_head(target)  # the rows a decoder gathers once
    assert head[0].shape == (40, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(pruned.draft_block(cache, tokens[:1, 5], target, head).logits,
                                   pruned.draft_block(cache, tokens[:1, 5], target).logits, atol=0, rtol=0)
    with pytest.raises(SpecdrafterError, match="40 increasing target ids"):
        pruned.set_draft_vocab(keep.flip(0))


# ------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_growing_decode_cache_drafts_what_recomputing_from_scratch_drafts(target, batch, kind):
    features, tokens = batch[0][:1], batch[1][:1]
    drafter = make_drafter(target, kind)
    cache = drafter.new_cache()
    with torch.no_grad():
        for length in (5, 8, 9, 11):  # committed positions after each cycle; the anchor is the token after them
            drafter.extend_context(cache, features[:, cache.length:length])
            grown = drafter.draft_block(cache, tokens[:, length], target)
            assert cache.length == length  # the block's keys were not kept
            fresh = drafter.new_cache()
            drafter.extend_context(fresh, drafter.fuse(features[:, :length]), fused=True)
            again = drafter.draft_block(fresh, tokens[:, length], target)
            trained = drafter.backbone(features[:, :length], drafter.block_inputs(tokens, torch.tensor([[length]])),
                                       torch.tensor([[length]]), target)
            torch.testing.assert_close(grown.logits, again.logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(grown.logits, trained.logits[:, 0], atol=1e-5, rtol=0)
            # DSpark decodes slot by slot: the previous token is the anchor, then the draft before
            prev = torch.cat([tokens[:, length:length + 1], tokens[:, length + 1:][:, :drafter.num_drafts - 1]], 1)
            if kind == "dspark" and prev.shape[1] == drafter.num_drafts:
                taught = drafter(features[:, :length], drafter.block_inputs(tokens, torch.tensor([[length]])),
                                 torch.tensor([[length]]), target, prev[:, None])
                for j in range(drafter.num_drafts):
                    logits, confidence = drafter.heads(grown.logits[:, j], grown.hidden[:, j], prev[:, j])
                    torch.testing.assert_close(logits, taught.logits[:, 0, j], atol=1e-5, rtol=0)
                    torch.testing.assert_close(confidence, taught.confidence[:, 0, j], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------- folders and helpers
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_saved_drafter_loads_and_drafts_the_same(tmp_path, target, batch, kind):
    drafter = make_drafter(target, kind, draft_vocab_size=64)
    drafter.set_draft_vocab(torch.arange(0, 128, 2))
    folder = save_block_drafter(drafter, tmp_path / kind)
    config = json.loads((folder / "config.json").read_text())
    assert config["variant"] == kind and config["aux_layer_ids"] == IDS and config["block_size"] == S
    assert config["model_type"] == "qwen3" and config["num_target_layers"] == L and config["draft_vocab_size"] == 64
    loaded = load_block_drafter(folder, variant=VARIANTS[kind])
    assert set(loaded.state_dict()) == set(drafter.state_dict())
    a, b = run(drafter, target, *batch), run(loaded, target, *batch)
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    other = "dspark" if kind == "dflash" else "dflash"
    with pytest.raises(SpecdrafterError, match=f"holds a {kind} drafter, not a {other} one"):
        load_block_drafter(folder, variant=VARIANTS[other])


@pytest.mark.parametrize("overrides, message", [
    (dict(mask_token_id=V), f"mask_token_id = {V} is outside the target's embedding"),
    (dict(mask_token_id=-1), "mask_token_id = -1 is outside"),
    (dict(aux_layer_ids=[2, L]), f"names {L}, the last layer's output, which the target reports after"),
    (dict(aux_layer_ids=[L + 1]), f"names {L + 1}, outside 1..{L - 1}"),
    (dict(aux_layer_ids=[0, 3]), "names 0, outside"),
    (dict(aux_layer_ids=[3, 1]), "are not increasing"),
    (dict(aux_layer_ids=[3, 3]), "repeat a layer"),
    (dict(aux_layer_ids=[]), "aux_layer_ids is empty"),
    (dict(block_size=1), "block_size = 1; a block is the anchor and at least one masked slot"),
    (dict(num_layers=0), "num_hidden_layers = 0; the backbone has at least one layer"),
    (dict(draft_vocab_size=V + 1), "draft_vocab_size"),
    (dict(markov_rank=4), "a DFlash drafter has no Markov or confidence head"),
])
def test_bad_settings_are_one_line(target, overrides, message):
    with pytest.raises(SpecdrafterError, match=message) as e:
        block_config(target.config, DFLASH, **{**dict(block_size=S, aux_layer_ids=IDS), **overrides})
    assert "\n" not in str(e.value)


def test_bad_folders_are_one_line(tmp_path, target):
    with pytest.raises(SpecdrafterError, match="no such folder"):
        load_block_drafter(tmp_path / "nothing")
    eagle = save_eagle3(Eagle3Head(eagle3_config(target.config, [1, 4, 7], V)), tmp_path / "eagle")
    with pytest.raises(SpecdrafterError, match="is not a block drafter folder"):
        load_block_drafter(eagle)
    folder = save_block_drafter(make_drafter(target, "dspark"), tmp_path / "dspark")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "aux_layer_ids": [1, L]}))
    with pytest.raises(SpecdrafterError, match="config.json': aux_layer_ids names 8, the last layer's output"):
        load_block_drafter(folder)
    outputs = {k: v for k, v in config.items() if k != "aux_layer_ids"}
    (folder / "config.json").write_text(json.dumps({**outputs, "target_layer_ids": [0, 2, 5]}))  # the engines' spelling
    with pytest.raises(SpecdrafterError, match=r"target_layer_ids is the engines' spelling .* \(here \[1, 3, 6\]\)"):
        load_block_drafter(folder)
    (folder / "config.json").write_text(json.dumps({**config, "block_size": "four"}))
    with pytest.raises(SpecdrafterError, match="block_size") as e:
        load_block_drafter(folder)
    assert "\n" not in str(e.value)
    (folder / "config.json").write_text(json.dumps({**config, "markov_rank": 4}))
    with pytest.raises(SpecdrafterError, match="do not fit its config.json"):
        load_block_drafter(folder)
    (folder / "config.json").write_text(json.dumps({**config, "enable_confidence_head": False}))
    with pytest.raises(SpecdrafterError, match="confidence_head.proj.bias, confidence_head.proj.weight not in a dspark"):
        load_block_drafter(folder)


def test_copy_the_targets_last_layers(target):
    drafter = make_drafter(target, "dflash")
    q_norm = drafter.layers[0].self_attn.q_norm.weight.clone()
    copied = copy_target_layers(drafter, target)
    assert len(copied) == 2 * 9 and "layers.0.self_attn.q_norm.weight" not in copied  # a Llama target has no q/k norm
    for i, source in enumerate(target.model.layers[L - 2:]):
        for name, tensor in source.state_dict().items():
            assert torch.equal(drafter.layers[i].state_dict()[name], tensor)
    assert torch.equal(drafter.layers[0].self_attn.q_norm.weight, q_norm)
    torch.manual_seed(0)
    wider = LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=L, intermediate_size=48))
    with pytest.raises(SpecdrafterError, match=r"mlp.gate_proj.weight is \[48, 32\] in the target, \[64, 32\] here"):
        copy_target_layers(drafter, wider)
    with pytest.raises(SpecdrafterError, match="the drafter has 9 layers, the target only 8"):
        copy_target_layers(make_drafter(target, "dflash", num_layers=9), target)
