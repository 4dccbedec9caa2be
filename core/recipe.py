"""Recipes: OmegaConf YAML validated against one typed schema, with `key=value` overrides.

A recipe file names only the sections its job needs; every other key keeps the schema default. Anything
wrong with a recipe (unknown key, wrong type, missing value, nonexistent path) is reported in one line that
names the key before any model or dataset loads.

This file holds the schema (every key, its type, its default and its own rules) and the recipe files (`read_yaml`,
`load_saved_recipe`, `save_recipe`); core/recipe_checks.py types a recipe against it (`typed_recipe`).

Where each check lives: a constraint on one key's value is a `Rule` beside the key in the schema
(`checked(default, *rules)`), all checked in one pass (recipe_checks.py: `_check_rules`); a rule across keys is in
its section's function there (`_check_data`, `_check_train`, `_check_inference`, `_check_eval`); a rule that
depends on the drafter kind is the kind's (kinds/: `Kind.check_recipe`, run by jobs/recipe.py); one that needs the
target's config.json runs before any weights load, in the jobs that train (jobs/plan.py: `check_against_target`).
"""

from __future__ import annotations

import copy
import io
import logging
import os
import urllib.parse
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf

from specdrafter.core.io import SpecdrafterError, atomic_write_text, first_line
from specdrafter.core.llamacpp import DRAFTLESS

BUILTIN_TARGETS = ("smollm2-135m-instruct",)
EVAL_SETS = ("mtbench", "humaneval", "gsm8k")  # the sets the data job keeps out of training (data.exclude)
PROMPT_SETS = EVAL_SETS + ("sharegpt", "sharegpt-code")  # sharegpt-code: ShareGPT's programming requests

log = logging.getLogger("specdrafter")


class RecipeError(SpecdrafterError):
    pass


# ---------------------------------------------------------------------------------------- single-key rules
@dataclass(frozen=True)
class Rule:
    """What one key's value must be. A list's rule applies to each item (a mapping's to each value), unless `whole`.
    The error reads "recipe key K must be <must>, got V", or "recipe key K: <why(V)>" when `why` is given."""
    ok: Callable[[Any], bool]
    must: str = ""
    why: Optional[Callable[[Any], str]] = None
    whole: bool = False

    def problem(self, key: str, value) -> str:
        return f"recipe key {key!r}: {self.why(value)}" if self.why else f"recipe key {key!r} must be {self.must}, got {value}"


