"""Regeneration through serving engines (`data.engine: server`): the target's answers come from OpenAI-compatible
chat-completions servers (vLLM, SGLang, llama.cpp's llama-server, `transformers serve`) instead of `model.generate`
in this process.

`ServerEngine.probe` runs once before the job and refuses servers that would write wrong data: none reachable,
a served model whose tokenizer or chat template is not the target's, or a server that answers greedily when asked
to sample. `ServerEngine.respond` then sends one request per conversation, `concurrency` in flight over all
servers, retries failures with exponential backoff and drops a server that keeps failing.

Request fields, per engine (the probe tries them in this order and keeps what each server accepts; llama-server is
recognised by its /v1/models, which says `"owned_by": "llamacpp"`, and gets its own fields only):

    token ids   vLLM, SGLang        "return_token_ids": true        -> choices[0].token_ids
                older vLLM          "logprobs": true, "return_tokens_as_token_ids": true
                                                                    -> choices[0].logprobs.content[i].token "token_id:N"
                llama-server        "return_tokens": true, "verbose": true
                                                                    -> __verbose.tokens (the sampled ids, EOS included)
                transformers serve  none (it answers 422 to unknown fields): the text is re-tokenised here
    prompt ids  llama-server        POST /apply-template, then /tokenize (add_special, parse_special): the ids its
                                    chat path feeds the model, compared with the target's chat template
    sampling    vLLM, SGLang        "top_k": -1, "min_p": 0, "repetition_penalty": 1
                llama-server        "samplers": ["temperature", "top_p"], "top_k": 0, "min_p": 0, "typical_p": 1,
                                    "repeat_penalty": 1, "reasoning_format": "none"
                transformers serve  "generation_config": "{\"do_sample\": true, \"top_k\": 0}"
    always      "model" (the id /v1/models reports), "messages", "max_tokens", "temperature", "top_p", "seed"
    template    all four        "chat_template_kwargs" when target.chat_template_kwargs sets any (vLLM, SGLang and
                                llama-server render their chat template with them; the probe compares the prompt ids)

llama-server's own sampling chain is penalties, DRY, top-n-sigma, top-k 40, typical, top-p, min-p 0.05, XTC,
temperature: top-p cut before the temperature, and min-p and top-k 40 on top. Its `samplers` field replaces the
chain, so the two listed are all it runs, in the in-process engine's order (softmax(logits / T), then the top-p
nucleus, then a draw); T = 0 is its greedy argmax. Its `__verbose.tokens` are the ids it sampled, so nothing is
re-tokenised; `reasoning_format: none` keeps a reply's text as generated (llama-server would otherwise move a
`<think>` block out of `content`, and the probe compares the text with the ids). It stops on EOS (returned as the
last id) or max_tokens; no stop strings are sent. A reply longer than a slot's context (`-c` / `--parallel`) is cut
there and reported as "length".

`transformers serve` runs one request at a time (its --continuous-batching batches, but keeps the first request's
sampling settings for every later one: the probe refuses it), seeds torch's global generator as each request
arrives (reruns reproduce at concurrency 1 only), and reports "length" for a reply whose EOS is the last token
allowed, which then comes back without its EOS. Re-tokenised text need not give back the sampled ids: the last word
of a reply cut at max_new_tokens often re-tokenises differently (a token more in 3 of 18 sampled SmolLM2 replies
cut at 32 tokens); such replies are counted (retokenised_length_mismatch) and cut to max_new_tokens.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Dict, List, Optional

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import server_url_problem

log = logging.getLogger("specdrafter")

TOKEN_ID_FIELDS = {"token_ids": {"return_token_ids": True},
                   "logprobs": {"logprobs": True, "return_tokens_as_token_ids": True}}
# vLLM and SGLang fill the sampling fields a request leaves out from the model's generation_config.json (a top_k of
# 20, a repetition penalty, ...); the in-process engine samples with temperature and top-p alone, so say so.
PLAIN_SAMPLING = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
LLAMA_SERVER = "llama-server"  # Server.engine of a server whose /v1/models says it is owned by "llamacpp"
# llama-server keeps the ids it sampled when asked (return_tokens) and returns them from the chat endpoint only in its
# debugging field __verbose (the OpenAI-shaped reply has no place for them).
LLAMA_SERVER_TOKEN_IDS = {"tokens": {"return_tokens": True, "verbose": True}}
# Sent to llama-server with every request (module docstring): the chain reduced to temperature then top-p, the other
# samplers' knobs at their "off" values as well, so that a server ignoring `samplers` still samples nearly plainly.
LLAMA_SERVER_FIELDS = {"samplers": ["temperature", "top_p"], "top_k": 0, "min_p": 0.0, "typical_p": 1.0,
                       "repeat_penalty": 1.0, "reasoning_format": "none"}
# `transformers serve` starts from the model's generation config, whose do_sample is usually False, and then answers
# greedily at any temperature; this field replaces that config (top_k=0: no top-k cut, as above).
TRANSFORMERS_SAMPLING = {"generation_config": json.dumps({"do_sample": True, "top_k": 0})}
# Accents, CJK, Cyrillic, digits, code, emoji and odd whitespace: two different tokenizers (or chat templates)
# practically never give this prompt the same number of tokens.
PROBE_MESSAGES = [{"role": "user", "content": "Answer in one short sentence. Tokenizer check: naïve café, Grüße "
                                              "aus Köln, 東京タワー, Привет, 3.14159 × 2 = 6.28318, `for (i = 0; "
                                              "i < n; ++i)`, 🙂🚀, tabs\tand  double  spaces."}]
SAMPLING_MESSAGES = [{"role": "user", "content": "Write the first line of a story about an unusual animal."}]
SAMPLING_REQUESTS, SAMPLING_TOKENS = 3, 12
PROBE_TOKENS = 16
BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0


class RequestRejected(Exception):
    """The server refused the request itself (HTTP 4xx): retrying it, here or elsewhere, would not help."""


class RequestFailed(Exception):
    """No usable answer (connection, timeout, 5xx, malformed JSON): worth retrying."""


@dataclass
class Reply:
    content: str
    finish_reason: Optional[str]
    token_ids: Optional[List[int]]  # the completion's ids, when the server returns them
    prompt_token_ids: Optional[List[int]]
    prompt_tokens: Optional[int]  # usage
    completion_tokens: Optional[int]


@dataclass
class Server:
    url: str  # base URL, without /v1
    model: str = ""  # the id its /v1/models reports, sent as "model"
    engine: str = "openai"  # LLAMA_SERVER, or any other OpenAI-compatible server
    fields: Dict[str, object] = field(default_factory=dict)  # extra request fields the probe settled on
    token_ids: Optional[str] = None  # a key of TOKEN_ID_FIELDS / LLAMA_SERVER_TOKEN_IDS; None = re-tokenised here
    failures: int = 0  # in a row
    in_flight: int = 0
    dropped: bool = False
    last_error: str = ""


def http_json(url: str, body: Optional[dict], timeout: float) -> dict:
    """GET (body None) or POST a JSON body; the decoded JSON answer. Raises RequestRejected / RequestFailed."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as e:
        detail = " ".join(e.read().decode(errors="replace").split())[:300]
        if 400 <= e.code < 500 and e.code not in (408, 429):
            raise RequestRejected(f"HTTP {e.code}: {detail}") from None
        raise RequestFailed(f"HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise RequestFailed(str(e.reason)) from None
    except (OSError, HTTPException, ValueError) as e:  # timeouts, dropped connections, invalid JSON
        raise RequestFailed(f"{type(e).__name__}: {e}") from None


def parse_reply(payload: dict) -> Reply:
    try:
        choice = payload["choices"][0]
        content = choice["message"].get("content") or ""
        ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("content")
        if ids is None and logprobs is not None and all(t["token"].startswith("token_id:") for t in logprobs):
            ids = [int(t["token"][len("token_id:"):]) for t in logprobs]
        verbose = payload.get("__verbose")  # llama-server, asked with LLAMA_SERVER_TOKEN_IDS
        if ids is None and isinstance(verbose, dict) and isinstance(verbose.get("tokens"), list) \
                and (verbose["tokens"] or not content):  # [] beside text: return_tokens was not honoured
            ids = [int(t) for t in verbose["tokens"]]
        usage = payload.get("usage") or {}
        return Reply(content, choice.get("finish_reason"), ids,
                     payload.get("prompt_token_ids") or choice.get("prompt_token_ids"),
                     usage.get("prompt_tokens"), usage.get("completion_tokens"))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        raise RequestFailed(f"malformed chat completion ({type(e).__name__}: {e})") from None


def complete_text(reply: Reply) -> str:
    """The reply's text without a character that the length limit cut in half (it decodes to U+FFFD)."""
    return reply.content.rstrip("\ufffd") if reply.finish_reason == "length" else reply.content


class ServerEngine:
    """The target's next assistant turns from OpenAI-compatible servers, as token ids (see the module docstring)."""

    def __init__(self, servers: List[str], concurrency: int, tokenizer, *, timeout_s: float = 600, retries: int = 4):
        if not servers:
            raise SpecdrafterError("no server URLs given (data.servers)")
        for url in servers:
            problem = server_url_problem(url)
            if problem:
                raise SpecdrafterError(f"server {url!r} {problem}")
        if tokenizer.eos_token_id is None:
            raise SpecdrafterError(f"the target's tokenizer ({tokenizer.name_or_path}) has no EOS token to close "
                                   "replies with")
        self.servers = [Server(url.rstrip("/").removesuffix("/v1")) for url in servers]
        self.concurrency, self.tokenizer, self.timeout_s, self.retries = concurrency, tokenizer, timeout_s, retries
        self.special_ids = set(tokenizer.all_special_ids)
        kwargs = getattr(tokenizer, "chat_template_kwargs", None)  # target.chat_template_kwargs (data/chat.py)
        self.template_fields = {"chat_template_kwargs": dict(kwargs)} if kwargs else {}
        # HTTP requests sent by respond(), retries among them, failed ones, conversations a server rejected (4xx),
        # empty replies, conversations skipped ([] returned), servers dropped (probe or respond), replies whose ids
        # came from the server / were re-tokenised, re-tokenised replies whose length is not the server's count,
        # and the completion tokens returned
        self.counters: Dict[str, int] = dict(requests=0, retries=0, failures=0, rejected=0, empty=0, skipped=0,
                                             servers_dropped=0, token_ids_from_server=0, token_ids_retokenised=0,
                                             retokenised_length_mismatch=0, completion_tokens=0)
        self._lock = threading.Lock()  # the server pool and the counters
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer must not be entered by two threads at once
        self._turn = 0  # rotates ties between equally busy servers
        self._probed = False

    # ------------------------------------------------------------------------------------------------ probe
    def probe(self, temperature: float, top_p: float) -> dict:
        """Check every server before a run, at the run's temperature (sampling is checked when it is > 0, at top-p
        1 whatever `top_p` is; see `_choose_sampling`). Unreachable servers are dropped; anything else wrong is
        refused in one line. Returns what stats.json should record about the servers."""
        for s in self.servers:
            try:
                s.model = self._served_model(s)
            except (RequestFailed, RequestRejected) as e:
                self._drop(s, f"unreachable ({e})")
        live = [s for s in self.servers if not s.dropped]
        if not live:
            raise SpecdrafterError("no server reachable: " +
                                   "; ".join(f"{s.url}: {s.last_error}" for s in self.servers))
        facts = []
        for s in live:
            self._choose_token_ids(s)
            plain_samples = self._choose_sampling(s, temperature) if temperature > 0 else None
            facts.append({"url": s.url, "model": s.model, "engine": s.engine,
                          "token_ids_from_server": s.token_ids is not None, "extra_fields": dict(s.fields),
                          "plain_requests_sample": plain_samples})
        self._probed = True
        return {"engine": "server", "servers": facts, "servers_unreachable": [s.url for s in self.servers if s.dropped]}

    def _served_model(self, s: Server) -> str:
        """The model id to request: the server's only model, or the one named like the target's tokenizer."""
        answer = self._retrying(lambda: http_json(f"{s.url}/v1/models", None, min(self.timeout_s, 30)))
        try:
            ids = [m["id"] for m in answer["data"]]
            owners = {m["id"]: m.get("owned_by") for m in answer["data"]}
        except (KeyError, TypeError, AttributeError) as e:
            raise RequestFailed(f"/v1/models answered without model ids ({type(e).__name__})") from None
        target = str(self.tokenizer.name_or_path).rstrip("/").rsplit("/", 1)[-1].lower()
        # llama-server names a model by its file, e.g. /models/SmolLM2-135M-Instruct.gguf
        named = [m for m in ids if m.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix(".gguf") == target]
        if len(ids) == 1 or len(named) == 1:
            chosen = ids[0] if len(ids) == 1 else named[0]
            s.engine = LLAMA_SERVER if owners[chosen] == "llamacpp" else "openai"
            if chosen not in named:  # the tokenizer check below decides; a different name alone proves nothing
                log.warning(f"{s.url} serves {chosen!r}, the target's tokenizer is {self.tokenizer.name_or_path!r}")
            return chosen
        raise SpecdrafterError(f"{s.url} serves {len(ids)} models ({', '.join(ids[:5])}), none of them named like the "
                               f"target ({target}); start it with the target only")

    def _retrying(self, call):
        """`call()` with up to `retries` retries on RequestFailed, backing off exponentially."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except RequestFailed:
                if attempt == self.retries:
                    raise
                time.sleep(min(BACKOFF_S * 2 ** attempt, MAX_BACKOFF_S))

    def _probe_request(self, s: Server, messages: List[dict], max_tokens: int, fields: dict, temperature: float,
                       seed: int) -> Reply:
        body = {"model": s.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": 1.0, "seed": seed, **self.template_fields, **fields}
        try:
            return self._retrying(lambda: parse_reply(http_json(f"{s.url}/v1/chat/completions", body, self.timeout_s)))
        except RequestFailed as e:
            raise SpecdrafterError(f"{s.url} did not answer the probe requests: {e}") from None

    def _choose_token_ids(self, s: Server) -> None:
        """Ask for a short greedy reply with each way of getting token ids until one works (or none does: the text
        will be re-tokenised), then check the reply against the target's tokenizer and chat template. A llama-server
        is asked its own way only, with LLAMA_SERVER_FIELDS in every request, at T = 0 too (one request shape at
        every temperature; at T = 0 its temperature sampler keeps the argmax alone)."""
        llama = s.engine == LLAMA_SERVER
        base = LLAMA_SERVER_FIELDS if llama else {}
        for how, fields in [*(LLAMA_SERVER_TOKEN_IDS if llama else TOKEN_ID_FIELDS).items(), (None, {})]:
            fields = {**fields, **base}
            try:
                reply = self._probe_request(s, PROBE_MESSAGES, PROBE_TOKENS, fields, 0.0, 0)
            except RequestRejected as e:
                rejection = e
                continue
            if how is None or reply.token_ids is not None:
                s.token_ids, s.fields = how, dict(fields)
                break
        else:
            raise SpecdrafterError(f"{s.url} refused a plain chat-completions request for {s.model!r}: {rejection}")
        if llama and reply.prompt_token_ids is None:
            reply.prompt_token_ids = self._llama_server_prompt_ids(s, PROBE_MESSAGES)
        problem = self._tokenizer_problem(reply)
        if problem:
            raise SpecdrafterError(f"{s.url} serves {s.model!r}, whose tokenizer or chat template is not the target's "
                                   f"({self.tokenizer.name_or_path}): {problem}")

    def _llama_server_prompt_ids(self, s: Server, messages: List[dict]) -> Optional[List[int]]:
        """The ids llama-server's chat endpoint feeds its model for `messages`: its chat template applied
        (/apply-template), then tokenised as that endpoint does (special tokens added and parsed). None if either
        endpoint fails: the prompt's length (usage) is then all the probe compares."""
        timeout = min(self.timeout_s, 30)
        try:
            prompt = self._retrying(lambda: http_json(f"{s.url}/apply-template", {"messages": messages, **self.template_fields},
                                                      timeout))["prompt"]
            ids = self._retrying(lambda: http_json(f"{s.url}/tokenize", {"content": prompt, "add_special": True,
                                                                         "parse_special": True}, timeout))["tokens"]
            return [int(t) for t in ids]
        except (RequestFailed, RequestRejected, KeyError, TypeError, ValueError) as e:
            log.warning(f"{s.url}: llama-server's prompt ids unavailable ({type(e).__name__}: {e}); comparing the "
                        "probe prompt's length only")
            return None

    def _tokenizer_problem(self, reply: Reply) -> Optional[str]:
        """Why the probe reply shows a tokenizer or chat template other than the target's (None if it does not)."""
        prompt_ids = self.tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]
        if reply.prompt_token_ids is not None and list(reply.prompt_token_ids) != prompt_ids:
            return "the server's prompt token ids differ from the target's chat template"
        if reply.prompt_tokens is not None and reply.prompt_tokens != len(prompt_ids):
            return f"the probe prompt is {reply.prompt_tokens} tokens there and {len(prompt_ids)} here"
        ids = self._reply_ids(reply)
        body = self._content(ids)
        if any(not 0 <= t < len(self.tokenizer) for t in body):
            return f"token id {max(body)} is outside the target's vocabulary of {len(self.tokenizer)}"
        if self.tokenizer.decode(body, skip_special_tokens=True) != complete_text(reply):
            return "the reply's tokens do not decode to its text"
        if reply.token_ids is None:  # the run will re-tokenise: the ids must be the ones the server generated
            # (compared when the reply ended on its own: the last word of a cut one can re-tokenise differently)
            if reply.finish_reason == "stop" and reply.completion_tokens not in (None, len(ids)):
                return f"the reply has {reply.completion_tokens} tokens there and {len(ids)} re-tokenised here"
            laid_out = self.tokenizer.apply_chat_template(
                PROBE_MESSAGES + [{"role": "assistant", "content": complete_text(reply)}], tokenize=True,
                return_dict=True)["input_ids"]
            if laid_out[:len(prompt_ids) + len(body)] != prompt_ids + body:
                return "the chat template does not lay the re-tokenised reply out as those tokens"
        return None

    def _choose_sampling(self, s: Server, temperature: float) -> Optional[bool]:
        """Find request fields with which `s` really samples. Returns whether it samples without extra fields (None
        for a llama-server, which is only ever asked with its own, LLAMA_SERVER_FIELDS).

        A few requests with different seeds must not all return the same text. They run at temperature >= 1 with
        top_p 1: the question is whether the server samples at all, and at a low temperature a large model could
        legitimately repeat itself."""
        base = dict(s.fields)
        temperature = max(temperature, 1.0)
        plain_samples = None
        llama = s.engine == LLAMA_SERVER  # its fields are in `base` already; they are its only way to sample plainly
        for extra in ({},) if llama else (PLAIN_SAMPLING, {}, TRANSFORMERS_SAMPLING):
            fields = {**base, **extra}
            try:
                texts = {self._probe_request(s, SAMPLING_MESSAGES, SAMPLING_TOKENS, fields, temperature, seed).content
                         for seed in range(SAMPLING_REQUESTS)}
            except RequestRejected:
                continue
            if extra is not TRANSFORMERS_SAMPLING and not llama:
                plain_samples = len(texts) > 1
            if len(texts) > 1:
                s.fields = fields
                return None if llama else bool(plain_samples)
        if llama:
            raise SpecdrafterError(f"{s.url} (llama-server) ignores the sampling settings: {SAMPLING_REQUESTS} "
                                   f"requests at temperature {temperature} with {LLAMA_SERVER_FIELDS['samplers']} "
                                   "returned the same text")
        raise SpecdrafterError(f"{s.url} ignores the sampling settings: {SAMPLING_REQUESTS} requests at temperature "
                               f"{temperature} returned the same text, also with {TRANSFORMERS_SAMPLING}; with "
                               "`transformers serve`, drop --continuous-batching (it keeps the first request's "
                               "settings)")

    # ---------------------------------------------------------------------------------------------- respond
    def respond(self, messages: List[List[dict]], max_new_tokens: int, temperature: float, top_p: float,
                seed: int) -> List[List[int]]:
        """The target's next assistant turn for each conversation (a list of {role, content} ending with a user
        turn): at most max_new_tokens token ids, closed by the EOS id when the server stopped on its own.

        Conversation i is sent with seed + i. A conversation whose replies stay empty, keep failing or that a
        server rejects is skipped (counted) and gets []. Raises SpecdrafterError once every server is dropped."""
        if not self._probed:
            raise RuntimeError("ServerEngine.probe() must run before respond()")
        if not messages:
            return []
        pool = ThreadPoolExecutor(min(self.concurrency, len(messages)), thread_name_prefix="specdrafter-server")
        try:
            futures = [pool.submit(self._respond_one, i, conversation, max_new_tokens, temperature, top_p, seed,
                                   len(messages)) for i, conversation in enumerate(messages)]
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _respond_one(self, i: int, conversation: List[dict], max_new_tokens: int, temperature: float, top_p: float,
                     seed: int, num_conversations: int) -> List[int]:
        body = {"messages": conversation, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "seed": seed + i, **self.template_fields}
        avoid, error = None, None
        for attempt in range(self.retries + 1):
            s = self._pick(avoid)
            if attempt:
                self._count("retries")
            try:
                reply = parse_reply(http_json(f"{s.url}/v1/chat/completions",
                                              {"model": s.model, **body, **s.fields}, self.timeout_s))
            except RequestRejected as e:
                self._release(s, None)
                self._count("rejected")
                log.warning(f"{s.url} rejected conversation {i}, skipped: {e}")
                error = None
                break
            except RequestFailed as e:
                self._release(s, str(e))
                avoid, error = s, f"{s.url}: {e}"
                if not s.dropped:  # a dropped server's requests go to the others at once
                    time.sleep(min(BACKOFF_S * 2 ** attempt, MAX_BACKOFF_S) * random.uniform(0.5, 1.0))
                continue
            self._release(s, None)
            ids = self._reply_ids(reply)
            if reply.token_ids is not None:
                self._count("token_ids_from_server")
            else:  # re-tokenised text need not give back the ids that were sampled (a non-canonical split)
                self._count("token_ids_retokenised")
                self._count("retokenised_length_mismatch", int(reply.completion_tokens not in (None, len(ids))))
            if self._content(ids):
                ids = ids[:max_new_tokens]  # as many as the in-process engine could return, at most
                self._count("completion_tokens", len(ids))
                return ids
            self._count("empty")
            error = None
            body["seed"] = seed + i + (attempt + 1) * num_conversations  # a seed no first attempt uses: a new draw
        self._live_servers()  # raises if the failures above dropped the last server
        if error:
            log.warning(f"conversation {i} skipped after {self.retries + 1} attempts; the last failed on {error}")
        self._count("skipped")
        return []

    def _reply_ids(self, reply: Reply) -> List[int]:
        """The reply's ids, closed by EOS when the server stopped on its own (vLLM and SGLang return the EOS they
        stopped on; re-tokenised text has none)."""
        if reply.token_ids is not None:
            ids = list(reply.token_ids)
        else:
            with self._tokenizer_lock:
                ids = self.tokenizer(complete_text(reply), add_special_tokens=False)["input_ids"]
        if reply.finish_reason == "stop" and not (ids and ids[-1] in self.special_ids):
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def _content(self, ids: List[int]) -> List[int]:
        """`ids` without the special token that closes them."""
        return ids[:-1] if ids and ids[-1] in self.special_ids else ids

    # ----------------------------------------------------------------------------------------- server pool
    def _live_servers(self) -> List[Server]:
        live = [s for s in self.servers if not s.dropped]
        if not live:
            raise SpecdrafterError("every server failed: " +
                                   "; ".join(f"{s.url}: {s.last_error}" for s in self.servers))
        return live

    def _pick(self, avoid: Optional[Server]) -> Server:
        """A live server with the fewest requests in flight, ties taken in turn; not `avoid` (the one this request
        just failed on) while another is live. A failing server keeps getting requests until it is dropped."""
        with self._lock:
            live = self._live_servers()
            choices = [s for s in live if s is not avoid] or live
            self._turn += 1
            s = min(choices, key=lambda s: (s.in_flight, (self.servers.index(s) - self._turn) % len(self.servers)))
            s.in_flight += 1
            self.counters["requests"] += 1
            return s

    def _release(self, s: Server, error: Optional[str]) -> None:
        with self._lock:
            s.in_flight -= 1
            if error is None:
                s.failures = 0
                return
            s.failures += 1
            s.last_error = error
            self.counters["failures"] += 1
            if s.failures > self.retries and not s.dropped:
                self._drop(s, f"{s.failures} failures in a row, the last: {error}")

    def _drop(self, s: Server, why: str) -> None:
        s.dropped, s.last_error = True, why
        self.counters["servers_dropped"] += 1
        log.warning(f"dropping server {s.url}: {why}")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n
