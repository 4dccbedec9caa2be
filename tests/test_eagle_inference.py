"""EAGLE-3 decoding on a tiny random Llama: the head's incremental cache equals a from-scratch recompute (chain
drafts, EAGLE-2 trees, and inside the decoding loop), greedy decoding is token-identical to target.generate,
sampling at T = 1 follows the target's own distribution (χ²), checkpoints round-trip bit-exactly under the engines'
weight names, and mismatched heads are refused."""


import pytest
import torch
from conftest import assert_first_two_tokens_follow, sample_first_two_through_the_loop, tiny_llama_config
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.autotune import TreeSizeTuner
from specdrafter.inference.decode import speculative_generate, tree_speculative_generate
from specdrafter.inference.eagle import EagleProposer, EagleTreeProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.models.eagle import Eagle3Head, eagle3_config, load_eagle3, save_eagle3
from specdrafter.models.features import capture_features

V, VD, AUX = 96, 40, [1, 2, 4]  # aux id 4 = the 4-layer target's last output before the final norm
PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8], [50, 60]]
EOS = [2]
NEW = 12  # tokens decoded per prompt
GREEDY = SamplingParams(0.0)
SHARPEN = 20.0  # random lm_head weights give near-uniform drafts; a trained head is confident


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=4)).eval()


@pytest.fixture(scope="module")
def references(target):
    """target.generate's greedy continuation of each prompt."""
    return [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=EOS,
                            pad_token_id=2)[0, len(p):].tolist() for p in PROMPTS]


def make_head(target, references, mimic: bool) -> Eagle3Head:
    """A random head over a draft vocabulary of VD target ids (the target's greedy outputs plus random ids, so
    d2t is non-trivial), with a sharpened lm_head so that EAGLE-2 scores fall unevenly and deep nodes can
    outrank shallow ones. `mimic` makes it read the target's last feature through a near-identity layer and the
    target's own norm and lm_head: it then often drafts what the random target repeats, so drafts are partly
    accepted and the rollback after an accepted prefix is exercised."""
    torch.manual_seed(1)
    head = Eagle3Head(eagle3_config(target.config, AUX, VD)).eval()
    emitted = {t for ref in references for t in ref}
    others = [t for t in torch.randperm(V, generator=torch.Generator().manual_seed(2)).tolist() if t not in emitted]
    ids = torch.tensor(sorted(emitted | set(others[:VD - len(emitted)])))  # [VD] target id of each draft entry
    d = target.config.hidden_size
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(VD))
        head.t2d[ids] = True
        head.lm_head.weight.mul_(SHARPEN)
        if mimic:
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * d:] = torch.eye(d)  # fused feature = the target's last hidden state
            head.midlayer.self_attn.o_proj.weight.mul_(0.1)  # small but non-zero: attention still matters
            head.midlayer.mlp.down_proj.weight.mul_(0.1)
            head.norm.weight.copy_(target.model.norm.weight)
            head.lm_head.weight.copy_(target.lm_head.weight[ids])
    return head


@pytest.fixture(scope="module")
def random_head(target, references):
    return make_head(target, references, mimic=False)


@pytest.fixture(scope="module")
def mimic_head(target, references):
    return make_head(target, references, mimic=True)


# ------------------------------------------------------------------------------------------ from-scratch references
@torch.no_grad()
def target_features(target, head, committed):
    """Aux-layer features {k: [n-1, d_t]} of committed[:-1] from one plain target pass."""
    with capture_features(target, head.aux_layer_ids) as features:
        target(input_ids=torch.tensor([committed[:-1]]))
    return {k: h[0] for k, h in features.items()}


@torch.no_grad()
def reference_logprobs(head, target, committed, path):
    """Draft log-probs [Vd] after the committed pairs and each prefix of `path` (target ids), every one recomputed
    from scratch: one causal pass, no cache, over the pairs (f_t, x_{t+1}) followed by the drafted pairs (output
    hidden state of the previous position, drafted token)."""
    embed = target.get_input_embeddings()
    hidden = head.fuse(target_features(target, head, committed))  # [n-1, d]
    embeds = embed(torch.tensor(committed[1:]))  # [n-1, d]
    rows = []
    for step in range(len(path) + 1):
        n = hidden.shape[0]
        out, _ = head(hidden[None], embeds[None], torch.arange(n)[None],
                      torch.ones(n, n, dtype=torch.bool).tril()[None, None])  # [1, n, d]
        rows.append(head.logits(out[0, -1]).log_softmax(-1))
        if step < len(path):
            hidden = torch.cat([hidden, out[0, -1:]])
            embeds = torch.cat([embeds, embed(torch.tensor([path[step]]))])
    return rows


