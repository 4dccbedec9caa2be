"""DFlash2 (drafter.kind=dflash2; models/block.py, train/block.py, docs/algorithms.md#dflash2): the convolution is
the identity at initialisation and causal inside each block, the selector's loss is the K-way CE a hand computation
gives (a true token outside the top K put in), a tiny DFlash2 trains its selector, decoding through the real loop is
exact (χ² of the first two tokens at T = 1, token identity at T = 0), the vllm folder carries the keys vLLM's and
llama.cpp's DFlash2 read, and a folder without its selector or convolutions is refused in one line."""

import json

import pytest
import torch
from conftest import assert_first_two_tokens_follow, sample_first_two_through_the_loop
from safetensors.torch import load_file, save_file
from test_block_inference import greedy_cycles, small_target
from test_block_training import V, recipe
from test_dpace import batch_and_teacher
from test_gguf import greedy_completion, needs_llamacpp

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.export.formats import export
from specdrafter.export.gguf import DRAFT_FILE, read_gguf
from specdrafter.inference.block import BlockProposer
from specdrafter.kinds import kind_of_gguf
from specdrafter.models.block import DFLASH, DFLASH2, BlockDrafter, DynamicConv, block_config
from specdrafter.models.block_folders import load_block_drafter, save_block_drafter
from specdrafter.train.block import BlockTrainingDrafter, selector_loss
from specdrafter.train.objectives import Objective

TINY_SELECTOR = dict(selector_rank=8, selector_top_k=4)


@pytest.fixture(scope="module")
def target():
    return small_target(V)


def drafter2(target, seed: int = 1, sharpen: float = 1.0, pair: float = 2.0, **selector) -> BlockDrafter:
    """A tiny DFlash2 whose convolutions are no longer the identity and whose selector's pair term moves the drafts."""
    torch.manual_seed(seed)
    config = block_config(target.config, DFLASH2, num_layers=1, block_size=4, aux_layer_ids=[1, 3],
                          mask_token_id=target.config.vocab_size - 1, selector={**TINY_SELECTOR, **selector})
    drafter = BlockDrafter(config).eval()
    with torch.no_grad():
        drafter.norm.weight.mul_(sharpen)
        for name, p in drafter.named_parameters():
            if "_conv." in name:
                p.add_(0.3 * torch.randn_like(p))
        s = drafter.candidate_selector
        s.predecessor_codebook.normal_(0, pair)
        s.successor_codebook.normal_(0, pair)
        s.hidden_projection.weight.normal_(0, 1.0)
    return drafter


def test_the_convolution_starts_as_the_identity_and_stays_inside_each_block_causally(target):
    torch.manual_seed(0)
    conv = DynamicConv(16, 3, 4)
    conv.reset()
    x = torch.randn(2, 12, 16)  # 3 blocks of 4 slots
    y, delta = conv.prepare(x, 4)
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(conv.finish(x, delta, 4), x)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    y, _ = conv.prepare(x, 4)
    changed = x.clone()
    changed[:, 5] += 1.0  # slot 1 of block 1
    z, _ = conv.prepare(changed, 4)
    moved = (z - y).abs().sum(-1) > 1e-6  # [2, 12]
    # slot 1 itself (its own tap and its δ) and slots 2, 3 of its block (taps 1, 2); no other block, no earlier slot
    assert moved[:, 5:8].all() and not moved[:, :5].any() and not moved[:, 8:].any()
    # a DFlash2 fresh from init drafts the backbone logits of a DFlash with the same weights
    d2 = BlockDrafter(block_config(target.config, DFLASH2, block_size=4, aux_layer_ids=[1, 3], mask_token_id=V - 1,
                                   selector=TINY_SELECTOR))
    d1 = BlockDrafter(block_config(target.config, DFLASH, block_size=4, aux_layer_ids=[1, 3], mask_token_id=V - 1))
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in d1.state_dict()})
    ids, context, anchors = torch.randint(0, V - 1, (2, 10)), torch.randn(2, 10, 32), torch.tensor([[1, 4], [0, 6]])
    torch.testing.assert_close(d2(context, d2.block_inputs(ids, anchors), anchors, target).logits,
                               d1(context, d1.block_inputs(ids, anchors), anchors, target).logits)