def checked(default, *rules: Rule):
    """A schema field and the rules its value must pass (a list or mapping default is copied per recipe)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"rules": rules})
    return field(default=default, metadata={"rules": rules})


SEED = Rule(lambda v: 0 <= v < 2**32, "in [0, 2**32)")
NON_NEGATIVE = Rule(lambda v: v >= 0, ">= 0")
POSITIVE = Rule(lambda v: v > 0, "> 0")
AT_LEAST_ONE = Rule(lambda v: v >= 1, ">= 1")
SHARE = Rule(lambda v: 0 <= v <= 1, "in [0, 1]")
TOP_P = Rule(lambda v: 0 < v <= 1, "in (0, 1]")
CUT = Rule(lambda v: 0 < v < 1, "in (0, 1)")
NON_EMPTY = Rule(lambda v: len(v) >= 1, "a non-empty list", whole=True)


def one_of(*values) -> Rule:
    return Rule(lambda v: v in values, ", ".join(map(str, values[:-1])) + f" or {values[-1]}")


def existing_folder(what: str, names: Tuple[str, ...] = ()) -> Rule:
    """A local folder that exists; one of `names`, or a name that does not look local (a hub id), passes too."""
    return Rule(lambda v: v in names or not _looks_local(v) or Path(v).expanduser().is_dir(),
                why=lambda v: f"{what} {v!r} does not exist")


DATA_PROMPTS = Rule(lambda v: v in PROMPT_SETS or Path(v).expanduser().is_file(),
                    why=lambda v: f"{v!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor an existing file")
PROMPTS = Rule(lambda v: v in PROMPT_SETS or Path(v).expanduser().exists(),
               why=lambda v: f"{v!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor an existing JSONL file or "
                             "datasets folder")


BASELINE = Rule(lambda v: isinstance(v, str) and (v in DRAFTLESS or not _looks_local(v) or Path(v).expanduser().is_file()),
                why=lambda v: f"{v!r} is neither one of llama.cpp's modes without a drafter ({', '.join(DRAFTLESS)}), a "
                              "built-in model's name nor an existing GGUF file")


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Engine(Enum):
    hf = "hf"  # regenerate in this process (transformers)
    server = "server"  # OpenAI-compatible chat-completions servers: vLLM, SGLang, `transformers serve`
    llamacpp = "llama.cpp"  # a llama-server of the target that the data job starts and stops itself (jobs/data.py)


class ResponseSource(Enum):
    target = "target"  # every assistant turn regenerated by the target (its own earlier answers in the context)
    dataset = "dataset"  # the conversation's own assistant turns, teacher-forced: the target supplies features only
    mix = "mix"  # a seeded share (data.target_share) of conversations regenerated, the rest teacher-forced


class RewrittenHistory(Enum):
    # a template that lays an earlier answer out otherwise than it was generated (Qwen3 drops its <think> block):
    split = "split"  # the next turn starts a new row, its context as the template renders it (what a server sees)
    stop = "stop"  # the conversation ends after that answer


class Overlong(Enum):
    skip = "skip"  # drop prompts that do not fit (counted)
    truncate = "truncate"  # keep their first tokens (counted)


@dataclass
class TargetConfig:
    # A built-in offline asset (smollm2-135m-instruct), a local Hugging Face model folder, or a hub id
    # such as meta-llama/Llama-3.1-8B-Instruct on a machine with hub access.
    model: str = checked("smollm2-135m-instruct", existing_folder("model folder", BUILTIN_TARGETS))
    dtype: DType = DType.float32
    # Where the target (and the drafter beside it) runs in the data, decode and eval jobs: auto = this process's
    # CUDA device (LOCAL_RANK) when there is one, else the CPU; or cpu, cuda, cuda:N. Training always uses the
    # rank's device (the DeepSpeed launcher's placement).
    device: str = "auto"
    # An architecture outside the target matrix (docs/targets.md) is refused; true runs it anyway, untested.
    untested_architecture: bool = False
    # Variables for the target's chat template, used for every prompt a job lays out and sent to servers as their
    # chat_template_kwargs (docs/chat-formats.md): Qwen3 {enable_thinking: false}, gpt-oss {reasoning_effort: low}.
    # A key the template never reads is refused.
    chat_template_kwargs: Dict[str, Any] = checked({}, Rule(lambda v: all(str(k).isidentifier() for k in v),
                                                         "a mapping of template variable names to values", whole=True))


@dataclass
class HiddenStatesConfig:
    # Target layers whose *input* hidden states are cached for offline EAGLE training (vLLM's convention:
    # id k = input to decoder layer k; id num_hidden_layers = the last layer's output before the final norm;
    # models/features.py). Empty = off.
    layer_ids: List[int] = checked([], NON_NEGATIVE)
    dtype: DType = DType.bfloat16
    batch_size: int = checked(8, AT_LEAST_ONE)


class GGUFType(Enum):  # the target GGUF's weights for llama.cpp (convert_hf_to_gguf.py --outtype)
    f32 = "f32"
    bf16 = "bf16"
    f16 = "f16"
    q8_0 = "q8_0"


@dataclass
class DataLlamaCppConfig:
    # With data.engine=llama.cpp: the target converted to GGUF once (into the cache) and served by llama-server with
    # data.concurrency slots for the job's length. Its threads spin: the job should have the machine to itself.
    threads: int = checked(0, NON_NEGATIVE)  # 0 = every core this process may use
    # None = a GGUF target's own file (the one it was converted from), else target.dtype's type (f32, bf16, f16); a
    # quantised GGUF of another target is another model
    outtype: Optional[GGUFType] = None


SERVER_URL = Rule(lambda v: server_url_problem(v) is None, why=lambda v: f"{v!r} {server_url_problem(v)}")


@dataclass
class DataConfig:
    # a built-in prompt set or a JSONL file of {"turns": [...]} / {"prompt": ...}
    prompts: str = checked("sharegpt", DATA_PROMPTS)
    num_conversations: int = checked(64, AT_LEAST_ONE)
    min_prompt_tokens: int = checked(4, NON_NEGATIVE)
    max_prompt_tokens: int = checked(384, AT_LEAST_ONE)
    overlong: Overlong = Overlong.skip
    exclude: List[str] = checked(["mtbench", "humaneval", "gsm8k"],
                                 Rule(lambda v: v in EVAL_SETS, f"an evaluation set ({', '.join(EVAL_SETS)})"))
    max_new_tokens: int = checked(256, AT_LEAST_ONE)
    temperature: float = checked(0.7, NON_NEGATIVE)  # 0 = greedy
    top_p: float = checked(0.95, TOP_P)
    batch_size: int = checked(16, AT_LEAST_ONE)
    shard_size: int = checked(32, AT_LEAST_ONE)
    seed: int = checked(0, SEED)
    engine: Engine = Engine.hf
    servers: List[str] = checked([], SERVER_URL)  # with engine=server: base URLs, e.g. http://127.0.0.1:8000
    concurrency: int = checked(8, AT_LEAST_ONE)  # requests in flight over all servers (engine=llama.cpp: its slots)
    llamacpp: DataLlamaCppConfig = field(default_factory=DataLlamaCppConfig)
    # assistant turns per conversation: each regenerated given the target's own earlier answers
    max_turns: int = checked(1, AT_LEAST_ONE)
    responses: ResponseSource = ResponseSource.target
    target_share: Optional[float] = checked(None, SHARE)  # with responses=mix: the share of conversations the target regenerates
    # A reasoning target's thinking (Qwen3's <think>…</think>, gpt-oss's analysis channel) is part of what it generates
    # and what a drafter drafts when it serves with thinking on, so it is trained on by default; false masks it out of
    # the loss (docs/chat-formats.md). To generate without thinking, set target.chat_template_kwargs instead.
    loss_on_thinking: bool = True
    # When the chat template rewrites an earlier answer (Qwen3 drops its thinking), the ids of the next turn no longer
    # extend the conversation's: split starts a new row there, from the template's own rendering (docs/chat-formats.md)
    rewritten_history: RewrittenHistory = RewrittenHistory.split
    hidden_states: HiddenStatesConfig = field(default_factory=HiddenStatesConfig)
    # parallel data jobs on one output_dir (one single-threaded process per core, each with its own data.worker):
    # each claims a shard before making it; worker w takes the shards i with i % workers == w first, then any other
    # no worker holds; the last to finish writes stats.json
    workers: int = checked(1, AT_LEAST_ONE)
    worker: int = checked(0, NON_NEGATIVE)


class VerifierKind(Enum):
    exact = "exact"  # greedy at temperature 0, exact speculative sampling above
    asd = "asd"  # approximate speculative decoding (temperature 0 only)
    typical = "typical"  # Medusa typical acceptance over a static tree (lossy)


@dataclass
class LoraConfig:
    r: int = checked(0, NON_NEGATIVE)  # LoRA rank; 0 = train every weight
    alpha: float = checked(16.0, POSITIVE)
    dropout: float = checked(0.0, Rule(lambda v: 0 <= v < 1, "in [0, 1)"))
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class MedusaConfig:
    num_heads: int = checked(4, AT_LEAST_ONE)
    num_layers: int = checked(1, NON_NEGATIVE)  # ResBlocks per head
    decay: float = checked(0.8, POSITIVE)  # head h's loss weight is decay**h
    # 1 = Medusa-1 (backbone frozen); 2 = Medusa-2: the backbone is fine-tuned jointly through LoRA (drafter.lora),
    # distilled towards the original target so that what is served stays the target; loss = backbone + heads_weight·heads
    stage: int = checked(1, Rule(lambda v: v in (1, 2), "1 (Medusa-1) or 2 (Medusa-2)"))
    heads_weight: float = checked(0.2, POSITIVE)
    backbone_lr_ratio: float = checked(0.1, POSITIVE)  # Medusa-2: the backbone adapter's learning rate ÷ train.lr


@dataclass
class EagleConfig:
    # Target layers fused by the head (id k = input to layer k); empty = {2, L//2, L-3} (EAGLE-3's default).
    aux_layer_ids: List[int] = checked([], NON_NEGATIVE, Rule(lambda v: len(v) in (0, 3), whole=True, must=(
        "three layer ids (low, middle, high), or empty for EAGLE-3's default")))
    ttt_steps: int = checked(7, AT_LEAST_ONE)  # training-time-test steps
    step_decay: float = checked(0.8, POSITIVE)  # step j's loss weight is step_decay**j
    draft_vocab_size: int = checked(0, NON_NEGATIVE)  # most frequent target tokens of the training data; 0 = the full vocabulary
    feature_weight: float = checked(1.0, NON_NEGATIVE)  # EAGLE-1: SmoothL1 feature regression
    ce_weight: float = checked(0.1, NON_NEGATIVE)  # EAGLE-1: weight of the distillation objective
    # Biases on the head's q/k/v/o projections; null = the target's attention_bias (gpt-oss: true). llama.cpp's
    # EAGLE-3 layer has none: false for a head that is to be served there.
    attention_bias: Optional[bool] = None
    # EAGLE-3.1 (docs/algorithms.md §EAGLE-3.1), the engines' config keys: `fc_norm` an RMSNorm on each captured target
    # layer before fc (the paper's; vLLM, SGLang), `norm_output` the post-norm hidden state fed back between draft
    # steps; `norm_before_fc` one RMSNorm over the three layers concatenated instead (speculators' gpt-oss heads, the
    # only one llama.cpp serves). fc_norm and norm_before_fc exclude each other.
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False


class BlockLength(Enum):
    fixed = "fixed"  # verify every drafted token (up to inference.k)
    confidence = "confidence"  # DSpark: as many as the confidence head and the measured cost curve say pay


class BlockLossWeighting(Enum):
    decay = "decay"  # draft j weighted exp(−j / loss_decay) (DFlash's own schedule)
    dpace = "dpace"  # D-PACE: each draft weighted by the block's smoothed confidence from it on (train/objectives.py)


@dataclass
class BlockConfig:
    """DFlash, DSpark, DFlash2 and Domino (models/block.py, docs/block-drafters.md)."""
    num_layers: int = checked(1, AT_LEAST_ONE)  # backbone decoder layers at the target's width
    block_size: int = checked(8, Rule(lambda v: v >= 2, ">= 2 (the anchor and at least one masked slot)"))
    # The target features read: id k is the input to layer k (HF hidden_states[k]), as drafter.eagle.aux_layer_ids;
    # increasing, within 1..L − 1; empty = the inputs of layers round(linspace(1, L − 3, num_features)) + 1.
    aux_layer_ids: List[int] = checked([], AT_LEAST_ONE)
    num_features: int = checked(5, AT_LEAST_ONE)
    # An unused row of the target's embedding that fills the block's masked slots (16: SmolLM2's <empty_output>);
    # training refuses one that occurs in its data.
    mask_token_id: int = checked(16, NON_NEGATIVE)
    anchors: int = checked(32, AT_LEAST_ONE)  # blocks per training sequence (anchor positions sampled uniformly)
    # Draft j's loss weight is exp(−j / loss_decay) (j = 0 first); 0 = all alike
    loss_decay: float = checked(4.0, NON_NEGATIVE)
    # how draft j's objective is weighted: decay (above), or dpace (the default of speculators' and Model-Optimizer's
    # DFlash; loss_decay unused), its confidence smoothed towards 1 by dpace_alpha (docs/algorithms.md#d-pace)
    loss_weighting: BlockLossWeighting = BlockLossWeighting.decay
    dpace_alpha: float = checked(0.5, Rule(lambda v: 0 < v <= 1, "in (0, 1]"))
    markov_rank: int = checked(256, NON_NEGATIVE)  # DSpark's Markov head rank (0: none)
    # the Markov head's learning rate ÷ train.lr: its previous-token embedding is sparse (a row moves only when its
    # token occurs), and at 1 it barely moves in a CPU-sized run (docs/block-drafters.md#the-markov-heads-learning-rate)
    markov_lr_scale: float = checked(10.0, POSITIVE)
    # DSpark: the Markov head's learning rate is 0 for this share of the run's optimizer steps (its moments still
    # gather), so the backbone learns the drafts before the bigram head takes the easy part of them
    markov_hold: float = checked(0.0, Rule(lambda v: 0 <= v < 1, "in [0, 1)"))
    confidence_weight: float = checked(1.0, NON_NEGATIVE)  # DSpark: BCE(confidence, 1 − TV) beside the objective
    confidence_decay: bool = False  # DSpark: draft j's BCE term also weighted by exp(−j / loss_decay), as its objective
    # DSpark: the confidence head reads the backbone's hidden state and the Markov embedding detached, so its BCE
    # trains the head alone and sends no gradient into the backbone or W1
    confidence_detach: bool = False
    draft_vocab_size: int = checked(0, NON_NEGATIVE)  # most frequent target tokens of the data; 0 = full vocabulary
    init_from_target: bool = True  # start layer i from the target's layer L − n + i (where the tensors fit)
    # DFlash2 (drafter.kind=dflash2; docs/algorithms.md#dflash2): the convolution around each sublayer (taps,
    # channels per dynamic coefficient: a divisor of the width) and the candidate selector (codebook rank,
    # candidates per draft), whose K-way CE on the true token is added with weight selector_weight
    conv_kernel_size: int = checked(2, AT_LEAST_ONE)
    conv_group_size: int = checked(16, AT_LEAST_ONE)
    selector_rank: int = checked(256, AT_LEAST_ONE)
    selector_top_k: int = checked(16, Rule(lambda v: v >= 2, ">= 2 (a choice among candidates)"))
    selector_weight: float = checked(1.0, NON_NEGATIVE)
    # Domino (drafter.kind=domino; docs/algorithms.md#domino): the GRU's width, the correction's hidden width (the
    # engines' emb_dim) and how many first drafts stay uncorrected (pure_draft_prefix_len); the uncorrected logits'
    # own objective, weighted base_weight at the start and falling linearly to 0 over base_decay of the run
    # (SpecForge's lambda_base_start and lambda_base_decay_ratio), while the corrected ones get the rest
    gru_hidden_dim: int = checked(1024, AT_LEAST_ONE)
    correction_dim: int = checked(256, AT_LEAST_ONE)
    uncorrected_drafts: int = checked(1, NON_NEGATIVE)
    base_weight: float = checked(1.0, Rule(lambda v: 0 <= v <= 1, "in [0, 1]"))
    base_decay: float = checked(1.0, Rule(lambda v: 0 <= v <= 1, "in [0, 1]"))
    # Decoding: how many of the block's drafts each cycle verifies (decided before the target sees them)
    length: BlockLength = BlockLength.fixed


@dataclass
class PEagleConfig:
    """P-EAGLE (train/peagle.py, docs/algorithms.md#p-eagle): an EAGLE-3 head (drafter.eagle's layers, vocabulary and
    norms) that drafts `depths` tokens in one pass; the slots after the first read a learnt hidden state."""
    depths: int = checked(4, Rule(lambda v: v >= 2, ">= 2 (the first draft and at least one masked slot)"))  # K
    # COD: depth j trains on max(cod_ratio**j, cod_ratio_min) of a sequence's positions (speculators' defaults)
    cod_ratio: float = checked(0.7, CUT)
    cod_ratio_min: float = checked(0.2, SHARE)
    # An unused row of the target's embedding fed at the masked slots (16: SmolLM2's <empty_output>); training
    # refuses one that occurs in its data
    mask_token_id: int = checked(16, NON_NEGATIVE)
    depth_decay: float = checked(1.0, POSITIVE)  # depth j's loss weight is depth_decay**j (1: all alike, as speculators)


@dataclass
class MtpConfig:
    # drafter.kind=mtp (a target's own MTP layer, train/mtp.py): chained steps trained per position (FastMTP's
    # recursive steps: step j feeds step j−1's state back and predicts x_{t+j+2}), step j weighted step_decay**j
    steps: int = checked(3, AT_LEAST_ONE)
    step_decay: float = checked(0.6, POSITIVE)


@dataclass
class DrafterConfig:
    # the drafter kind: a name of kinds/__init__.py:KINDS, the one place kinds are registered (kinds.check_recipe
    # refuses any other), e.g. self_draft (the target's first `num_layers` layers, training-free), draft_model, medusa,
    # eagle3, eagle1, peagle, dflash, dspark
    kind: str = "self_draft"
    # Inference: the trained drafter's folder (a checkpoint's `drafter/` or an export) or a draft model's hub id.
    # Training a draft model: optional initial weights (else the target's first `num_layers` layers).
    path: Optional[str] = checked(None, existing_folder("drafter folder"))
    # Decoding with drafter.path unset: a training run's output_dir (or a checkpoint of it) whose newest checkpoint
    # decodes in place of drafter.kind once it holds one trained for target.model; until then drafter.kind decodes,
    # and the job says which (jobs/decode.py: resolve_drafter). The recipe's decoding keys are checked against the
    # drafter that decodes (kinds/__init__.py: check_recipe). None: always drafter.kind.
    run: Optional[str] = None
    # self_draft, and a draft model initialised from the target's first num_layers layers
    num_layers: int = checked(6, AT_LEAST_ONE)
    # draft model: which target layers to copy instead, e.g. [0, 1, 28, 29]; with drafter.path, which of that
    # model's layers to keep (e.g. [0, 1]: a 2-layer cut of a smaller model of the target's family)
    layers: List[int] = checked([], NON_NEGATIVE)
    # draft model: a residual width below its source's (the target's layers or drafter.path's model), initialised by
    # projecting that model onto its leading principal directions (train/narrow.py); None: the source's width
    hidden_size: Optional[int] = checked(None, AT_LEAST_ONE)
    lora: LoraConfig = field(default_factory=LoraConfig)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    block: BlockConfig = field(default_factory=BlockConfig)
    mtp: MtpConfig = field(default_factory=MtpConfig)
    peagle: PEagleConfig = field(default_factory=PEagleConfig)


class FeatureMode(Enum):
    online = "online"  # the frozen target computes features and logits for every batch, in the same process
    offline = "offline"  # read the hidden states cached by the data job (data.hidden_states.layer_ids)


class Precision(Enum):
    auto = "auto"  # bf16 on a GPU, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"  # DeepSpeed bf16: bf16 weights with fp32 master copies
    # fp32 weights and optimizer; teacher lm_head and drafter forward under bf16 autocast (CPUs with AVX512-BF16 / AMX, GPUs)
    amp_bf16 = "amp_bf16"


class WandbMode(Enum):
    offline = "offline"  # logs to <output_dir>/wandb; `wandb sync` uploads later
    online = "online"
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "specdrafter"
    name: Optional[str] = None  # default: the output folder's name


@dataclass
class TrainConfig:
    data_dir: Optional[str] = None  # the data job's output_dir (shards/ + hidden/)
    # The data job's recipe (a path, or the name of one in recipes/), which launch/plan.py sizes the data from until
    # the job has run and saved its own recipe.yaml in data_dir. None: this recipe's data section. Training never reads it.
    data_recipe: Optional[str] = None
    features: FeatureMode = FeatureMode.online
    # Distillation objective: weights over tv, fkl, rkl, jsd, soft_ce (docs/algorithms.md §Objectives), at
    # `temperature` (match the temperature the drafter will serve at). Empty = {soft_ce: 1}
    # (train/objectives.py:DEFAULT_WEIGHTS). Entries merge across the recipe and overrides, so switch with e.g.
    # train.objective.soft_ce=0 train.objective.tv=1.
    objective: Dict[str, float] = checked({}, NON_NEGATIVE, Rule(lambda v: not v or any(w != 0 for w in v.values()),
                                                                 why=lambda v: "needs at least one non-zero weight",
                                                                 whole=True))
    temperature: float = checked(1.0, POSITIVE)
    jsd_beta: float = checked(0.5, Rule(lambda v: 0 < v < 1, "in (0, 1)"))
    max_length: int = checked(2048, Rule(lambda v: v >= 2, ">= 2"))  # tokens per conversation (longer ones are cut)
    # train on the first conversations holding this many target tokens (a scaling budget); 0 = all
    data_tokens: int = checked(0, NON_NEGATIVE)
    group_by_length: bool = True  # micro-batches of similar lengths (less padding); the order stays a function of (seed, epoch)
    epochs: int = checked(1, AT_LEAST_ONE)
    max_steps: int = checked(0, NON_NEGATIVE)  # optimizer steps; 0 = as many as `epochs` take
    micro_batch_size: int = checked(4, AT_LEAST_ONE)  # conversations per rank per forward
    grad_accum: int = checked(1, AT_LEAST_ONE)
    lr: float = checked(1e-4, POSITIVE)
    warmup_steps: int = checked(0, NON_NEGATIVE)
    min_lr_ratio: float = checked(0.1, SHARE)  # cosine decay to lr * min_lr_ratio
    weight_decay: float = checked(0.0, NON_NEGATIVE)
    grad_clip: float = checked(1.0, NON_NEGATIVE)
    zero_stage: int = checked(0, one_of(0, 1, 2, 3))
    precision: Precision = Precision.auto
    heldout: int = checked(16, NON_NEGATIVE)  # conversations kept out of training for the held-out metrics
    eval_every: int = checked(50, AT_LEAST_ONE)  # optimizer steps between held-out metrics
    save_every: int = checked(50, AT_LEAST_ONE)  # optimizer steps between checkpoints
    keep_checkpoints: int = checked(2, AT_LEAST_ONE)
    seed: int = checked(0, SEED)
    # a checkpoint folder whose drafter weights initialise a new run
    warm_start: Optional[str] = checked(None, Rule(lambda v: Path(v).expanduser().is_dir(),
                                                   why=lambda v: f"checkpoint folder {v!r} does not exist"))
    # Every N checkpoints (and at the last), decode a couple of prompts of eval.sets[0] with the saved drafter
    # through the real loop and log τ and α (decode/tau, decode/alpha); 0 = off.
    decode_check_every: int = checked(0, NON_NEGATIVE)
    # Memory per GPU that launch/plan.py and the launchers' check (jobs/plan.py) plan against. None: 80 GiB in the
    # planner, the device's own memory on a CUDA launch.
    gpu_memory_gb: Optional[float] = checked(None, Rule(lambda v: v > 0, "> 0 (GiB per GPU)"))
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ASDConfig:
    budget: float = checked(8.0, NON_NEGATIVE)
    gate: float = checked(0.25, NON_NEGATIVE)
    max_mismatches: int = checked(2, AT_LEAST_ONE)


@dataclass
class DynamicTreeConfig:
    # EAGLE-2 dynamic tree of this many draft tokens (EAGLE-3 head or draft model); 0 = off
    total_tokens: int = checked(0, NON_NEGATIVE)
    depth: int = checked(5, AT_LEAST_ONE)
    top_k: int = checked(8, AT_LEAST_ONE)
    # verify only as many of the total_tokens best candidates as maximise the predicted speedup, from the learnt
    # acceptance per draft probability, the draft cost and v(n) (inference/autotune.TreeSizeTuner); false = all
    auto_size: bool = True


@dataclass
class TypicalConfig:
    eps: float = checked(0.09, NON_NEGATIVE)
    delta: float = checked(0.3, NON_NEGATIVE)


@dataclass
class InferenceConfig:
    prompt: str = "Explain speculative decoding in two sentences."
    # A prompt set name or a JSONL file / datasets folder: launch/generate.py decodes the first user turn of every
    # prompt into <output_dir>/decode.jsonl (a rerun skips the prompts already there). None: decode `prompt`.
    prompts: Optional[str] = checked(None, PROMPTS)
    max_new_tokens: int = checked(128, AT_LEAST_ONE)
    temperature: float = checked(0.0, NON_NEGATIVE)
    top_k: int = checked(0, NON_NEGATIVE)
    top_p: float = checked(1.0, TOP_P)
    # Draft tokens per cycle (chain): a number, or auto — chosen every cycle from the measured per-position
    # acceptance, draft cost and verification cost curve (inference/autotune.py), up to k_max.
    k: Union[int, str] = checked("auto", Rule(lambda v: v == "auto" or (isinstance(v, int) and v >= 1), "auto or >= 1"))
    k_max: int = checked(8, AT_LEAST_ONE)
    tree: List[List[int]] = checked([], NON_NEGATIVE)  # static tree choice paths, e.g. [[0],[1],[0,0]]; empty = chain
    dynamic_tree: DynamicTreeConfig = field(default_factory=DynamicTreeConfig)
    verifier: VerifierKind = VerifierKind.exact
    asd: ASDConfig = field(default_factory=ASDConfig)
    typical: TypicalConfig = field(default_factory=TypicalConfig)
    seed: int = checked(0, SEED)


class EvalVerifier(Enum):
    chain = "chain"  # exact chain speculative decoding with block length inference.k (greedy at T = 0)
    tree = "tree"  # exact tree verification: inference.tree (static) or inference.dynamic_tree (EAGLE-2)
    typical = "typical"  # Medusa typical acceptance over inference.tree (lossy)
    asd = "asd"  # approximate speculative decoding at T = 0: inference.asd and every setting of eval.asd_sweep

    @property
    def rule(self) -> VerifierKind:
        """The acceptance rule it decodes with (inference.verifier)."""
        return {"asd": VerifierKind.asd, "typical": VerifierKind.typical}.get(self.value, VerifierKind.exact)

    @property
    def is_chain(self) -> bool:
        """It decodes a chain of inference.k drafts (else a tree)."""
        return self.value in ("chain", "asd")


class EvalEngine(Enum):
    loop = "loop"  # our decoding loop (eval/job.py)
    llamacpp = "llama.cpp"  # llama-server with the checkpoint's GGUF export, beside the target alone (engines/llamacpp_eval.py)


@dataclass
class EvalLlamaCppConfig:
    # llama.cpp's threads per server. Its worker threads spin while they wait: on a shared machine use 1, and run
    # nothing else meanwhile.
    threads: int = checked(1, AT_LEAST_ONE)
    # the target's GGUF: None = the file a GGUF target was converted from (Qwen2.5-Coder's Q4_K_M), else f32
    outtype: Optional[GGUFType] = None
    # the drafter's GGUF: f32 as trained, or q8_0 as draft models are served (a draft pass reads its whole head)
    drafter_type: GGUFType = GGUFType.f32
    # Extra cells on the first set at T = 0: the drafter at its longest block with llama.cpp's confidence cut
    # (--spec-draft-p-min) at each of these values
    p_min_sweep: List[float] = checked([], CUT)
    # Arms measured beside the drafter on every set and temperature, each prompt alternating with the target alone
    # as the drafter's do: llama.cpp's speculation without a drafter (ngram-simple, ngram-map-k, ngram-map-k4v,
    # ngram-mod, ngram-cache, spec-default: at their own sizes), and draft models users serve (a built-in GGUF model's
    # name, e.g. qwen2.5-coder-0.5b-instruct, served as its own file, or a drafter GGUF), each at the n_max its own
    # measured plan picks
    baselines: List[str] = checked([], BASELINE)


ASD_SETTINGS = Rule(lambda v: all(len(s) == 3 and s[0] >= 0 and s[1] >= 0 and s[2] >= 1 for s in v), whole=True,
                    must="a list of [budget >= 0, gate >= 0, max_mismatches >= 1]")


@dataclass
class EvalConfig:
    # What to evaluate: a training checkpoint (…/checkpoints/step-N), a drafter folder (a checkpoint's drafter/ or
    # an export), or a run's output_dir — then every checkpoint of the run. `checkpoint=` on the command line is
    # short for eval.checkpoint=.
    checkpoint: Optional[str] = None
    sets: List[str] = checked(["mtbench", "gsm8k", "humaneval"], NON_EMPTY, PROMPTS)  # names, JSONL files or datasets folders
    num_prompts: int = checked(8, AT_LEAST_ONE)  # first N prompts of each set (first turns)
    max_new_tokens: int = checked(64, AT_LEAST_ONE)
    temperatures: List[float] = checked([0.0, 0.7, 1.0], NON_EMPTY, NON_NEGATIVE)
    verifiers: List[EvalVerifier] = checked([EvalVerifier.chain], NON_EMPTY)
    # measured speedup vs k: newest checkpoint, first set, T = 0
    k_sweep: List[int] = checked([1, 2, 3, 4, 6], AT_LEAST_ONE)
    asd_sweep: List[List[float]] = checked([[4, 0.25, 1], [16, 0.5, 2]], ASD_SETTINGS)  # [budget, gate, max_mismatches]
    # Decode each cell this many times, each time with target-only decoding of every prompt right beside the
    # cell's: speedup_median is the median of those side-by-side ratios, speedup_range their range. 1: one run per
    # cell against the set's one baseline: speedup_drift_corrected, with speedup_drift_spread (how far the machine's
    # step time moved).
    repeats: int = checked(1, AT_LEAST_ONE)
    output_dir: Optional[str] = None  # default: <run>/eval beside the checkpoints
    wandb: bool = False  # also log the cells and plots to wandb (mode and project: train.wandb)
    # Where to decode: our loop, and/or llama.cpp (the newest checkpoint served by llama-server from its GGUF export,
    # each set × temperature at the block length llama.cpp's measured costs pick, and the k sweep; its numbers
    # beside the loop's in the report). llama.cpp needs `specdrafter-llamacpp install` and launch/eval_acceptance.py.
    engines: List[EvalEngine] = checked([EvalEngine.loop], NON_EMPTY)
    llamacpp: EvalLlamaCppConfig = field(default_factory=EvalLlamaCppConfig)


@dataclass
class ScalingConfig:
    # launch/scaling.py: EAGLE-3 trained on the first `budgets` target tokens of one dataset (data.responses of the
    # recipe), each evaluated through the real decoding loop; at `compare_budget` also on the other source
    # (regenerated vs teacher-forced at equal tokens). 0 = no comparison.
    budgets: List[int] = checked([100_000, 300_000, 1_000_000, 2_000_000], NON_EMPTY, AT_LEAST_ONE)
    compare_budget: int = checked(100_000, NON_NEGATIVE)
    # a first guess that sizes each data job; grown until a budget is covered
    tokens_per_conversation: int = checked(150, AT_LEAST_ONE)


@dataclass
class Recipe:
    output_dir: str = MISSING
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)


def read_yaml(path: Path) -> DictConfig:
    """The YAML mapping in `path`. Not UTF-8, a syntax error, or a document that is not a mapping: one RecipeError
    naming the file and the line."""
    try:
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8")
    except OSError as e:
        raise RecipeError(f"{path}: unreadable ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise RecipeError(f"{path}:{line}: not UTF-8 text (byte {e.start})") from None
    try:
        cfg = OmegaConf.load(io.StringIO(text))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise RecipeError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML ({e.problem or e.context})") from None
    except yaml.reader.ReaderError as e:
        line = text[:e.position].count("\n") + 1
        raise RecipeError(f"{path}:{line}: not valid YAML (character {e.character!r}: {e.reason})") from None
    except Exception as e:  # a scalar document: OmegaConf refuses it
        raise RecipeError(f"{path}:1: not a recipe: a recipe is a YAML mapping of keys (output_dir, target, data, "
                          f"...) ({first_line(e)})") from None
    if not isinstance(cfg, DictConfig):
        raise RecipeError(f"{path}:1: not a recipe: a recipe is a YAML mapping of keys (output_dir, target, data, "
                          "...), not a list")
    return cfg


def load_saved_recipe(path: str | os.PathLike) -> DictConfig:
    """A recipe.yaml that a job wrote (a checkpoint's, a data job's), as it was saved; one RecipeError if damaged."""
    return read_yaml(Path(path))


def server_url_problem(url: str) -> Optional[str]:
    """Why `url` is not a serving engine's base URL (http(s)://host[:port][/prefix], /v1 optional), or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0  # .port raises on h:abc
    except ValueError:
        ok = False
    if not ok:
        return "is not an http(s) URL such as http://127.0.0.1:8000"
    if parts.query or parts.fragment or parts.path.rstrip("/").endswith("/completions"):
        return "should be the server's base URL (http://host:port or http://host:port/v1), not an endpoint"
    return None


def _looks_local(name: str) -> bool:
    """A name that starts with / . or ~, or exists on disk, is a local folder; anything else is a hub id."""
    return name.startswith(("/", ".", "~")) or os.path.exists(name)


def save_recipe(cfg: DictConfig, folder: str | os.PathLike) -> Path:
    """The resolved recipe as <folder>/recipe.yaml beside a job's outputs, named in one log line: all a job says of its
    recipe (--print-config prints it whole)."""
    path = atomic_write_text(Path(folder) / "recipe.yaml", OmegaConf.to_yaml(cfg))
    log.info(f"recipe: {path}")
    return path
