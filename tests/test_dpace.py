"""D-PACE (train/objectives.py:dpace_weights, drafter.block.loss_weighting=dpace; docs/algorithms.md#d-pace): the
weights against a hand computation, their special cases (α = 1: a linear schedule; α = 0: the gradient of the
block's expected accepted length), a block drafter's rows weighted by them, and a tiny DFlash that trains with them,
bit-identically on a rerun."""

import pytest
import torch
from conftest import REPO, tiny_llama_config
from test_block_training import V, one_hot_teacher, recipe
from transformers import LlamaForCausalLM

from specdrafter.core.recipe import BlockLossWeighting
from specdrafter.models.block import DFLASH, VARIANTS
from specdrafter.train.batches import Batch
from specdrafter.train.block import BlockTrainingDrafter, sample_anchors
from specdrafter.train.drafters import Prediction, TargetOutput
from specdrafter.train.objectives import Objective, dpace_weights

DPACE = BlockLossWeighting.dpace


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=4)).eval()


def test_the_weights_match_a_hand_computation():
    q = torch.tensor([[0.8, 0.5, 0.2], [0.8, 0.5, 0.2], [0.8, 0.5, 0.2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    # q̃ = 0.5 q + 0.5 = 0.9, 0.75, 0.6; C = 0.9, 0.675, 0.405; w_j = Σ_{m≥j} C_m
    expected = torch.tensor([[1.98, 1.08, 0.405],
                             [1.575, 0.675, 0.0],  # the last slot unsupervised: no weight, nothing added
                             [1.44, 0.0, 0.54]])  # a masked slot is a no-op in the product: C_2 = 0.9 · 0.6
    torch.testing.assert_close(dpace_weights(q, mask, 0.5), expected)


def test_alpha_one_is_a_linear_schedule_and_the_weights_are_detached():
    q = torch.rand(4, 7, requires_grad=True)
    w = dpace_weights(q, torch.ones(4, 7), 1.0)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.arange(7, 0, -1.0).expand(4, 7))
    with pytest.raises(ValueError, match="dpace_alpha must be in"):
        dpace_weights(q, torch.ones(4, 7), 1.5)


def test_alpha_zero_follows_the_gradient_of_the_expected_accepted_length():
    """At α = 0, Σ_j w_j · CE_j has the gradient of −Σ_m Π_{i≤m} q_i (the drafts a block gets accepted, its
    positions independent): D-PACE's weights are that sum's derivative in each log q_j."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5))
    log_q = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]  # [3, 5]
    w = dpace_weights(log_q.exp(), torch.ones(3, 5), 0.0)
    (grad_dpace,) = torch.autograd.grad((w * -log_q).sum(), logits, retain_graph=True)
    (grad_length,) = torch.autograd.grad(-log_q.cumsum(-1).exp().sum(), logits)
    torch.testing.assert_close(grad_dpace, grad_length)


def test_a_prediction_with_row_weights_takes_their_weighted_mean():
    torch.manual_seed(0)
    draft, teacher = torch.randn(4, 9, requires_grad=True), torch.randn(4, 9)
    rows = torch.tensor([True, True, False, True])
    weights = torch.tensor([2.0, 0.5, 7.0, 1.0])
    objective = Objective({"soft_ce": 1.0})
    ce = -(teacher.softmax(-1) * draft.log_softmax(-1)).sum(-1)  # [4]
    loss, value = Prediction("draft1", 0.3, draft, teacher, loss_rows=rows, row_weights=weights).loss(objective)
    torch.testing.assert_close(loss, 0.3 * (2.0 * ce[0] + 0.5 * ce[1] + ce[3]) / 3)
    torch.testing.assert_close(value, (ce[0] + ce[1] + ce[3]) / 3)  # logged unweighted, as without row weights
    loss.backward()
    assert torch.isfinite(draft.grad).all() and draft.grad[2].abs().sum() == 0
    plain, _ = Prediction("draft1", 0.3, draft, teacher, loss_rows=rows).loss(objective)
    ones, _ = Prediction("draft1", 0.3, draft, teacher, loss_rows=rows, row_weights=torch.ones(4)).loss(objective)
    torch.testing.assert_close(ones, plain)


def batch_and_teacher(drafter, target, seed=3):
    torch.manual_seed(seed)
    ids = torch.randint(3, V - 1, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[:, :3] = 0  # the prompt
    mask[0, 7] = 0  # a prompt token inside the answer: blocks across it are cut
    batch = Batch(ids, mask, torch.ones_like(mask))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    teacher = one_hot_teacher(batch, {k: out.hidden_states[k] for k in drafter.module.feature_layers})
    if drafter.teacher_ids is not None:  # a pruned vocabulary: the teacher's draft-vocabulary rows, as run_target gives
        full, vocab = teacher.logits, drafter.teacher_ids
        teacher = TargetOutput(teacher.features, full[:, vocab], teacher.row_index, full.logsumexp(-1),
                               torch.isin(full.argmax(-1), vocab))
    return batch, teacher


@pytest.mark.parametrize("variant, pruned", [("dflash", False), ("dspark", False), ("dflash", True)])
def test_a_block_drafters_rows_carry_the_dpace_weights_of_their_block(target, variant, pruned):
    """Each draft's rows weighted by D-PACE over its block, from the draft's probability of the block's true token
    (0 where a pruned vocabulary lacks it), recomputed here block by block; the decay schedule replaced (weight 1)."""
    settings = dict(loss_weighting=DPACE, dpace_alpha=0.4, draft_vocab_size=V // 2 if pruned else 0)
    drafter = BlockTrainingDrafter(recipe(variant, **settings), target, VARIANTS[variant])
    vocab = torch.arange(V) if not pruned else torch.arange(0, V, 2)  # the even tokens only
    if pruned:
        drafter.module.set_draft_vocab(vocab)
    batch, teacher = batch_and_teacher(drafter, target)
    torch.manual_seed(11)
    predictions = drafter.predictions(drafter.module, batch, teacher)
    torch.manual_seed(11)
    anchors, valid = sample_anchors(batch.loss_mask, 6)
    γ, mask = len(predictions), batch.loss_mask
    seen = [0] * γ  # rows of draft j read so far (rows come block by block, in anchor order)
    for b in range(2):
        for a, ok in zip(anchors[b].tolist(), valid[b].tolist()):
            span = 0  # the block's contiguous supervised prefix
            while ok and span < γ and a + 1 + span < 14 and all(mask[b, i] for i in range(a + 1, a + 2 + span)):
                span += 1
            q = torch.zeros(γ)
            for j in range(span):
                p = predictions[j]
                row, token = seen[j], int(batch.input_ids[b, a + 1 + j])
                assert pruned or p.target_logits[row].argmax() == token
                if token in vocab:
                    q[j] = p.draft_logits[row].detach().softmax(-1)[vocab.tolist().index(token)]
            smooth = 0.6 * q[:span] + 0.4
            for j in range(span):
                expected = sum(smooth[: m + 1].prod() for m in range(j, span))
                assert predictions[j].row_weights[seen[j]].item() == pytest.approx(expected.item(), rel=1e-5)
                seen[j] += 1
    assert seen == [len(p.draft_logits) for p in predictions] and seen[0] > seen[-1] > 0
    assert all(p.weight == 1.0 for p in predictions)
    plain = BlockTrainingDrafter(recipe(variant), target, VARIANTS[variant])
    torch.manual_seed(11)
    assert all(p.row_weights is None for p in plain.predictions(plain.module, *batch_and_teacher(plain, target)))


def train(target, weighting: str, steps: int = 8):
    torch.manual_seed(0)
    drafter = BlockTrainingDrafter(recipe("dflash", loss_weighting=BlockLossWeighting(weighting)), target, DFLASH)
    batch, teacher = batch_and_teacher(drafter, target)
    optimizer = torch.optim.AdamW(drafter.module.parameters(), lr=3e-3)
    objective, losses = Objective({"soft_ce": 1.0}), []
    for _ in range(steps):
        torch.manual_seed(11)  # the same anchors each step: the loss of one batch, going down
        parts = [p.loss(objective) for p in drafter.predictions(drafter.module, batch, teacher)]
        loss = sum(share for share, _ in parts)
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in drafter.module.parameters() if p.grad is not None)
        optimizer.step()
        losses.append((loss.item(), sum(value.item() for _, value in parts)))  # (the loss, the drafts' CE)
    return losses


def test_a_tiny_dflash_trains_with_dpace_and_reruns_bit_identically(target):
    losses = train(target, "dpace")
    assert torch.isfinite(torch.tensor(losses)).all()
    for k in range(2):  # the D-PACE loss and the drafts' unweighted CE: down at every step (one batch, fixed anchors)
        series = [step[k] for step in losses]
        assert all(b < a for a, b in zip(series, series[1:])) and series[-1] < 0.95 * series[0]
    assert train(target, "dpace") == losses  # deterministic
    assert train(target, "decay") != losses  # and not the decay schedule's run


def test_the_recipe_selects_it_and_refuses_a_bad_alpha_in_one_line():
    from specdrafter.core.recipe import RecipeError
    from specdrafter.jobs.recipe import load_recipe
    path = REPO / "recipes" / "smollm2-135m-dflash.yaml"
    cfg = load_recipe(path, ["drafter.block.loss_weighting=dpace", "drafter.block.dpace_alpha=0.3"])
    assert cfg.drafter.block.loss_weighting.value == "dpace" and cfg.drafter.block.dpace_alpha == 0.3
    assert load_recipe(path).drafter.block.loss_weighting.value == "decay"
    with pytest.raises(RecipeError, match="'drafter.block.dpace_alpha'"):
        load_recipe(path, ["drafter.block.dpace_alpha=0"])
    with pytest.raises(RecipeError, match="'drafter.block.loss_weighting'"):
        load_recipe(path, ["drafter.block.loss_weighting=linear"])