def test_the_selector_loss_is_the_k_way_ce_of_the_true_token_with_a_missing_one_put_in(target):
    drafter = drafter2(target)
    torch.manual_seed(5)
    logits, hidden = torch.randn(3, V), torch.randn(3, 16)
    prev = torch.tensor([4, 9, 4])
    top = logits.topk(4).indices
    gold = torch.tensor([int(top[0, 2]), int(top[1, 0]), int(logits.argmin(1)[2])])  # the third outside the top 4
    s = drafter.candidate_selector
    expected = []
    for r in range(3):
        candidates = top[r].clone()
        if gold[r] not in candidates:
            candidates[-1] = gold[r]
        score = logits[r, candidates] + s.successor_codebook[candidates] @ (
            s.hidden_projection(hidden[r]) * s.predecessor_codebook[prev[r]])
        expected.append(-score.log_softmax(-1)[candidates.tolist().index(int(gold[r]))])
    torch.testing.assert_close(selector_loss(drafter, logits, hidden, prev, gold), torch.stack(expected).mean())


def train(target, steps: int = 6, **block):
    torch.manual_seed(0)
    cfg = recipe("dflash2", **{"markov_rank": 0, **{k: v for k, v in TINY_SELECTOR.items()}, **block})
    drafter = BlockTrainingDrafter(cfg, target, DFLASH2)
    batch, teacher = batch_and_teacher(drafter, target)
    optimizer = torch.optim.AdamW(drafter.module.parameters(), lr=3e-3)
    objective, losses, selector = Objective({"soft_ce": 1.0}), [], []
    for _ in range(steps):
        torch.manual_seed(11)  # the same anchors each step
        predictions = drafter.predictions(drafter.module, batch, teacher)
        loss = sum(p.loss(objective)[0] for p in predictions)
        optimizer.zero_grad()
        loss.backward()
        grads = {n: p.grad for n, p in drafter.module.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
        selector.append(sum(p.selector_loss.item() for p in predictions if p.selector_loss is not None))
    return losses, selector, grads


def test_a_tiny_dflash2_trains_its_selector_and_convolutions(target, one_thread):
    losses, selector, grads = train(target)
    assert all(b < a for a, b in zip(losses, losses[1:])) and selector[-1] < selector[0]
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.kernel_projection.weight",
                 "layers.0.mlp_conv.base_kernel"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    without, none, _ = train(target, steps=2, selector_weight=0.0)
    assert none == [0.0, 0.0] and without[0] < losses[0]  # weight 0: no selector term


def test_greedy_dflash2_decoding_is_token_identical_to_the_target(one_thread):
    target = small_target(64, sharpen=8.0)
    greedy_cycles(target, BlockProposer(drafter2(target, seed=2, sharpen=4.0, pair=0.2), target))


def test_dflash2_decoding_at_temperature_1_samples_the_first_two_tokens_from_the_target(one_thread):
    """χ² (level 1e-4, fixed seed) over the 64 cells of the first two tokens of an 8-token vocabulary: each draft drawn
    from the selector's scores of its slot's top 4 given the draft before (0 on the other 4 tokens), and verified with
    that same row."""
    target = small_target(8, sharpen=6.0)
    drafter = drafter2(target, sharpen=3.0)
    proposer = BlockProposer(drafter, target)
    rows = []
    propose = proposer.propose

    def recorded(committed, k, params, generator=None):
        proposal = propose(committed, k, params, generator)
        rows.append(proposal.probs)
        return proposal
    proposer.propose = recorded
    prompt, n = [3, 5], 1500
    counts, accepted, drafted = sample_first_two_through_the_loop(target, proposer, prompt, n, tree=False)
    assert 0 < accepted < drafted
    assert all(int((q > 0).sum(-1).max()) <= 4 for q in rows)  # q lives on the 4 candidates
    assert len({tuple(q[1].tolist()) for q in rows if len(q) > 1}) > 1  # the second row depends on the first draft
    assert_first_two_tokens_follow(target, prompt, counts, n)


def test_a_folder_without_its_selector_or_convolutions_is_one_line(tmp_path, target):
    drafter = drafter2(target)
    folder = save_block_drafter(drafter, tmp_path / "d")
    assert load_block_drafter(folder, DFLASH2).candidate_selector is not None
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("candidate_selector.")}, folder / "model.safetensors")
    with pytest.raises(SpecdrafterError, match="missing candidate_selector") as e:
        load_block_drafter(folder)
    assert "\n" not in str(e.value)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "selector_rank": 0}))
    with pytest.raises(SpecdrafterError, match="selector_rank = 0; a dflash2 drafter needs its convolutions") as e:
        load_block_drafter(folder)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------- export
