"""The protocol every drafter kind implements: one class per kind, one instance per kind in `KINDS`
(kinds/__init__.py). The jobs — training, the planner, decoding, the eval job, the benchmarks, export and the
conformance run — ask the recipe's kind what to do instead of branching on its name.

A kind answers six questions:
    what it builds            drafter(cfg, target, data, tokenizer) → the training drafter (train/drafters.py)
    what it predicts          that drafter's predictions(module, batch, target) → [Prediction] (train/drafters.py)
    what decodes with it      proposer(cfg, target, path) → a Proposer / TreeProposer (inference/)
    where it exports          export: its family (export/formats.py has one writer each) and the formats, or None
    what it costs to train    planner_module / planner_activations / planner_checks (train/memory.py terms)
    how it is benchmarked     bench_arms(cfg) → [ArmSpec] (benchmarks/bench_decode.py builds and times them)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, NamedTuple, Optional, Tuple

from omegaconf import DictConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import EvalVerifier, RecipeError

if TYPE_CHECKING:  # annotations only: importing the protocol loads no torch, transformers or peft
    from torch import nn

    from specdrafter.train.memory import Activations, MemoryInputs, Shapes


class ArmSpec(NamedTuple):
    """One benchmark arm of a kind: benchmarks/bench_decode.py builds the recipe variant and the decoder."""
    name: str  # e.g. "eagle3_chain"
    label: str  # what the report prints beside it (k, tree size)
    verifier: EvalVerifier  # how our loops decode it, as the eval job's cells do
    inference: Dict[str, object] = {}  # inference.* keys set on the recipe for this arm (tree, dynamic_tree)
    drafter: Dict[str, object] = {}  # drafter.<kind section>.* keys, as {"block": {"length": "confidence"}}
    k: object = None  # the chain's block length (a number or "auto"), None for trees
    tree_size: Optional[int] = None  # nodes verified per cycle (trees)
    hf_assisted: bool = False  # HF generate's assisted generation with the kind's assistant_model instead of our loops


class Family(Enum):
    """A model family of exports: export/formats.py:WRITERS holds one writer per family."""
    eagle = "eagle"
    medusa = "medusa"
    hf = "hf"  # a plain Hugging Face causal LM
    block = "block"


@dataclass(frozen=True)
class LlamaCpp:
    """How llama.cpp serves a kind, asked by `--format gguf` (export/gguf.py) and by serving (serve/): the
    --spec-type, the export its converter reads, the checks before converting, the target layers the GGUF must read
    back, how a GGUF of this kind is recognised, the longest block one step drafts and whether llama.cpp's
    confidence cut (--spec-draft-p-min) applies. This default is a drafter that reads the target's layer inputs."""
    spec_type: str  # llama-server --spec-type
    converts: str  # the --format whose folder convert_hf_to_gguf.py reads
    gguf_arch: Optional[str] = None  # the GGUF's general.architecture (None: any, a draft model)
    pruned_vocab: bool = True  # its converter keeps a pruned draft vocabulary (d2t)
    reads_layer_inputs: bool = True  # it reads the target's hidden states, so the target's graph must expose them
    max_k: int = 8  # the longest chain it is planned with (a block drafter: its block, from the GGUF)

    def serves(self, facts: dict) -> bool:
        """Whether a GGUF (export/gguf.py:read_gguf's facts) holds a drafter of this kind."""
        return facts["arch"] == self.gguf_arch

    def check_target(self, arch: str, description: str) -> None:
        """One line for a target (its HF architecture) llama.cpp cannot serve this drafter beside."""
        if self.reads_layer_inputs and arch in NO_LAYER_INPUTS:
            raise SpecdrafterError(f"--format gguf: llama.cpp cannot serve {description} beside a "
                                   f"{NO_LAYER_INPUTS[arch]} target ({arch}): its graph for that target does not expose "
                                   "the layer inputs the drafter reads (llama-server aborts); a draft model serves there")

    def check_config(self, config: dict) -> None:
        """One line for a converted folder (its config.json) that llama.cpp would not serve as trained."""

    def trained_layers(self, config: dict) -> Optional[List[int]]:
        """The target layers (as layer inputs) the converted folder's drafter reads; None: it reads none."""
        return None

    def longest_block(self, facts: dict) -> int:
        """The most draft tokens one step can take for the GGUF with these facts."""
        return self.max_k

    def confidence_cut(self, facts: dict) -> bool:
        """Whether llama-server takes --spec-draft-p-min > 0 for this GGUF."""
        return True


