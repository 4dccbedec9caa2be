"""What a drafter kind is: one `Kind` record per kind in `KINDS` (kinds/__init__.py), holding one record per concern.
The jobs — training, the planner, decoding, the eval job, the benchmarks, export, serving and the conformance run —
ask the recipe's kind the record of their concern instead of branching on its name.

    kind.name, .description, .title   what a recipe, a message and a model card call it
    kind.recognises(config)           whether a folder's config.json holds it
    kind.check_recipe(cfg)            the recipe rules that need the kind (the decoding and training records' own)
    kind.training    Training         its family's launcher and recipe, the drafter the loop trains (train/drafters.py:
                                      predictions → [Prediction]), the target layers it reads; None: not trainable
    kind.decoding    Decoding         the proposer around its folder (inference/), the trees and acceptance it
                                      decodes with, the model it verifies with, its benchmark arms
    kind.planning    Planning         what it costs to train: its module on the meta device, activation bytes
                                      (train/memory.py terms), the checks that need only the target's config
    kind.export      Export           its family's writer and formats (export/formats.py), its model card's tag,
                                      llama.cpp's needs (`export.llamacpp`, a LlamaCpp); NoExport says why none
    kind.conformance Conformance      the variants the conformance run exports and the step the engines must reproduce

A record is a frozen dataclass: data as fields, behaviour as methods that a family's subclass overrides (as LlamaCpp).
A kind is declared once, in its family's module (kinds/eagle.py, medusa.py, draft.py, block.py), and listed once,
in `KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

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
    """Where a kind exports: its family's writer writes the formats in `writes`, llama.cpp's converter `gguf` from one
    of them, and the model card carries the Hub tag."""
    family: Family
    writes: Tuple[str, ...]  # export/formats.py --format names its family's writer writes for it, as the kind lists them
    card_tag: str  # the Hub tag of its model card
    llamacpp: Optional[LlamaCpp] = None  # None: llama.cpp serves no drafter of this kind

    @property
    def formats(self) -> Tuple[str, ...]:
        """Every --format that writes this kind: its writer's, and gguf where llama.cpp serves it."""
        return self.writes + (("gguf",) if self.llamacpp else ())


@dataclass(frozen=True)
class NoExport:
    """A kind no engine format writes; `why` says so."""
    why: str
    family = None
    writes = formats = ()
    llamacpp = None