DFLASH2_RUN = ["drafter.block.selector_rank=8", "drafter.block.selector_top_k=4"]  # llama.cpp: K·(K + 1) <= 64


def test_the_vllm_folder_carries_what_vllm_and_llamacpp_read_and_speculators_is_refused(tmp_path, drafter_run_of):
    run = drafter_run_of("dflash2", *DFLASH2_RUN)
    out = export(run, "vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [0, 2, 4], "conv_kernel_size": 2,
                                       "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    assert not {"selector_rank", "conv_kernel_size", "variant"} & set(config)  # only inside dflash_config
    names = set(load_file(out / "model.safetensors"))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.0.mlp_conv.kernel_projection.weight"} <= names and "d2t" not in names
    assert load_block_drafter(out).candidate_selector is not None  # the engines' layout reads back as ours
    assert "num_speculative_tokens\": 3" in (out / "README.md").read_text()
    with pytest.raises(SpecdrafterError) as e:
        export(run, "speculators", tmp_path / "spec")
    assert "\n" not in str(e.value) and not (tmp_path / "spec").exists()


@needs_llamacpp
def test_llamacpp_converts_it_and_llama_server_decodes_as_the_target_alone(tmp_path, drafter_run_of, gguf_target_dir):
    """Through the pinned converter: a DFlash2 GGUF (dflash architecture with the selector), reading the trained
    layers; served with --spec-type draft-dflash, greedy, 24 tokens identical to the target alone."""
    out = export(drafter_run_of("dflash2", *DFLASH2_RUN), "gguf", tmp_path / "gguf")
    facts = read_gguf(out / DRAFT_FILE)
    assert facts["arch"] == "dflash" and facts["target_layers"] == [1, 3, 5]
    assert {"selector_hidden.weight", "blk.0.attn_conv_base"} <= set(facts["tensors"])
    assert kind_of_gguf(facts).name == "dflash2"
    target_gguf = tmp_path / "target.gguf"
    llamacpp.convert(gguf_target_dir, target_gguf)
    prompt = list(range(100, 120))
    alone = greedy_completion(target_gguf, prompt, 24)
    drafted = greedy_completion(target_gguf, prompt, 24, draft=out / DRAFT_FILE, spec_type="draft-dflash", n_max=3)
    assert len(alone["tokens"]) == 24 and drafted["tokens"] == alone["tokens"]
    assert drafted["timings"]["draft_n"] > 0


def test_a_top_k_llamacpp_cannot_pack_is_one_line(tmp_path, drafter_run_of):
    with pytest.raises(SpecdrafterError, match=r"must be >= 72 \(this one: 64\)") as e:
        export(drafter_run_of("dflash2", "drafter.block.selector_rank=8", "drafter.block.selector_top_k=8"), "gguf",
               tmp_path / "gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "gguf").exists()
