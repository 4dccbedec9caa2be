"""Domino (drafter.kind=domino; models/block.py, train/block.py, docs/algorithms.md#domino): the teacher-forced
correction of whole blocks is the one decoding computes draft by draft with the GRU state carried, and a hand
computation; the uncorrected logits' share λ falls as SpecForge's schedule does; a tiny Domino trains its GRU and
correction; decoding through the real loop is exact (χ² of the first two tokens at T = 1, token identity at T = 0);
the vllm / sglang folder carries the dflash_config keys vLLM's and SGLang's DFlash path read, gguf and speculators are
refused, and a folder without its GRU correction is refused in one line."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_first_two_tokens_follow, sample_first_two_through_the_loop
from safetensors.torch import load_file, save_file
from test_block_inference import greedy_cycles, small_target
from test_block_training import V, recipe
from test_dpace import batch_and_teacher

from specdrafter.core.io import SpecdrafterError
from specdrafter.export.formats import export
from specdrafter.inference.block import BlockProposer
from specdrafter.kinds import KINDS, kind_of_config
from specdrafter.models.block import DOMINO, BlockDrafter, block_config
from specdrafter.models.block_folders import load_block_drafter, save_block_drafter
from specdrafter.train.block import BlockTrainingDrafter
from specdrafter.train.objectives import Objective

TINY_CORRECTION = dict(gru_hidden_dim=12, emb_dim=6, pure_draft_prefix_len=1)


@pytest.fixture(scope="module")
def target():
    return small_target(V)


def domino(target, seed: int = 1, sharpen: float = 1.0, scale: float = 1.0, **correction) -> BlockDrafter:
    """A tiny Domino whose correction moves the drafts (its output layer scaled by `scale`)."""
    torch.manual_seed(seed)
    config = block_config(target.config, DOMINO, num_layers=1, block_size=4, aux_layer_ids=[1, 3],
                          mask_token_id=target.config.vocab_size - 1, correction={**TINY_CORRECTION, **correction})
    drafter = BlockDrafter(config).eval()
    with torch.no_grad():
        drafter.norm.weight.mul_(sharpen)
        drafter.embed_proj[0].weight.normal_(0, 0.5)
        drafter.embed_proj[2].weight.normal_(0, scale)
    return drafter


def test_the_teacher_forced_correction_is_what_decoding_computes_draft_by_draft(target):
    drafter = domino(target)
    torch.manual_seed(5)
    ids, context, anchors = torch.randint(0, V - 1, (2, 12)), torch.randn(2, 12, 32), torch.tensor([[1, 5], [0, 6]])
    prev = drafter.teacher_prev(ids, anchors)  # [2, 2, 4] x_a .. x_{a+3}
    with torch.no_grad():
        drafts = drafter(context, drafter.block_inputs(ids, anchors), anchors, target, prev)
    assert drafter.num_drafts == 4 and drafts.logits.shape == drafts.base.shape == (2, 2, 4, V)
    torch.testing.assert_close(drafts.logits[..., 0, :], drafts.base[..., 0, :])  # the first draft: uncorrected
    assert (drafts.logits[..., 1:, :] - drafts.base[..., 1:, :]).abs().amin() > 0
    with torch.no_grad():
        for b, n in ((0, 1), (1, 0)):
            state = None
            for j in range(4):  # decoding's order: the GRU reads the token before draft j, then draft j's row
                state = drafter.read(state, prev[b, n, j:j + 1], target)
                row, _ = drafter.heads(drafts.base[b, n, j][None], drafts.hidden[b, n, j][None], prev[b, n, j:j + 1],
                                       state=state, draft=j)
                torch.testing.assert_close(row[0], drafts.logits[b, n, j], atol=1e-5, rtol=1e-5)
        # draft 2 by hand: the GRU over the embeddings of x_a, x_{a+1}, x_{a+2}, then W_b SiLU(W_a [h ; g])
        gru, (first, _, second) = drafter.prefix_gru, drafter.embed_proj
        g = torch.zeros(12)
        for token in prev[0, 1, :3]:
            x = target.get_input_embeddings().weight[token]
            r, z, c = (gru.weight_ih_l0 @ x).chunk(3)
            hr, hz, hc = (gru.weight_hh_l0 @ g).chunk(3)
            reset, update = torch.sigmoid(r + hr), torch.sigmoid(z + hz)
            g = (1 - update) * torch.tanh(c + reset * hc) + update * g
        delta = second.weight @ F.silu(first.weight @ torch.cat([drafts.hidden[0, 1, 2], g]))
        torch.testing.assert_close(drafts.logits[0, 1, 2], drafts.base[0, 1, 2] + delta, atol=1e-5, rtol=1e-5)


def test_the_base_share_falls_linearly_and_weights_the_uncorrected_logits(target):
    torch.manual_seed(0)
    drafter = BlockTrainingDrafter(recipe("domino", markov_rank=0, gru_hidden_dim=12, correction_dim=6,
                                          base_weight=0.8, base_decay=0.5), target, DOMINO)
    lams = []
    for step in (0, 10, 25, 50, 99):
        drafter.at_step(step, 100)
        lams.append(drafter.base)
    assert lams == pytest.approx([0.8, 0.64, 0.4, 0.0, 0.0])  # 0 from half the run on (SpecForge's linear_lambda_base)
    drafter.at_step(25, 100)
    batch, teacher = batch_and_teacher(drafter, target)
    torch.manual_seed(11)
    predictions = {p.name: p for p in drafter.predictions(drafter.module, batch, teacher)}
    assert list(predictions) == ["draft1", "draft2", "draft3", "draft4", "base2", "base3", "base4"]
    assert drafter.prediction_names == ["draft1", "draft2", "draft3", "draft4"]  # held-out α̂: the drafts decoding draws
    w = [drafter.weight(j) for j in range(4)]
    assert predictions["draft1"].weight == pytest.approx(w[0])  # uncorrected: final = base, its full weight
    assert predictions["draft3"].weight == pytest.approx(0.6 * w[2])
    assert predictions["base3"].weight == pytest.approx(0.4 * w[2])
    assert not torch.equal(predictions["base3"].draft_logits, predictions["draft3"].draft_logits)
    torch.testing.assert_close(predictions["base3"].target_logits, predictions["draft3"].target_logits)


def train(target, steps: int = 6, **block):
    torch.manual_seed(0)
    cfg = recipe("domino", **{"markov_rank": 0, "gru_hidden_dim": 12, "correction_dim": 6, **block})
    drafter = BlockTrainingDrafter(cfg, target, DOMINO)
    batch, teacher = batch_and_teacher(drafter, target)
    optimizer = torch.optim.AdamW(drafter.module.parameters(), lr=3e-3)
    objective, losses, names = Objective({"soft_ce": 1.0}), [], []
    for step in range(steps):
        drafter.at_step(step, steps)
        torch.manual_seed(11)  # the same anchors each step
        predictions = drafter.predictions(drafter.module, batch, teacher)
        loss = sum(p.loss(objective)[0] for p in predictions)
        optimizer.zero_grad()
        loss.backward()
        grads = {n: p.grad for n, p in drafter.module.named_parameters()}
        optimizer.step()
        losses.append(sum(p.loss(objective)[1].item() for p in predictions if p.name.startswith("draft")))
        names = [p.name for p in predictions]
    return losses, names, grads


def test_a_tiny_domino_trains_its_gru_and_correction(target, one_thread):
    losses, names, grads = train(target, base_weight=0.0)
    assert losses[-1] < losses[0] and names == ["draft1", "draft2", "draft3", "draft4"]  # λ 0: no base predictions
    for name in ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight",
                 "layers.0.mlp.down_proj.weight", "fc.weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    _, names, grads = train(target, steps=1, base_weight=1.0)  # step 0 at λ = 1: the backbone alone learns
    assert names[4:] == ["base2", "base3", "base4"]
    assert grads["fc.weight"].abs().sum() > 0
    assert all(grads[n] is None or grads[n].abs().sum() == 0 for n in ("prefix_gru.weight_hh_l0", "embed_proj.2.weight"))


def test_greedy_domino_decoding_is_token_identical_to_the_target(one_thread):
    target = small_target(64, sharpen=8.0)
    greedy_cycles(target, BlockProposer(domino(target, seed=2, sharpen=4.0, scale=0.3), target))


def test_domino_decoding_at_temperature_1_samples_the_first_two_tokens_from_the_target(one_thread):
    """χ² (level 1e-4, fixed seed) over the 64 cells of the first two tokens of an 8-token vocabulary: the first draft
    drawn from the backbone's row, the second from its row corrected after the first draft, each verified with the
    row it was drawn from."""
    target = small_target(8, sharpen=6.0)
    proposer = BlockProposer(domino(target, sharpen=3.0, scale=2.0), target)
    rows = []
    propose = proposer.propose

    def recorded(committed, k, params, generator=None):
        proposal = propose(committed, k, params, generator)
        if len(committed) == len(prompt):  # the first cycle of a run: the same context every time
            rows.append(proposal.probs)
        return proposal
    prompt, n = [3, 5], 1500
    proposer.propose = recorded
    counts, accepted, drafted = sample_first_two_through_the_loop(target, proposer, prompt, n, tree=False)
    assert 0 < accepted < drafted
    assert len({tuple(q[0].tolist()) for q in rows}) == 1  # the first row: the backbone's, whatever is drawn
    assert len({tuple(q[1].tolist()) for q in rows if len(q) > 1}) > 1  # the second depends on the first draft
    assert_first_two_tokens_follow(target, prompt, counts, n)


def test_a_folder_without_its_gru_correction_is_one_line(tmp_path, target):
    folder = save_block_drafter(domino(target), tmp_path / "d")
    assert load_block_drafter(folder, DOMINO).prefix_gru is not None
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("prefix_gru.")}, folder / "model.safetensors")
    with pytest.raises(SpecdrafterError, match="missing prefix_gru.weight_hh_l0, prefix_gru.weight_ih_l0") as e:
        load_block_drafter(folder)
    assert "\n" not in str(e.value)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "gru_hidden_dim": 0}))
    with pytest.raises(SpecdrafterError, match="gru_hidden_dim = 0; a domino drafter needs its GRU correction") as e:
        load_block_drafter(folder)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------- export
DOMINO_RUN = ["drafter.block.gru_hidden_dim=16", "drafter.block.correction_dim=8"]


def test_the_vllm_folder_carries_what_the_engines_dflash_path_reads(tmp_path, drafter_run_of):
    run = drafter_run_of("domino", *DOMINO_RUN)
    out = export(run, "vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [0, 2, 4], "projector_type": "domino",
                                       "gru_hidden_dim": 16, "emb_dim": 8, "pure_draft_prefix_len": 1,
                                       "shift_label": True}
    assert not {"gru_hidden_dim", "emb_dim", "variant", "markov_rank"} & set(config)  # only inside dflash_config
    names = set(load_file(out / "model.safetensors"))
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight",
            "embed_proj.2.weight"} <= names and "d2t" not in names
    assert kind_of_config(config) is KINDS["domino"] and kind_of_config({**config, "dflash_config": {
        **config["dflash_config"], "projector_type": None}}) is KINDS["dflash"]
    assert load_block_drafter(out).prefix_gru is not None  # the engines' layout reads back as ours
    assert "num_speculative_tokens\": 3" in (out / "README.md").read_text()  # B − 1, as the engines draft
    # SpecForge's own checkpoints name the class DominoDraftModel; one without shift_label (its default false) is refused
    spec = tmp_path / "specforge"
    spec.mkdir()
    (spec / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    (spec / "config.json").write_text(json.dumps({**config, "architectures": ["DominoDraftModel"]}))
    assert load_block_drafter(spec, DOMINO).config.pure_draft_prefix_len == 1
    (spec / "config.json").write_text(json.dumps({**config, "architectures": ["DominoDraftModel"], "dflash_config": {
        k: v for k, v in config["dflash_config"].items() if k != "shift_label"}}))
    with pytest.raises(SpecdrafterError, match="shift_label = false") as e:
        load_block_drafter(spec)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt", ["gguf", "speculators"])
def test_formats_no_pinned_engine_serves_are_one_line(tmp_path, drafter_run_of, fmt):
    with pytest.raises(SpecdrafterError) as e:
        export(drafter_run_of("domino", *DOMINO_RUN), fmt, tmp_path / fmt)
    assert "\n" not in str(e.value) and "Domino" in str(e.value) and not (tmp_path / fmt).exists()
