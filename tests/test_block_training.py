"""Training a block drafter (train/block.py): anchors only where the next token is target-generated, each draft
compared with the target's row for the token it drafts, labels only over a contiguous supervised prefix, DSpark's
confidence term, and a mask token the data uses refused in one line."""

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama_config
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import Recipe
from specdrafter.jobs.train import lr_schedule, param_groups
from specdrafter.models.block import DFLASH, DSPARK, VARIANTS
from specdrafter.train.batches import Batch
from specdrafter.train.block import BlockTrainingDrafter, sample_anchors
from specdrafter.train.drafters import TargetOutput, counted_rows
from specdrafter.train.objectives import Objective

V = 64


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=4)).eval()


def recipe(variant: str, **block):
    cfg = OmegaConf.structured(Recipe)
    cfg.drafter.kind = variant
    settings = dict(num_layers=1, block_size=4, aux_layer_ids=[1, 3], mask_token_id=V - 1, anchors=6, markov_rank=4)
    settings.update(block)
    for key, value in settings.items():
        cfg.drafter.block[key] = value
    return cfg


def test_anchors_are_sorted_distinct_and_only_where_the_next_token_is_target_generated():
    torch.manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0],
                         [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]])  # the second has a single candidate, position 1
    for _ in range(20):
        anchors, valid = sample_anchors(mask, 4)
        for b in range(2):
            picked = anchors[b][valid[b]].tolist()
            assert picked == sorted(set(picked))
            assert all(mask[b, a] and mask[b, a + 1] for a in picked)
        assert valid[0].all() and valid[1].tolist() == [True, False, False, False] and anchors[1, 0] == 1
    seen = set()
    for _ in range(200):
        anchors, _ = sample_anchors(mask[:1], 1)
        seen.add(int(anchors[0, 0]))
    assert seen == {2, 3, 6, 7, 8}  # every candidate, and nothing else, is drawn