def reference_tree(head, target, committed, depth, top_k, total_tokens):
    """EAGLE-2 selection over scores recomputed from scratch path by path: (parents, node tokens, the draft
    log-prob rows [Vd] of the expanded nodes, depth by depth, in frontier order)."""
    draft_ids = head.draft_ids.tolist()
    nodes, frontier, rows = [], [-1], []  # nodes: (score, depth, parent, path of target ids)
    for level in range(1, depth + 1):
        children = []
        for parent in frontier:
            score, path = (nodes[parent][0], nodes[parent][3]) if parent >= 0 else (0.0, [])
            rows.append(reference_logprobs(head, target, committed, path)[-1])
            top = rows[-1].topk(top_k)
            for lp, index in zip(top.values.tolist(), top.indices.tolist()):
                nodes.append((score + lp, level, parent, path + [draft_ids[index]]))
                children.append(len(nodes) - 1)
        frontier = sorted(children, key=lambda c: -nodes[c][0])[:top_k]
    keep = sorted(sorted(range(len(nodes)), key=lambda c: (-nodes[c][0], nodes[c][1]))[:total_tokens],
                  key=lambda c: (nodes[c][1], c))
    index = {-1: 0, **{c: i + 1 for i, c in enumerate(keep)}}
    return [-1] + [index[nodes[c][2]] for c in keep], [committed[-1]] + [nodes[c][3][-1] for c in keep], rows


# ------------------------------------------------------------------------------------------ chain drafts
def test_chain_drafts_match_a_from_scratch_recompute_when_fed_over_several_cycles(target, random_head):
    committed = PROMPTS[1] + [11, 23, 35, 47, 59]  # 13 tokens: 12 target-feature pairs
    features = target_features(target, random_head, committed)
    one_shot, cycled = EagleProposer(random_head, target), EagleProposer(random_head, target)
    one_shot.observe(features)
    for start, end in [(0, 4), (4, 5), (5, 9)]:  # earlier cycles: observe, draft, roll back the drafts
        cycled.observe({k: h[start:end] for k, h in features.items()})
        cycled.propose(committed[:end + 1], 4, GREEDY)
        assert cycled.cache.get_seq_length() == cycled.cached + 3  # k − 1 drafted pairs were fed
        cycled.rollback(end + 1)
        assert cycled.cache.get_seq_length() == cycled.cached == end  # no drafted entry remains
    cycled.observe({k: h[9:] for k, h in features.items()})

    params = SamplingParams(1.0)
    proposals = [p.propose(committed, 4, params, torch.Generator().manual_seed(0)) for p in (one_shot, cycled)]
    reference = reference_logprobs(random_head, target, committed, proposals[0].tokens[:-1].tolist())
    draft_ids = random_head.draft_ids
    for proposal in proposals:
        assert proposal.tokens.tolist() == proposals[0].tokens.tolist()
        assert proposal.probs.sum(-1).sub(1).abs().max() < 1e-9 and proposal.probs[:, ~random_head.t2d].max() == 0
        torch.testing.assert_close(proposal.probs[:, draft_ids].float(), torch.stack(reference).exp(),
                                   atol=1e-5, rtol=1e-5)
    greedy = EagleProposer(random_head, target)
    greedy.observe(features)
    path = []  # the argmax chain, recomputed from scratch step by step
    for _ in range(4):
        path.append(int(draft_ids[reference_logprobs(random_head, target, committed, path)[-1].argmax()]))
    assert greedy.propose(committed, 4, GREEDY).tokens.tolist() == path


# ------------------------------------------------------------------------------------------ EAGLE-2 trees
def test_dynamic_tree_matches_a_from_scratch_recompute(target, random_head):
    committed = PROMPTS[1]
    proposer = EagleTreeProposer(random_head, target, depth=4, top_k=3, total_tokens=12)
    proposer.observe(target_features(target, random_head, committed))
    logits = []  # every draft-logit row the tree search computed, in order
    hook = random_head.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.reshape(-1, VD)))
    try:
        shape, tokens = proposer.propose_tree(committed)
    finally:
        hook.remove()
    assert proposer.cache.get_seq_length() == proposer.cached == len(committed) - 1  # the tree was cropped
    parents, ref_tokens, ref_rows = reference_tree(random_head, target, committed, 4, 3, 12)
    torch.testing.assert_close(torch.cat(logits).log_softmax(-1), torch.stack(ref_rows), atol=1e-5, rtol=1e-5)
    assert list(shape.parents) == parents and tokens.tolist() == ref_tokens
    # the case is not degenerate: depth-4 nodes outrank depth-2 candidates, and a frontier mixed parents
    assert max(shape.depths) == 4 and shape.depths.count(2) < 3 ** 2
    inner = [j for j in range(1, shape.size) if j in shape.parents]  # nodes fed to the head with children kept
    assert any(len({shape.parents[j] for j in inner if shape.depths[j] == d}) > 1 for d in (2, 3))


