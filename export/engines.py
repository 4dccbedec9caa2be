"""Which targets the serving engines pinned here feed a feature-reading drafter (EAGLE-3, DFlash, DSpark) the features it
was trained on, by the target's HF architecture — read from the engines' own source (vLLM 0.33.0, SGLang 0.5.23;
docs/targets.md#feature-layers has the table and the lines it rests on).

Our feature id k is the residual stream entering target layer k (id 0 the embedding as layer 0 reads it, id L the last
layer's output before the final norm). vLLM captures `hidden_states + residual` before layer k for id k on every
architecture that implements its EAGLE-3 interface (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, gpt-oss, DeepSeek-V3,
Qwen3-Next); SGLang does the same one layer later (id k = our k + 1: the `sglang` writers shift the ids). Where an
engine does not, the export is refused in one line here instead of writing a folder that the engine refuses at start-up
or, worse, serves from other tensors than the drafter was trained on (acceptance silently low; the verifier stays
exact, so the output would not show it).
"""

from __future__ import annotations

from typing import List, Optional

from specdrafter.core.io import SpecdrafterError
from specdrafter.kinds.base import Family

VLLM, SGLANG = "vLLM 0.33.0", "SGLang 0.5.23"
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# vLLM's model classes without its EAGLE-3 interface (SupportsEagle3): the engine stops at start-up with "Model does
# not support EAGLE3 interface but aux_hidden_state_outputs was requested" (v1/worker/gpu_model_runner.py). Its
# DFlash and DSpark drafters read the target through the same interface.
VLLM_NO_CAPTURE = {arch: "Gemma 3" for arch in GEMMA3}
# SGLang 0.5.23's Gemma 3 (models/gemma3_causal.py) keeps the residual apart from the hidden state between layers and
# captures the hidden state alone: the last branch's output (post_feedforward_layernorm(mlp(·))), not the residual
# stream. It has no DFlash/DSpark capture at all (no set_dflash_layers_to_capture).
SGLANG_OTHER_TENSOR = {arch: "Gemma 3" for arch in GEMMA3}
# SGLang 0.5.23's Qwen2 (models/qwen2.py) captures EAGLE-3's layers (set_eagle3_layers_to_capture) but has no
# set_dflash_layers_to_capture: the engine stops at start-up ("implements neither set_dspark_layers_to_capture nor
# set_dflash_layers_to_capture", model_runner_components/attention_backend_setup.py).
SGLANG_NO_BLOCK_CAPTURE = {"Qwen2ForCausalLM": "Qwen2"}
# vLLM 0.33.0's DeepSeek-V2/V3 loop adds `hidden_states + residual` before layer 0, where the residual is still None.
VLLM_NO_EMBEDDING = {"DeepseekV3ForCausalLM": "DeepSeek-V3", "DeepseekV2ForCausalLM": "DeepSeek-V2"}
ENGINE_OF = {"vllm": VLLM, "speculators": VLLM, "sglang": SGLANG}  # the engine that serves each format


def check_engine_target(fmt: str, family: Family, description: str, architectures: List[str],
                        eagle_ids: Optional[List[int]] = None) -> None:
    """One line where the engine serving `fmt` cannot feed this drafter its trained features beside this target."""
    if fmt not in ENGINE_OF or family not in (Family.eagle, Family.block) or not architectures:
        return
    arch, engine = architectures[0], ENGINE_OF[fmt]
    if fmt in ("vllm", "speculators") and arch in VLLM_NO_CAPTURE:
        raise SpecdrafterError(f"--format {fmt}: {engine} cannot serve {description} beside a {VLLM_NO_CAPTURE[arch]} "
                               f"target ({arch}): its model class has no EAGLE-3 interface to capture the target's "
                               "layers, and vLLM stops at start-up; llama.cpp cannot either (see --format gguf), "
                               "a draft model (drafter.kind=draft_model) serves there")
    if fmt == "sglang" and arch in SGLANG_OTHER_TENSOR:
        what = ("captures each layer's last branch output, not the residual stream the drafter was trained on, so it "
                "would draft from other features" if family is Family.eagle else "has no DFlash/DSpark capture")
        raise SpecdrafterError(f"--format sglang: {engine}'s {SGLANG_OTHER_TENSOR[arch]} model ({arch}) {what}; "
                               "refused rather than served wrongly")
    if fmt == "sglang" and family is Family.block and arch in SGLANG_NO_BLOCK_CAPTURE:
        raise SpecdrafterError(f"--format sglang: {engine}'s {SGLANG_NO_BLOCK_CAPTURE[arch]} model ({arch}) has no "
                               "DFlash/DSpark capture and SGLang stops at start-up; vLLM serves it (--format vllm)")
    if fmt in ("vllm", "speculators") and arch in VLLM_NO_EMBEDDING and eagle_ids and 0 in eagle_ids:
        raise SpecdrafterError(f"--format {fmt}: aux layer id 0 (the embedding) of ids {eagle_ids} cannot be captured "
                               f"by {engine} beside a {VLLM_NO_EMBEDDING[arch]} target ({arch}): its loop adds a "
                               "residual that does not exist yet before layer 0 and fails at the first step; retrain "
                               "the head with drafter.eagle.aux_layer_ids from 1 up")