# What llama.cpp (11434) cannot serve a drafter that reads layer inputs beside, by the target's HF architecture, found
# by serving tiny random models of each (tests/test_llamacpp_targets.py): its graphs for these targets never expose
# the layer inputs an EAGLE-3, DFlash or DSpark drafter reads, and llama-server aborts at its first request ("layer
# input tensor is null").
NO_LAYER_INPUTS = {"Gemma3ForCausalLM": "Gemma 3", "Gemma3ForConditionalGeneration": "Gemma 3",
                   "DeepseekV3ForCausalLM": "DeepSeek-V3", "Qwen2ForCausalLM": "Qwen2"}


@dataclass(frozen=True)
class Export:
    """Where a kind exports: its family's writer writes the `formats`, and the model card carries the Hub tag."""
    family: Family
    formats: Tuple[str, ...]  # export/formats.py --format names, as the kind lists them (gguf: from `llamacpp`)
    card_tag: str  # the Hub tag of its model card
    llamacpp: Optional[LlamaCpp] = None  # None: llama.cpp serves no drafter of this kind


class Kind:
    """Defaults shared by the kinds; each kind overrides what differs."""
    name: str  # the recipe's drafter.kind
    description: str  # "an EAGLE-3 head": how messages name what a folder holds
    title: str = "Drafter"  # "EAGLE-3 draft head": model cards' and reports' heading
    trainer: Optional[str] = None  # the training family it belongs to (launch/train_<trainer>.py); None: not trainable
    recipe: Optional[str] = None  # the SmolLM2 recipe (recipes/) that trains it: benchmarks and conformance start there
    needs_folder: bool = True  # decoding needs drafter.path (a self-draft is built from the target)
    export: Optional[Export] = None  # None: no export (`no_export` says why)
    no_export: str = "that kind has no export"
    typical: bool = False  # Medusa's typical acceptance applies (heads over a static tree)
    trees: Tuple[str, ...] = ("static", "dynamic")  # the trees it drafts (inference.tree, inference.dynamic_tree)
    memory_fixes: Dict[str, str] = {}  # planner: extra keys that shrink a memory term of this kind
    plan_bench_overrides: Tuple[str, ...] = ()  # benchmarks/bench_plan.py: its recipe shrunk to train in seconds on a CPU

    @property
    def trainable(self) -> bool:
        return self.trainer is not None

    @property
    def launcher(self) -> Optional[str]:
        """The launch/ script that trains it, which names its family: `train_command(trainer)`."""
        return f"train_{self.trainer}.py" if self.trainer else None

    @property
    def formats(self) -> Tuple[str, ...]:
        """The export formats that write this kind (none without an export)."""
        if self.export is None:
            return ()
        return self.export.formats + (("gguf",) if self.export.llamacpp else ())

    # --------------------------------------------------------------------------- recipes and folders
    def recognises(self, config: dict) -> bool:
        """Whether a folder's config.json holds this kind."""
        return False

    def check_recipe(self, cfg: DictConfig) -> None:
        """Cross-field rules the recipe schema cannot express without knowing the kind (RecipeError, one line)."""
        inf, verifiers = cfg.inference, {v.value for v in cfg.eval.verifiers}
        if inf.verifier.value == "typical" or "typical" in verifiers:
            key = "inference.verifier" if inf.verifier.value == "typical" else "eval.verifiers"
            missing = (f"Medusa heads (drafter.kind=medusa; it is {self.name})" if not self.typical else
                       None if inf.tree else "a static inference.tree")
            if missing:
                raise RecipeError(f"recipe key {key!r}: typical acceptance needs {missing}")
        if inf.tree and "static" not in self.trees:
            raise RecipeError(f"recipe key 'inference.tree': {self.description} drafts dynamic trees; use "
                              "inference.dynamic_tree.total_tokens")
        if inf.dynamic_tree.total_tokens and "dynamic" not in self.trees:
            raise RecipeError(f"recipe key 'inference.dynamic_tree': {self.description} drafts static trees; use "
                              "inference.tree")

    # ----------------------------------------------------------------------------------------- training
    def drafter(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        """The training drafter (train/drafters.py): module, predictions(), save()."""
        raise SpecdrafterError(f"recipe key 'drafter.kind': {self.name} is not trainable")

    def feature_layers(self, cfg: DictConfig, num_layers: int) -> List[int]:
        """Target layers the drafter reads (ids as in models/features.py). The last layer's output is always among
        them: from it offline training rebuilds the target's logits."""
        return [num_layers]

    # ----------------------------------------------------------------------------------------- decoding
    def proposer(self, cfg: DictConfig, target: nn.Module, path: Optional[str]):
        """The proposer the recipe asks for (a chain, inference.tree, or inference.dynamic_tree) around the drafter
        at `path` (checked by kinds.drafter_path), beside the target on its device and in its dtype."""
        raise NotImplementedError

    def assistant_model(self, cfg: DictConfig, target: nn.Module, path: Optional[str]) -> nn.Module:
        """The drafter as a causal LM of its own (HF generate's `assistant_model`: the benchmarks' hf_assisted arm),
        for the kinds that are one."""
        raise SpecdrafterError(f"{self.description} is not a causal LM of its own: HF assisted generation cannot use it")

    def serving_target(self, folder: Optional[Path], target: nn.Module) -> nn.Module:
        """The model decoding verifies with: the target, unless the drafter folder brings its own (Medusa-2)."""
        return target

    def bench_arms(self, cfg: DictConfig) -> List[ArmSpec]:
        return [ArmSpec(f"{self.name}_chain", f"k={cfg.inference.k}", EvalVerifier.chain, k=cfg.inference.k)]

    # ------------------------------------------------------------------------------------------ planner
    def planner_module(self, cfg: DictConfig, target: nn.Module,
                       config_of: Callable[[str], object]) -> Tuple[nn.Module, Optional[Shapes]]:
        """(the trainable module built on the meta device, its own shapes when it is a causal LM, else None).
        `config_of(name)` reads a model's config without weights (jobs/plan.py:target_config)."""
        return self.drafter(cfg, target).module, None

    def planner_activations(self, act: Activations, m: MemoryInputs) -> None:
        """Add this kind's activation bytes of one micro-batch to `act` (train/memory.py holds the terms)."""
        raise NotImplementedError

    def planner_checks(self, cfg: DictConfig, T: Shapes, config_of: Callable[[str], object]) -> List[Tuple[bool, str]]:
        """(ok, line) checks that need only the target's config."""
        return []

    def activation_label(self, cfg: DictConfig) -> str:
        """What the planner's activation line adds after the batch shape."""
        return ""

    # -------------------------------------------------------------------------------------- conformance
    def conformance_variants(self) -> Dict[str, List[str]]:
        """Variant name → recipe overrides: the drafters the conformance run trains nothing into, exports and loads."""
        return {}

    def reference_step(self, module: nn.Module, target: nn.Module, hidden_states, ids) -> dict:
        """Inputs of one draft step and our logits for them, which the engines' own code must reproduce."""
        raise NotImplementedError

    def perturb(self, module: nn.Module, name: str, vocab_size: int) -> None:
        """Conformance: beyond moving every weight off its initial value, anything else a variant must exercise."""
