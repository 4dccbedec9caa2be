"""Distillation objectives: closed forms on handcrafted distributions, -inf handling, masking, gradients."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from specdrafter.core.recipe import Recipe
from specdrafter.core.recipe_checks import OBJECTIVES
from specdrafter.train.memory import OBJECTIVE_BYTES, objective_bytes
from specdrafter.train.objectives import DIVERGENCES, Objective, distill_loss, feature_loss, per_position

INF = float("inf")
LOG2 = math.log(2)


def logits_of(*probs: float) -> torch.Tensor:
    """Logits whose softmax is exactly `probs` (0 → -inf), as a [1, V] float64 row."""
    return torch.tensor([[math.log(x) if x > 0 else -INF for x in probs]], dtype=torch.float64)


def random_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


# ------------------------------------------------------------------------------------------ closed forms
def test_closed_forms_with_a_zero_in_p():
    p, q = [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]
    t, d = logits_of(*p), logits_of(*q)
    m = [(x + y) / 2 for x, y in zip(p, q)]
    expected = {"tv": 0.5, "fkl": LOG2, "rkl": INF,  # q puts mass where p has none
                "jsd": 0.5 * kl(p, m) + 0.5 * kl(q, m), "soft_ce": LOG2 + LOG2}  # fkl + H(p)
    for name, value in expected.items():
        assert per_position(name, t, d).item() == pytest.approx(value, rel=1e-12), name


def test_closed_forms_full_support():
    p, q = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]
    t, d = logits_of(*p), logits_of(*q)
    m = [0.3 * x + 0.7 * y for x, y in zip(p, q)]
    h_p = -sum(x * math.log(x) for x in p)
    expected = {"tv": 0.3, "fkl": kl(p, q), "rkl": kl(q, p), "soft_ce": kl(p, q) + h_p}
    for name, value in expected.items():
        assert per_position(name, t, d).item() == pytest.approx(value, rel=1e-12), name
    jsd = per_position("jsd", t, d, jsd_beta=0.3).item()
    assert jsd == pytest.approx(0.3 * kl(p, m) + 0.7 * kl(q, m), rel=1e-12)


def test_equal_distributions_give_zero():
    z = random_logits(2, 3, 11)
    z[..., 4] = -INF
    for name in ("tv", "fkl", "rkl", "jsd"):
        assert torch.allclose(per_position(name, z, z.clone()), torch.zeros(2, 3, dtype=torch.float64),
                              atol=1e-12), name


def test_tv_is_one_minus_acceptance_and_soft_ce_is_fkl_plus_entropy():
    t, d = random_logits(4, 9, seed=1), random_logits(4, 9, seed=2)
    p, q = t.softmax(-1), d.softmax(-1)
    assert torch.allclose(per_position("tv", t, d), 1 - torch.minimum(p, q).sum(-1))
    entropy = -(p * p.log()).sum(-1)
    assert torch.allclose(per_position("soft_ce", t, d), per_position("fkl", t, d) + entropy)


def test_jsd_half_is_symmetric_and_bounded_by_log2():
    t, d = random_logits(5, 7, seed=3) * 4, random_logits(5, 7, seed=4) * 4
    assert torch.allclose(per_position("jsd", t, d), per_position("jsd", d, t))
    assert (per_position("jsd", t, d) <= LOG2).all()
    # Disjoint supports attain the bound.
    assert per_position("jsd", logits_of(1.0, 0.0), logits_of(0.0, 1.0)).item() == pytest.approx(LOG2)


def test_fkl_is_inf_where_q_misses_p():
    t, d = logits_of(0.5, 0.5), logits_of(1.0, 0.0)
    assert per_position("fkl", t, d).item() == INF
    assert per_position("soft_ce", t, d).item() == INF


# ------------------------------------------------------------------------------------------ -inf logits
@pytest.mark.parametrize("name", OBJECTIVES)
def test_entry_masked_in_both_equals_dropping_it(name):
    t, d = random_logits(3, 6, seed=5), random_logits(3, 6, seed=6)
    t_masked, d_masked = t.clone(), d.clone()
    t_masked[:, 2], d_masked[:, 2] = -INF, -INF
    d_masked.requires_grad_(True)
    loss = per_position(name, t_masked, d_masked)
    keep = [0, 1, 3, 4, 5]
    assert torch.allclose(loss, per_position(name, t[:, keep], d[:, keep]))
    loss.sum().backward()
    assert torch.isfinite(d_masked.grad).all()
    assert (d_masked.grad[:, 2] == 0).all()


# ------------------------------------------------------------------------------------------ temperature
@pytest.mark.parametrize("name", OBJECTIVES)
def test_temperature_divides_logits(name):
    t, d = random_logits(2, 8, seed=7), random_logits(2, 8, seed=8)
    assert torch.allclose(per_position(name, t, d, temperature=2.5), per_position(name, t / 2.5, d / 2.5))


# ------------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "soft_ce", "tv"])
def test_gradcheck_wrt_draft_logits(name):
    t = random_logits(2, 5, seed=9)
    d = random_logits(2, 5, seed=10).requires_grad_(True)
    if name == "tv":  # |p - q| is smooth only where p != q elementwise; generic random points are
        assert ((t.softmax(-1) - d.softmax(-1)).abs() > 1e-3).all()
    assert torch.autograd.gradcheck(lambda z: per_position(name, t, z, temperature=1.3), (d,))


def test_tv_gradient_closed_form():
    t = random_logits(6, seed=11)
    d = random_logits(6, seed=12).requires_grad_(True)
    per_position("tv", t, d).backward()
    p, q = t.softmax(-1), d.detach().softmax(-1)
    jacobian = torch.diag(q) - q[:, None] * q[None, :]  # dq_i/dz_j = q_i (δ_ij - q_j)
    expected = 0.5 * (torch.sign(q - p)[:, None] * jacobian).sum(0)  # [V]
    assert torch.allclose(d.grad, expected)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_target_gets_no_gradient(name):
    t = random_logits(2, 5, seed=13).requires_grad_(True)
    d = random_logits(2, 5, seed=14).requires_grad_(True)
    distill_loss(t, d, torch.ones(2), {name: 1.0}).total.backward()
    assert t.grad is None
    assert d.grad is not None and d.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ distill_loss
def test_masked_positions_are_ignored_exactly():
    t, d = random_logits(2, 4, 7, seed=15), random_logits(2, 4, 7, seed=16)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]], dtype=torch.bool)
    weights = {"tv": 1.0, "fkl": 0.5, "rkl": 0.25, "jsd": 2.0, "soft_ce": 0.1}

    def run(target, draft):
        draft = draft.clone().requires_grad_(True)
        out = distill_loss(target, draft, mask, weights)
        out.total.backward()
        return out, draft.grad

    out, grad = run(t, d)
    t2, d2 = t.clone(), d.clone()
    t2[~mask] = random_logits(3, 7, seed=17) * 50
    d2[~mask] = -INF  # rkl, fkl would be inf/NaN here if masked positions leaked in
    d2[~mask, 0] = 0.0
    out2, grad2 = run(t2, d2)
    assert out2.total.item() == out.total.item()
    assert out2.parts == out.parts
    assert torch.equal(grad2, grad)
    assert (grad[~mask] == 0).all()
    for name in weights:  # masked mean = mean over the kept positions
        assert out.parts[name] == pytest.approx(per_position(name, t, d)[mask].mean().item(), rel=1e-12)


def test_weights_combine_linearly_and_only_nonzero_are_computed():
    t, d = random_logits(3, 5, 6, seed=18), random_logits(3, 5, 6, seed=19)
    mask = torch.ones(3, 5)
    mask[0, :2] = 0
    tv = distill_loss(t, d, mask, {"tv": 1.0}).total
    jsd = distill_loss(t, d, mask, {"jsd": 1.0}).total
    both = distill_loss(t, d, mask, {"tv": 0.7, "jsd": 3.0, "fkl": 0.0})
    assert torch.allclose(both.total, 0.7 * tv + 3.0 * jsd)
    assert set(both.parts) == {"tv", "jsd"}
    assert both.parts["tv"] == pytest.approx(tv.item()) and both.parts["jsd"] == pytest.approx(jsd.item())


def test_all_masked_gives_zero_not_nan():
    t, d = random_logits(2, 3, 4, seed=20), random_logits(2, 3, 4, seed=21)
    assert distill_loss(t, d, torch.zeros(2, 3), {"fkl": 1.0}).total.item() == 0.0


def test_unknown_objective_raises():
    t, d = random_logits(2, 4, seed=22), random_logits(2, 4, seed=23)
    with pytest.raises(ValueError, match=r"'kl'.*tv, fkl, rkl, jsd, soft_ce"):
        distill_loss(t, d, torch.ones(2), {"tv": 1.0, "kl": 0.0})
    with pytest.raises(ValueError, match="'kl'"):
        per_position("kl", t, d)


# ------------------------------------------------------------------------------------------ the recipe's objective
def test_the_schema_the_loss_and_the_planner_name_the_same_objectives():
    """core/recipe_checks.py's OBJECTIVES (what a recipe may weight, checked before train/ loads) are the loss's dispatch
    table and the memory model's table, no more and no fewer."""
    assert tuple(DIVERGENCES) == OBJECTIVES
    assert set(OBJECTIVE_BYTES) == set(OBJECTIVES)