@pytest.mark.parametrize("depth, top_k, total_tokens", [(4, 3, 10), (5, 4, 60), (3, 8, 5), (2, 1, 1)])
def test_dynamic_tree_shape_and_its_greedy_path(target, random_head, depth, top_k, total_tokens):
    committed = PROMPTS[1]
    features = target_features(target, random_head, committed)
    proposer = EagleTreeProposer(random_head, target, depth, top_k, total_tokens)
    proposer.observe(features)
    shape, tokens = proposer.propose_tree(committed)
    candidates = top_k + (depth - 1) * top_k ** 2
    assert shape.size == tokens.shape[0] == 1 + min(total_tokens, candidates) <= proposer.max_tree_size
    assert max(shape.depths) <= depth and shape.depths == sorted(shape.depths)  # breadth-first
    assert all(0 <= p < j for j, p in enumerate(shape.parents) if j)  # closed under ancestors, parents first
    assert tokens[0] == committed[-1] and random_head.t2d[tokens[1:]].all()
    for p in set(shape.parents[1:]):  # siblings are distinct tokens
        siblings = [int(tokens[j]) for j in range(1, shape.size) if shape.parents[j] == p]
        assert len(siblings) == len(set(siblings))
    assert proposer.cache.get_seq_length() == proposer.cached == len(committed) - 1
    # the rank-0 path (each node's most likely kept child) is the chain proposer's greedy draft
    rank0 = [j for j in range(1, shape.size) if all(r == 0 for r in shape.choices[j])]
    chain = EagleProposer(random_head, target)
    chain.observe(features)
    drafts = chain.propose(committed, depth, GREEDY).tokens.tolist()
    assert 1 <= len(rank0) and tokens[rank0].tolist() == drafts[:len(rank0)]
    if top_k == 1:
        assert tokens[1:].tolist() == drafts[:total_tokens]  # a width-1 tree is the chain


# ------------------------------------------------------------------------------------------ the decoding loop
class CacheChecks:
    """Records the head's last committed output at every cycle (checked afterwards against a from-scratch
    recompute) and asserts that the cache holds exactly the committed pairs after each rollback."""

    def reset(self):
        super().reset()
        self.seen = []

    def feed_pending(self, committed):
        hidden = super().feed_pending(committed)
        assert self.cached == len(committed) - 1  # every committed pair has been fed
        self.seen.append((list(committed), hidden[0, -1]))
        return hidden

    def rollback(self, num_committed):
        super().rollback(num_committed)
        assert self.cache.get_seq_length() == self.cached


class CheckedChain(CacheChecks, EagleProposer):
    pass


class CheckedTree(CacheChecks, EagleTreeProposer):
    def propose_tree(self, committed, sizer=None):
        out = super().propose_tree(committed, sizer)
        assert self.cache.get_seq_length() == self.cached == len(committed) - 1
        return out


