"""The target's chat template and stop tokens: what every job that builds a prompt or ends a response uses."""

from __future__ import annotations

from typing import List


def chat_ids(tokenizer, messages: List[dict], generation_prompt: bool) -> List[int]:
    """The token ids the target's own chat template lays out for `messages`."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                         return_dict=True)["input_ids"]


def user_prompt_ids(tokenizer, text: str) -> List[int]:
    """A single-turn chat prompt: the user's `text` and the assistant's generation prompt."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}], True)


def eos_token_ids(model, tokenizer=None) -> List[int]:
    """Every id that ends a response: the model's generation_config eos id(s), plus the tokenizer's eos token."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