def test_an_empty_train_objective_is_soft_ce_everywhere():
    cfg = OmegaConf.structured(Recipe)
    assert dict(cfg.train.objective) == {}
    assert Objective.of(cfg.train) == Objective({"soft_ce": 1.0}, cfg.train.temperature, cfg.train.jsd_beta)
    empty = objective_bytes(cfg)
    cfg.train.objective = {"soft_ce": 1.0}
    assert objective_bytes(cfg) == empty
    cfg.train.objective, cfg.train.temperature, cfg.train.jsd_beta = {"tv": 0.5, "jsd": 2.0}, 0.7, 0.25
    assert Objective.of(cfg.train) == Objective({"tv": 0.5, "jsd": 2.0}, 0.7, 0.25)
    assert objective_bytes(cfg) != empty


def test_the_objective_is_distill_loss_and_reads_nothing_back(monkeypatch):
    """The training loss hands back tensors only: a value read back (.item(), .tolist(), float()) is a device sync
    per prediction per micro-batch on a GPU; the parts are read once, when logged."""
    t, d = random_logits(3, 6, seed=24), random_logits(3, 6, seed=25)
    mask = torch.tensor([1, 0, 1])
    objective = Objective({"tv": 0.3, "jsd": 1.5}, 0.8, 0.3)
    expected = distill_loss(t, d, mask, objective.weights, 0.8, 0.3)
    reads = []
    for method in ("item", "tolist", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, name=method: reads.append(name))
    value = objective(t, d, mask)
    out = distill_loss(t, d, mask, objective.weights, 0.8, 0.3)
    monkeypatch.undo()
    assert reads == []
    assert torch.equal(value, expected.total) and torch.equal(out.total, expected.total)
    assert out.parts == expected.parts and set(out.parts) == {"tv", "jsd"}


# ------------------------------------------------------------------------------------------ feature_loss
def test_feature_loss_matches_hand_computation():
    predicted = torch.tensor([[[0.0, 2.0], [1.0, 1.0]], [[0.5, -3.0], [9.0, 9.0]]])  # [2, 2, d=2]
    target = torch.tensor([[[0.5, 0.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # SmoothL1(β=1): 0.5 x² for |x| < 1 else |x| - 0.5; mean over d, then over the 3 kept positions.
    per_pos = [(0.125 + 1.5) / 2, 0.0, (0.125 + 2.5) / 2]
    assert feature_loss(predicted, target, mask).item() == pytest.approx(sum(per_pos) / 3)
