"""The target's chat template and stop tokens: what every job that builds a prompt or ends a response uses, and the
spans of a response that are the target's thinking (docs/chat-formats.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from specdrafter.core.io import SpecdrafterError


def chat_ids(tokenizer, messages: List[dict], generation_prompt: bool) -> List[int]:
    """The token ids the target's own chat template lays out for `messages`."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                         return_dict=True)["input_ids"]


def user_prompt_ids(tokenizer, text: str) -> List[int]:
    """A single-turn chat prompt: the user's `text` and the assistant's generation prompt."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}], True)


# one harmony message in a gpt-oss answer: its channel and its text (the first one's <|start|>assistant is the
# generation prompt's, so it is not in the answer; the last one's <|return|> is the EOS, cut before decoding)
HARMONY_MESSAGE = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>(\w+)<\|message\|>(.*?)(?:<\|end\|>|$)", re.S)


def assistant_message(text: str) -> dict:
    """An answer the target generated, as its chat template takes an assistant turn back. A harmony answer (gpt-oss)
    is split by channel: its analysis into `thinking`, its final answer into `content`, since that template refuses
    channel tags in either field (and, as every server does, drops the analysis of earlier turns). Any other text
    stays whole in `content`: Qwen3's template finds the <think> block in it itself."""
    if "<|channel|>" not in text:
        return {"role": "assistant", "content": text}
    parts = HARMONY_MESSAGE.findall(text)
    message = {"role": "assistant", "content": "".join(body for channel, body in parts if channel == "final")}
    if any(channel == "analysis" for channel, _ in parts):
        message["thinking"] = "".join(body for channel, body in parts if channel == "analysis")
    return message


def eos_token_ids(model, tokenizer=None) -> List[int]:
    """Every id that ends a response: the model's generation_config eos id(s), plus the tokenizer's eos token."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


# ------------------------------------------------------------------------------------ template variables
def with_template_kwargs(tokenizer, kwargs: Optional[Mapping]):
    """The tokenizer with the recipe's `target.chat_template_kwargs` bound into its `apply_chat_template`, so every
    prompt a job lays out, through our helpers or transformers' own calls, renders the template the same way (a
    call's own keyword still wins). `tokenizer.chat_template_kwargs` keeps them for the servers, which are sent the
    same. The template saved with the tokenizer is unchanged. A key the template never reads is refused in one line:
    Jinja ignores an unknown variable, so a misspelt `enable_thinkng: false` would otherwise change nothing."""
    kwargs = OmegaConf.to_container(kwargs) if isinstance(kwargs, DictConfig) else dict(kwargs or {})  # JSON for servers
    tokenizer.chat_template_kwargs = kwargs
    if not kwargs:
        return tokenizer
    readable = template_variables(tokenizer.chat_template)
    unread = sorted(set(kwargs) - readable)
    if unread:
        raise SpecdrafterError(f"recipe key 'target.chat_template_kwargs': the target's chat template never reads "
                               f"{', '.join(map(repr, unread))}; it reads {', '.join(sorted(readable)) or 'no variables'}")
    plain = tokenizer.apply_chat_template

    def apply_chat_template(conversation, *args, **call_kwargs):
        return plain(conversation, *args, **{**kwargs, **call_kwargs})

    tokenizer.apply_chat_template = apply_chat_template
    return tokenizer


TEMPLATE_GIVENS = {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                   "strftime_now", "range", "namespace", "dict", "loop", "true", "false", "none"}


def template_variables(template: Optional[str]) -> set:
    """The variables a chat template reads that the caller may set (what transformers passes itself excluded)."""
    import jinja2
    from jinja2 import meta
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):  # transformers' {% generation %} … {% endgeneration %} block, parsed as a plain body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    if not template:
        return set()
    env = jinja2.Environment(extensions=[loopcontrols, Generation])
    return meta.find_undeclared_variables(env.parse(template)) - TEMPLATE_GIVENS


# ------------------------------------------------------------------------------------------- thinking
@dataclass(frozen=True)
class Thinking:
    """How a family marks its thinking in a response: from the first `open` id sequence to the next `close` (both
    included). Qwen3, QwQ and DeepSeek-R1: <think> … </think>; gpt-oss (harmony): <|channel|>analysis<|message|> …
    <|end|>, its final answer then in another message on the final channel."""
    name: str
    open: List[int]
    close: List[int]


# name: (the text that opens a span, the single token that closes it, the tokens the vocabulary must have)
THINKING_FORMATS = {"think tags": ("<think>", "</think>", ("<think>", "</think>")),
                    "harmony analysis channel": ("<|channel|>analysis<|message|>", "<|end|>",
                                                 ("<|channel|>", "<|message|>", "<|end|>"))}


def thinking_format(tokenizer) -> Optional[Thinking]:
    """The target's thinking markers, if its vocabulary has a family's special tokens (None if it has none)."""
    vocab = tokenizer.get_vocab()
    for name, (open_text, close, needs) in THINKING_FORMATS.items():
        if all(token in vocab for token in needs):
            return Thinking(name, tokenizer(open_text, add_special_tokens=False)["input_ids"], [vocab[close]])
    return None


def thinking_mask(response: List[int], thinking: Thinking) -> List[int]:
    """1 on every response token outside the thinking spans, 0 inside them (markers included); a span that is not
    closed (a response cut at max_new_tokens mid-thought) runs to the end."""
    mask, i, n = [1] * len(response), 0, len(thinking.open)
    while i <= len(response) - n:
        if response[i:i + n] != thinking.open:
            i += 1
            continue
        end = next((j + len(thinking.close) for j in range(i + n, len(response) - len(thinking.close) + 1)
                    if response[j:j + len(thinking.close)] == thinking.close), len(response))
        mask[i:end] = [0] * (end - i)
        i = end
    return mask