@dataclass(frozen=True)
class Training:
    """How a kind trains: the family whose launch/train_<trainer>.py trains it, the SmolLM2 recipe that does
    (benchmarks and conformance start there), the drafter the loop trains and the target layers it reads."""
    trainer: str
    recipe: Optional[str] = None  # recipes/<recipe>; None: none ships

    @property
    def launcher(self) -> str:
        """The launch/ script that trains it, which names its family: `train_command(trainer)`."""
        return f"train_{self.trainer}.py"

    def drafter(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        """The training drafter (train/drafters.py): module, predictions(), save()."""
        raise NotImplementedError

    def feature_layers(self, cfg: DictConfig, num_layers: int) -> List[int]:
        """Target layers the drafter reads (ids as in models/features.py). The last layer's output is always among
        them: from it offline training rebuilds the target's logits."""
        return [num_layers]

    def check_recipe(self, cfg: DictConfig) -> None:
        """Training's rules that need the kind (RecipeError, one line)."""


@dataclass(frozen=True)
class Decoding:
    """How a kind decodes: the proposer around its folder, the trees it drafts, whether Medusa's typical acceptance
    applies, the model it verifies with, and its benchmark arms."""
    trees: Tuple[str, ...] = ("static", "dynamic")  # the trees it drafts (inference.tree, inference.dynamic_tree)
    typical: bool = False  # Medusa's typical acceptance applies (heads over a static tree)
    needs_folder: bool = True  # decoding needs drafter.path (a self-draft is built from the target)

    def proposer(self, cfg: DictConfig, target: nn.Module, path: Optional[str]):
        """The proposer the recipe asks for (a chain, inference.tree, or inference.dynamic_tree) around the drafter
        at `path` (checked by kinds.drafter_path), beside the target on its device and in its dtype."""
        raise NotImplementedError

    def assistant_model(self, cfg: DictConfig, target: nn.Module, path: Optional[str]) -> nn.Module:
        """The drafter as a causal LM of its own (HF generate's `assistant_model`: the benchmarks' hf_assisted arm),
        for the kinds that are one."""
        raise SpecdrafterError("this drafter is not a causal LM of its own: HF assisted generation cannot use it")

    def serving_target(self, folder: Optional[Path], target: nn.Module) -> nn.Module:
        """The model decoding verifies with: the target, unless the drafter folder brings its own (Medusa-2)."""
        return target

    def bench_arms(self, cfg: DictConfig, name: str) -> List[ArmSpec]:
        """The benchmark arms of kind `name` (benchmarks/bench_decode.py builds and times them)."""
        return [ArmSpec(f"{name}_chain", f"k={cfg.inference.k}", EvalVerifier.chain, k=cfg.inference.k)]

    def check_recipe(self, cfg: DictConfig, description: str) -> None:
        """Decoding's rules beyond the trees and acceptance every kind checks (RecipeError, one line)."""


@dataclass(frozen=True)
class Planning:
    """What a kind costs to train (jobs/plan.py, train/memory.py): the trainable module, its activation bytes and
    the checks that need only the target's config."""
    memory_fixes: Dict[str, str] = field(default_factory=dict)  # extra keys that shrink a memory term of this kind
    bench_overrides: Tuple[str, ...] = ()  # benchmarks/bench_plan.py: its recipe shrunk to train in seconds on a CPU

    def module(self, cfg: DictConfig, target: nn.Module, config_of: Callable[[str], object],
               training: Training) -> Tuple[nn.Module, Optional[Shapes]]:
        """(the trainable module built on the meta device, its own shapes when it is a causal LM, else None).
        `config_of(name)` reads a model's config without weights (jobs/plan.py:target_config)."""
        return training.drafter(cfg, target).module, None

    def activations(self, act: Activations, m: MemoryInputs) -> None:
        """Add this kind's activation bytes of one micro-batch to `act` (train/memory.py holds the shared terms)."""
        raise NotImplementedError

    def checks(self, cfg: DictConfig, T: Shapes, config_of: Callable[[str], object]) -> List[Tuple[bool, str]]:
        """(ok, line) checks that need only the target's config."""
        return []

    def activation_label(self, cfg: DictConfig) -> str:
        """What the planner's activation line adds after the batch shape."""
        return ""


@dataclass(frozen=True)
class Conformance:
    """What the conformance run (benchmarks/conformance.py) exports and loads in the engines' own code."""
    variants: Dict[str, List[str]]  # variant name → recipe overrides of training.recipe: the drafters it trains nothing into

    def reference_step(self, module: nn.Module, target: nn.Module, hidden_states, ids) -> dict:
        """Inputs of one draft step and our logits for them, which the engines' own code must reproduce."""
        raise NotImplementedError

    def perturb(self, module: nn.Module, name: str, vocab_size: int) -> None:
        """Beyond moving every weight off its initial value, anything else a variant must exercise."""


@dataclass(frozen=True, eq=False)  # one record per kind: compared and hashed by identity
class Kind:
    """A drafter kind: what it is called, how its folder is recognised, and one record per concern."""
    name: str  # the recipe's drafter.kind
    description: str  # "an EAGLE-3 head": how messages name what a folder holds
    title: str  # "EAGLE-3 draft head": model cards' and reports' heading
    recognises: Callable[[dict], bool]  # whether a folder's config.json holds this kind
    decoding: Decoding
    export: Union[Export, NoExport]
    training: Optional[Training] = None  # None: not trainable
    planning: Optional[Planning] = None  # None with training
    conformance: Optional[Conformance] = None  # None: the conformance run exports none

    def check_recipe(self, cfg: DictConfig) -> None:
        """Cross-field rules the recipe schema cannot express without knowing the kind (RecipeError, one line): the
        trees and acceptance it decodes with, then its decoding's and its training's own."""
        inf, verifiers, d = cfg.inference, {v.value for v in cfg.eval.verifiers}, self.decoding
        if inf.verifier.value == "typical" or "typical" in verifiers:
            key = "inference.verifier" if inf.verifier.value == "typical" else "eval.verifiers"
            missing = (f"Medusa heads (drafter.kind=medusa; it is {self.name})" if not d.typical else
                       None if inf.tree else "a static inference.tree")
            if missing:
                raise RecipeError(f"recipe key {key!r}: typical acceptance needs {missing}")
        if inf.tree and "static" not in d.trees:
            raise RecipeError(f"recipe key 'inference.tree': {self.description} drafts dynamic trees; use "
                              "inference.dynamic_tree.total_tokens")
        if inf.dynamic_tree.total_tokens and "dynamic" not in d.trees:
            raise RecipeError(f"recipe key 'inference.dynamic_tree': {self.description} drafts static trees; use "
                              "inference.tree")
        d.check_recipe(cfg, self.description)
        if self.training:
            self.training.check_recipe(cfg)


def never(config: dict) -> bool:
    """`recognises` of a kind no folder holds (a self-draft is built from the target)."""
    return False