def one_hot_teacher(batch: Batch, features) -> TargetOutput:
    """A teacher whose row t is one-hot on the true next token x_{t+1}, at every row the loss may read."""
    b, t = counted_rows(batch.loss_mask, 1)
    row_index = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
    row_index[b, t] = torch.arange(len(b))
    logits = torch.full((len(b), V), -30.0)
    logits[torch.arange(len(b)), batch.input_ids[b, t + 1]] = 30.0
    return TargetOutput(features, logits, row_index)


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_each_draft_is_compared_with_the_target_row_of_the_token_it_drafts(target, variant):
    """With a teacher one-hot on the true next token, the teacher rows of draft j are exactly the tokens x_{a+1+j}
    of the anchors drawn, over the contiguous supervised prefix only (a prompt token at position 7 cuts blocks)."""
    drafter = BlockTrainingDrafter(recipe(variant), target, VARIANTS[variant])
    torch.manual_seed(3)
    ids = torch.randint(3, V - 1, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[:, :3] = 0  # the prompt
    mask[0, 7] = 0  # a prompt token inside the answer
    attention = torch.ones_like(mask)
    batch = Batch(ids, mask, attention)
    with torch.no_grad():
        captured = {}
        out = target(input_ids=ids, output_hidden_states=True)
        for k in drafter.module.feature_layers:  # our id k = HF hidden_states[k]
            captured[k] = out.hidden_states[k]
    teacher = one_hot_teacher(batch, captured)
    torch.manual_seed(11)
    predictions = drafter.predictions(drafter.module, batch, teacher)
    torch.manual_seed(11)
    anchors, valid = sample_anchors(mask, 6)
    assert [p.name for p in predictions] == drafter.prediction_names
    for j, p in enumerate(predictions):
        expected = []
        for b in range(2):
            for a, ok in zip(anchors[b].tolist(), valid[b].tolist()):
                prefix = range(a + 1, a + 2 + j)
                if ok and prefix[-1] < 14 and all(mask[b, i] for i in prefix):
                    expected.append(int(ids[b, a + 1 + j]))
        assert sorted(p.target_logits.argmax(-1).tolist()) == sorted(expected)
        assert p.weight == pytest.approx(torch.exp(torch.tensor(-j / 4.0)).item())
    assert len(predictions[0].target_logits) > len(predictions[-1].target_logits)  # the cut shortened blocks


def dspark_predictions(drafter, target, seed: int = 3):
    torch.manual_seed(seed)
    ids = torch.randint(3, V - 1, (1, 12))
    mask = torch.ones(1, 12, dtype=torch.long)
    batch = Batch(ids, mask, torch.ones_like(mask))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    teacher = one_hot_teacher(batch, {k: out.hidden_states[k] for k in drafter.module.feature_layers})
    torch.manual_seed(seed)  # the same anchors for every drafter built alike
    return drafter.predictions(drafter.module, batch, teacher)


def test_dspark_trains_its_confidence_towards_the_acceptance_of_its_draft(target):
    drafter = BlockTrainingDrafter(recipe("dspark"), target, DSPARK)
    predictions = dspark_predictions(drafter, target)
    objective = Objective({"soft_ce": 0.1, "tv": 0.9})
    confidence = drafter.module.confidence_head.proj
    total = sum(p.loss(objective)[0] for p in predictions)
    total.backward()
    assert confidence.weight.grad is not None and confidence.weight.grad.abs().sum() > 0
    assert all(p.confidence_loss is not None and p.confidence_loss > 0 for p in predictions)
    plain = BlockTrainingDrafter(recipe("dspark", confidence_weight=0.0), target, DSPARK)
    assert all(p.confidence_loss is None for p in dspark_predictions(plain, target))


def test_the_confidence_terms_decay_like_the_objective_when_asked(target):
    """drafter.block.confidence_decay: draft j's BCE term is the undecayed one × exp(−j / loss_decay), the same
    weight as its objective (DeepSpec's and speculators' trainers weight it so)."""
    torch.manual_seed(0)
    plain = BlockTrainingDrafter(recipe("dspark"), target, DSPARK)
    torch.manual_seed(0)
    decayed = BlockTrainingDrafter(recipe("dspark", confidence_decay=True), target, DSPARK)
    for p, d in zip(dspark_predictions(plain, target), dspark_predictions(decayed, target), strict=True):
        assert d.weight == p.weight < 1 or d.weight == p.weight == 1
        assert d.confidence_loss.item() == pytest.approx(p.weight * p.confidence_loss.item(), rel=1e-6)


@pytest.mark.parametrize("detach", [False, True])
def test_a_detached_confidence_head_sends_no_gradient_into_the_backbone(target, detach):
    """drafter.block.confidence_detach: the confidence BCE alone trains the head's projection and nothing under it
    (backbone layers, fc, Markov W1); without it, its gradient reaches them."""
    drafter = BlockTrainingDrafter(recipe("dspark", confidence_detach=detach), target, DSPARK)
    sum(p.confidence_loss for p in dspark_predictions(drafter, target)).backward()
    grads = {name: p.grad for name, p in drafter.module.named_parameters() if p.requires_grad}
    assert grads["confidence_head.proj.weight"].abs().sum() > 0
    reached = {n.split(".")[0] if n.startswith(("layers.", "fc.")) else n for n, g in grads.items()
               if n.startswith(("layers.", "fc.", "markov_head.markov_w1")) and g is not None and g.abs().sum() > 0}
    assert reached == (set() if detach else {"layers", "fc", "markov_head.markov_w1.weight"})


def test_the_markov_head_can_be_held_back_for_its_first_steps(target):
    """drafter.block.markov_hold: the Markov head's lr is 0 for that share of the run (0.3 of 10 steps: 3), then its
    scaled, scheduled lr; every other parameter follows the schedule from step 0."""
    drafter = BlockTrainingDrafter(recipe("dspark", markov_lr_scale=5.0, markov_hold=0.3), target, DSPARK)
    optimizer = torch.optim.AdamW(param_groups(drafter, 1e-3), lr=1e-3)
    schedule = lr_schedule(optimizer, lambda s: 0.5, 10)
    markov = {id(p) for p in drafter.module.markov_head.parameters()}
    lrs = []
    for _ in range(5):
        lrs.append({("markov" if id(g["params"][0]) in markov else "rest"): g["lr"] for g in optimizer.param_groups})
        optimizer.step()
        schedule.step()
    assert [lr["markov"] for lr in lrs] == [0, 0, 0, 2.5e-3, 2.5e-3]
    assert all(lr["rest"] == 5e-4 for lr in lrs)


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_the_markov_head_learns_at_its_own_rate(target, variant):
    """DSpark's Markov head (a sparse previous-token embedding and its output) gets markov_lr_scale × train.lr in the
    optimizer; everything else, and all of DFlash, the recipe's lr."""
    drafter = BlockTrainingDrafter(recipe(variant, markov_lr_scale=7.0), target, VARIANTS[variant])
    groups = param_groups(drafter, 1e-3)
    lr_of = {name: g["lr"] for g in groups for name, p in drafter.module.named_parameters()
             if any(p is q for q in g["params"])}
    assert lr_of == {name: 7e-3 if name.startswith("markov_head.") else 1e-3
                     for name, p in drafter.module.named_parameters()}
    assert any(lr == 7e-3 for lr in lr_of.values()) == (variant == "dspark")


def test_a_mask_token_the_training_data_uses_is_refused(target):
    data = SimpleNamespace(sequences=[torch.tensor([5, 9, V - 1, 4])], target_tokens=lambda: [])
    with pytest.raises(SpecdrafterError, match=f"'drafter.block.mask_token_id': token {V - 1} occurs in the training"):
        BlockTrainingDrafter(recipe("dflash"), target, DFLASH, data)


@pytest.mark.parametrize("recipe_name, overrides, message", [
    ("dflash", ["inference.k=8"], "'inference.k' \\(8\\) exceeds the 7 drafts of a block"),
    ("dspark", ["inference.k=9"], "'inference.k' \\(9\\) exceeds the 8 drafts of a block"),
    ("dflash", ["drafter.block.length=confidence"], "confidence needs DSpark's confidence head"),
    ("dspark", ["drafter.block.length=confidence", "inference.k=auto"], "set k to a number"),
    ("dspark", ["drafter.block.anchors=600"], "'drafter.block.anchors' \\(600\\): a sequence of train.max_length 512"),
    ("dspark", ["drafter.block.block_size=1"], "'drafter.block.block_size'"),
])
def test_block_recipe_settings_that_cannot_work_are_one_line(recipe_name, overrides, message):
    from conftest import REPO

    from specdrafter.core.recipe import RecipeError
    from specdrafter.jobs.recipe import load_recipe
    with pytest.raises(RecipeError, match=message):
        load_recipe(REPO / "recipes" / f"smollm2-135m-{recipe_name}.yaml", overrides)


def test_the_confidence_target_is_the_acceptance_over_the_whole_vocabulary():
    """With a pruned vocabulary the teacher's mass outside it counts as never accepted: α equals 1 − TV computed over
    the full vocabulary with the draft's q zero outside its tokens."""
    from specdrafter.train.objectives import acceptance, per_position
    torch.manual_seed(0)
    z, ids = torch.randn(5, V) * 3, torch.tensor([1, 4, 9, 20, 33, 50])
    draft = torch.randn(5, len(ids)) * 2
    full = torch.full((5, V), float("-inf"))
    full[:, ids] = draft
    for T in (1.0, 0.7):
        expected = 1 - per_position("tv", z, full, T)
        lse = torch.logsumexp(z / T, dim=-1)
        torch.testing.assert_close(acceptance(z[:, ids], draft, T, lse), expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(acceptance(z, torch.randn(5, V).mul(0).add(z), T), torch.ones(5))