def assert_outputs_match_recompute(proposer, target):
    for committed, hidden in proposer.seen:
        ref = reference_logprobs(proposer.head, target, committed, [])[0]
        torch.testing.assert_close(proposer.head.logits(hidden).log_softmax(-1), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head, k", [("mimic_head", 1), ("mimic_head", 3), ("mimic_head", 5), ("random_head", 4)])
def test_greedy_chain_is_token_identical_to_target_generate(request, target, references, head, k):
    proposer = CheckedChain(request.getfixturevalue(head), target)
    accepted = []
    for prompt, reference in zip(PROMPTS, references):
        result = speculative_generate(target, proposer, prompt, NEW, GREEDY, k, EOS)
        assert result.tokens == reference
        assert_outputs_match_recompute(proposer, target)
        accepted += [c.accepted for c in result.cycles]
    if head == "mimic_head":  # whole blocks and (k > 1) accepted prefixes were re-fed as target features
        assert max(accepted) == k and (k == 1 or any(0 < a < k for a in accepted))


@pytest.mark.parametrize("head, sized", [("mimic_head", False), ("random_head", False), ("mimic_head", True)])
def test_greedy_tree_is_token_identical_to_target_generate(request, target, references, head, sized):
    """Also with the tree size chosen every cycle (TreeSizeTuner): whatever part of the tree is verified."""
    proposer = CheckedTree(request.getfixturevalue(head), target, depth=4, top_k=4, total_tokens=12)
    sizer = TreeSizeTuner(12) if sized else None
    accepted = []
    for prompt, reference in zip(PROMPTS, references):
        result = tree_speculative_generate(target, proposer, prompt, NEW, GREEDY, EOS, sizer=sizer)
        assert result.tokens == reference
        assert_outputs_match_recompute(proposer, target)
        accepted += [c.accepted for c in result.cycles]
    if head == "mimic_head":
        assert max(accepted) >= 2  # accepted paths of several nodes were re-fed as target features


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_decoding_at_temperature_1_samples_the_first_two_tokens_from_the_target(tree, one_thread):
    """χ² (level 1e-4, fixed seed) of the first two tokens emitted by the real loop at T = 1, chain (exact speculative
    sampling with the head's q) and EAGLE-2 tree (deterministic top-k rule), against the target's own two-token
    distribution. A small vocabulary (8 tokens, 6 of them in the draft vocabulary) keeps the 64 cells well filled; the
    target's lm_head is sharpened so that p is far from uniform, and drafts are partly accepted."""
    torch.manual_seed(0)
    small = LlamaForCausalLM(tiny_llama_config(8, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                               tie_word_embeddings=False)).eval()
    torch.manual_seed(1)
    head = Eagle3Head(eagle3_config(small.config, [0, 1, 2], 6)).eval()
    ids = torch.tensor([0, 1, 3, 4, 6, 7])  # tokens 2 and 5 are never drafted
    with torch.no_grad():
        small.lm_head.weight.mul_(15.0)
        head.d2t.copy_(ids - torch.arange(6))
        head.t2d[ids] = True
        head.lm_head.weight.mul_(SHARPEN)
    proposer = EagleTreeProposer(head, small, depth=2, top_k=2, total_tokens=4) if tree else EagleProposer(head, small)
    prompt, n = [3, 5], 1500
    counts, accepted, drafted = sample_first_two_through_the_loop(small, proposer, prompt, n, tree)
    assert 0 < accepted < drafted  # both the accepting and the rejecting branches of the verifier were taken
    assert_first_two_tokens_follow(small, prompt, counts, n)


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_round_trip_is_bit_identical_with_the_engines_names(tmp_path, target, random_head):
    d = target.config.hidden_size
    folder = save_eagle3(random_head, tmp_path / "eagle3")
    stored = load_file(str(folder / "model.safetensors"))
    expected = {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {
        "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert set(stored) == set(random_head.state_dict()) == expected  # no rotary inv_freq buffer
    assert stored["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * d
    assert stored["fc.weight"].shape == (d, 3 * d) and stored["lm_head.weight"].shape == (VD, d)
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool and stored["t2d"].shape == (V,)
    loaded = load_eagle3(folder)
    for name, tensor in random_head.state_dict().items():
        assert loaded.state_dict()[name].dtype == tensor.dtype and torch.equal(loaded.state_dict()[name], tensor)
    assert loaded.aux_layer_ids == AUX and loaded.config.architectures == ["LlamaForCausalLMEagle3"]
    assert loaded.config.draft_vocab_size == VD and loaded.config.max_position_embeddings == 512
    with pytest.raises(SpecdrafterError, match="could not load the EAGLE-3 head"):
        load_eagle3(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ bad input
def test_mismatched_heads_and_settings_are_refused_in_one_line(target, random_head):
    def refused(match, build):
        with pytest.raises(SpecdrafterError, match=match) as error:
            build()
        assert "\n" not in str(error.value)

    other_vocab = LlamaForCausalLM(tiny_llama_config(V + 8, num_hidden_layers=4))
    wider = LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=4, hidden_size=48))
    refused(r"vocabulary \(104 tokens\) differs from the target's \(96 tokens\)",
            lambda: EagleProposer(Eagle3Head(eagle3_config(other_vocab.config, AUX, VD)), target))
    refused("trained for hidden size 48, the target has 32",
            lambda: EagleTreeProposer(Eagle3Head(eagle3_config(wider.config, AUX, VD)), target))
    refused("reads target layer 5, but the target has 4 layers",
            lambda: EagleProposer(Eagle3Head(eagle3_config(target.config, [1, 2, 5], VD)), target))
    refused("depth, top_k, total_tokens >= 1, got 0, 8, 60", lambda: EagleTreeProposer(random_head, target, depth=0))
    refused(r"top_k \(41\) exceeds the EAGLE head's draft vocabulary \(40 tokens\)",
            lambda: EagleTreeProposer(random_head, target, top_k=41))
    refused("a prompt of >= 2 tokens",
            lambda: tree_speculative_generate(target, EagleTreeProposer(random_head, target), [50], 4))
