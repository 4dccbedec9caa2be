"""The rows of a dataset, built turn by turn: each conversation's ids as the chat template lays them out and a loss
mask that is 1 exactly on the assistant tokens, whose answers are the target's own (regenerated, with its earlier
answers in the context) or the prompt set's (teacher-forced); a conversation ends when its turns run out, a turn
does not fit, or the template stops extending the ids so far — or, with data.rewritten_history=split, goes on in a
new row (docs/chat-formats.md, docs/data.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import jinja2
from omegaconf import DictConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.data.chat import Thinking, assistant_message, chat_ids, thinking_format, thinking_mask

log = logging.getLogger("specdrafter")


@dataclass
class Conversation:
    """One conversation being built turn by turn: the ids as the chat template lays them out, and a loss mask
    that is 1 exactly on the assistant tokens (each closing EOS included)."""
    prompt: dict  # {"id", "text" (first turn, maybe truncated), "turns", "reference", "truncated", "source"}
    messages: List[dict] = field(default_factory=list)
    input_ids: List[int] = field(default_factory=list)
    loss_mask: List[int] = field(default_factory=list)
    finished: bool = True  # the last assistant turn ended with EOS
    open: bool = True  # another turn may follow
    stop_reason: Optional[str] = None
    next_ids: List[int] = field(default_factory=list)  # the ids of the context `context` returned last
    response_tokens: int = 0  # the assistant's tokens (thinking included, trained on or not)
    split_rewritten: bool = False  # data.rewritten_history=split
    rows: List[dict] = field(default_factory=list)  # earlier rows, where the template rewrote the history (`split`)
    row_start: int = 0  # the turn this row starts at

    def context(self, tokenizer, turn: int, max_prompt: int, room: int) -> Optional[List[dict]]:
        """Messages for assistant turn `turn` (ending with its user turn), or None (and `open` False) when the
        conversation ends here: no more user turns, an over-long turn, no room in the context window, or the
        template does not extend the ids so far (an earlier response did not round-trip through its text)."""
        turns = self.prompt["turns"]
        stop = None
        if turn >= len(turns):
            stop = "no_more_turns"
        elif self.prompt["source"] == "dataset" and turn >= len(self.prompt["reference"] or []):
            stop = "no_more_turns" if turn else "no_assistant_turns"
        elif not self.finished:
            stop = "unfinished_response"
        if stop is None:
            text = turns[turn].strip() if turn else self.prompt["text"]
            messages = self.messages + [{"role": "user", "content": text}]
            try:
                ids = chat_ids(tokenizer, messages, True)
            except jinja2.TemplateError as e:  # e.g. gpt-oss's refuses an earlier answer with its channel tags in it
                log.debug("the chat template refused conversation %s at turn %d: %s", self.prompt["id"], turn, e)
                ids, stop = [], "template_refused"
            if stop is None:
                if turn and len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_prompt:
                    stop = "overlong_turn"
                elif len(ids) > room:
                    stop = "context_full"
                elif ids[:len(self.input_ids)] != self.input_ids:  # also a template that drops earlier thinking
                    if self.split_rewritten:  # this row ends; the next starts from the template's own rendering
                        self.rows.append(self.record())
                        self.input_ids, self.loss_mask, self.response_tokens, self.row_start = [], [], 0, turn
                    else:
                        stop = "roundtrip_mismatch"
        if stop is not None:
            self.open, self.stop_reason = False, stop
            return None
        self.next_ids = ids
        return messages

    def add_turn(self, messages: List[dict], response: List[int], tokenizer, eos: Sequence[int],
                 thinking: Optional[Thinking] = None) -> None:
        """Append one assistant turn: `response` ids (EOS-terminated if finished) after the context's ids. The loss
        mask is 1 on the response, but for its thinking spans when `thinking` (data.loss_on_thinking=false) is given."""
        ids = self.next_ids
        self.finished = bool(response) and response[-1] in eos
        text = tokenizer.decode(response[:-1] if self.finished else response)
        self.messages = messages + [assistant_message(text)]
        trained = thinking_mask(response, thinking) if thinking else [1] * len(response)
        self.loss_mask = self.loss_mask + [0] * (len(ids) - len(self.input_ids)) + trained
        self.response_tokens += len(response)
        self.input_ids = ids + response

    def record(self) -> dict:
        """This row (the last one of the conversation: `records` gives them all). A row that starts at turn t > 0 is
        id "<conversation id>/turn<t>"."""
        n_response = self.response_tokens
        return {
            "id": self.prompt["id"] + (f"{ROW_SEPARATOR}{self.row_start}" if self.row_start else ""),
            "messages": self.messages, "input_ids": self.input_ids, "loss_mask": self.loss_mask,
            "num_prompt_tokens": len(self.input_ids) - n_response, "num_response_tokens": n_response,
            "num_turns": sum(m["role"] == "assistant" for m in self.messages), "finished": self.finished,
            "prompt_truncated": self.prompt["truncated"], "source": self.prompt["source"],
        }

    def records(self) -> List[dict]:
        """Every row of the conversation: one, or one more per rewritten history (data.rewritten_history=split)."""
        return self.rows + [self.record()]


ROW_SEPARATOR = "/turn"  # a conversation's later rows: "<id>/turn<t>" (data.rewritten_history=split)


def conversation_id(row_id: str) -> str:
    return row_id.split(ROW_SEPARATOR)[0]


def reference_response(tokenizer, messages: List[dict], answer: str, context: List[int],
                       eos: Sequence[int]) -> Optional[List[int]]:
    """The dataset's own assistant turn as the template lays it out after `context`, through its closing EOS
    (None if the template does not extend the context or closes the turn with no EOS)."""
    full = chat_ids(tokenizer, messages + [assistant_message(answer)], False)
    if full[:len(context)] != context:
        return None
    tail = full[len(context):]
    end = next((j for j, t in enumerate(tail) if t in eos), None)
    return None if end is None or end == 0 else tail[:end + 1]


def untrained_thinking(d: DictConfig, tokenizer) -> Optional[Thinking]:
    """The thinking markers whose spans leave the loss (data.loss_on_thinking=false), else None."""
    if d.loss_on_thinking:
        return None
    thinking = thinking_format(tokenizer)
    if thinking is None:
        raise SpecdrafterError("recipe key 'data.loss_on_thinking' is false, but the target's tokenizer has no "
                               "thinking markers (<think> … </think>, or gpt-oss's analysis channel): nothing to mask")
    return thinking


def build_conversations(prompts: List[dict], engine, tokenizer, eos: Sequence[int], d: DictConfig, seed: int,
                        max_prompt: int, room: int, counts: Dict[str, int],
                        on_turn: Optional[Callable[[int, int], None]] = None) -> List[dict]:
    """Up to `data.max_turns` assistant turns per conversation, turn by turn over the whole shard (one batched
    engine call per turn): the target answers given its own earlier answers, or — source "dataset" — the
    conversation's own answers are laid out by the chat template. Returns one record per conversation with at
    least one assistant turn; why conversations ended (or were skipped) is added to `counts`."""
    split = d.rewritten_history.value == "split"
    conversations = [Conversation(p, split_rewritten=split) for p in prompts]
    thinking = untrained_thinking(d, tokenizer)
    for turn in range(d.max_turns):
        todo = [(c, c.context(tokenizer, turn, max_prompt, room)) for c in conversations if c.open]
        todo = [(c, m) for c, m in todo if m is not None]
        if not todo:
            break
        regenerate = [(c, m) for c, m in todo if c.prompt["source"] == "target"]
        generated = 0
        if regenerate:
            responses = engine.respond([m for _, m in regenerate], d.max_new_tokens, d.temperature, d.top_p,
                                       seed * 1_000 + turn)
            for (c, m), response in zip(regenerate, responses):
                if not response:
                    c.open, c.stop_reason = False, "empty_response"
                    continue
                c.add_turn(m, response, tokenizer, eos, thinking)
                generated += len(response)
        for c, m in todo:
            if c.prompt["source"] == "dataset":
                answer = (c.prompt["reference"] or [])[turn]
                response = reference_response(tokenizer, m, answer, c.next_ids, eos) if answer and answer.strip() else None
                if response is None:
                    c.open, c.stop_reason = False, "unusable_reference"
                    continue
                c.add_turn(m, response[:d.max_new_tokens], tokenizer, eos, thinking)
        if on_turn is not None:
            on_turn(len(todo), generated)
    for c in conversations:
        if c.open and c.messages:
            c.stop_reason = "max_turns"
        counts[c.stop_reason or "max_turns"] = counts.get(c.stop_reason or "max_turns", 0) + 1
    skipped = sum(not c.messages for c in conversations)
    counts["skipped_without_turns"] = counts.get("skipped_without_turns", 0) + skipped
    rewritten = sum(len(c.rows) for c in conversations)
    if rewritten:
        counts["rows_from_rewritten_history"] = counts.get("rows_from_rewritten_history", 0) + rewritten
    return [r for c in conversations if c.messages for r in c.records()]

