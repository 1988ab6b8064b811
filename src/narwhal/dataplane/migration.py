"""Migration (DESIGN §1): a stream whose decode fails after part of the answer reached the
client goes on, from the same token, on a fresh prefill/decode pair.

`Splice` follows one client stream across the legs that produce it. It is pure (no I/O, no
clock): the proxy feeds it each leg's bytes and sends the client what it returns.

- Only whole SSE events are relayed, so a leg that dies mid-event leaves nothing half-sent.
- Each event says what was delivered: the prompt's token ids (the first event) and each
  chunk's `token_ids`, which vLLM adds when a request says `"return_token_ids": true`; or,
  from llama.cpp's `llama-server`, each token's `id` in its `logprobs` (asked for with one
  top logprob), with the prompt given again as the engine renders it; and the text, for
  engines that give no ids.
- The client sees only what it asked for (no ids unless it asked), and a continuation looks
  like the first leg: the same `id`, `created` and `model`, chat deltas from a completion
  continuation, and `usage` that counts the original prompt and every token once.
- An in-band error event or a malformed one, and what follows it, is not relayed: the
  stream goes on elsewhere.
- `continuation()` builds the next leg's request: the prompt's token ids followed by the
  delivered ones, `max_tokens` and `min_tokens` less what was delivered, every sampling
  parameter kept (a `seed` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.engine.adapter import BY_LOGPROBS, BY_RETURN_TOKEN_IDS, Endpoint

TOKEN_IDS, TEXT = "token_ids", "text"
# vLLM's `max_tokens` for /v1/completions when the request gives none. Chat has no fixed
# default (the model's context bounds it), so a chat continuation leaves it unset too.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Fields of a chat request that a raw completion over its rendered prompt does not take.
_CHAT_ONLY = frozenset(
    {
        "messages",
        "max_completion_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "logprobs",
        "top_logprobs",
        "echo",
        "mm_processor_kwargs",
    }
)
# Output that a grammar or a tool parser shapes from its first token: a continuation would
# restart that state mid-answer, so such requests are not migrated.
_CONSTRAINED = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tools",
    "functions",
)


def migratable(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Whether a streamed request can be continued elsewhere if its decode fails. Not a
    completion that echoes its prompt: the echo's text and ids are the prompt's, in the
    stream as if generated, so what was delivered would be miscounted."""
    if any(body.get(key) for key in _CONSTRAINED):
        return False
    if endpoint == "completions":
        if body.get("echo"):
            return False
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return len(prompt) == 1  # one prompt in a list (of text or of token ids)
    return True


@dataclass(frozen=True, slots=True)
class Continuation:
    """The next leg's request: sent to `endpoint` (a chat is continued as a completion over
    token ids, or as a chat when only text is known)."""

    endpoint: Endpoint
    body: dict[str, Any]
    kind: str  # TOKEN_IDS or TEXT


def _payload(raw: bytes) -> bytes | None:
    """An event's data (its `data:` lines joined), or None when it has none."""
    if raw.startswith(b"data: ") and b"\n" not in raw:
        return raw[6:].rstrip()
    data = []
    for line in raw.split(b"\n"):
        line = line.rstrip()
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's usage object, in vLLM's key order."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}  # fmt: skip


class Splice:
    """One client stream across its legs; see the module's docstring."""

    def __init__(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        include_usage: bool,
        ids_by: str = BY_RETURN_TOKEN_IDS,
    ) -> None:
        self.endpoint = endpoint
        self._body = body  # the client's request
        self._chat = endpoint == "chat"
        self._by_logprobs = ids_by == BY_LOGPROBS
        self._client_ids = not self._by_logprobs and body.get("return_token_ids") is True
        # llama.cpp: logprobs the client asked for stay (a completion's `logprobs: 0` gives
        # none there); the ones asked for the ids are taken out again.
        self._client_logprobs = bool(body.get("logprobs"))
        self._include_usage = include_usage
        self.opened = False  # the client has the stream's head (the proxy sets it)
        self.migrations = 0
        self.last_sent_s = 0.0  # perf_counter of the last bytes the client was sent
        self.interrupted_s: float | None = None  # last_sent_s when a leg failed
        self._head: dict[str, Any] | None = None  # the first leg's id, created and model
        self._prompt_ids: list[int] | None = None
        self._ids: list[int] = []
        self._ids_whole = True  # every token so far came with its id
        self._text: list[str] = []
        self._tokens = 0  # completion tokens delivered
        self._leg: Continuation | None = None  # the current leg, when it is a continuation
        self._tokens_before_leg = 0
        self._chars_before_leg = 0  # the text delivered before the current leg
        self._usage_sent = False
        self._tail = b""
        self._cr = False
        self.finished = False  # a choice carried its finish_reason
        self.errored = False  # the current leg sent an in-band error event
        self.broken = False  # the current leg sent a malformed event
        self.done = False  # `[DONE]` went to the client

    def first_body(self) -> dict[str, Any]:
        """The first leg's request: the client's, asking for token ids."""
        if self._by_logprobs:
            return self._body if self._client_logprobs else _with_logprobs(self._body, self._chat)
        return self._body if self._client_ids else {**self._body, "return_token_ids": True}

    @property
    def body(self) -> dict[str, Any]:
        """The client's request."""
        return self._body

    @property
    def needs_rendered_prompt(self) -> bool:
        """A chat continued where the engine gives no prompt ids: `continuation` needs the
        prompt as the engine's chat template renders it."""
        return self._chat and self._by_logprobs

    def start_leg(self, leg: Continuation) -> None:
        """The next events come from `leg`."""
        self._leg = leg
        self._tokens_before_leg = self._tokens
        self._chars_before_leg = sum(map(len, self._text))
        self._tail = b""
        self._cr = False
        self.errored = False
        self.broken = False

    # ------------------------------------------------------------------ events
    def relay(self, chunk: bytes) -> bytes:
        """The client's part of a leg's bytes: its whole events, rewritten."""
        if self._cr and chunk:  # the last chunk ended in CR: a LF starting this one pairs
            self._cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        data = self._tail + chunk
        if b"\r" in data:
            self._cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n\n" not in data:
            self._tail = data
            return b""
        *events, self._tail = data.split(b"\n\n")
        out = []
        for raw in events:
            if self.errored or self.broken or self.done:
                break
            payload = _payload(raw.lstrip(b"\n"))
            if payload is None:
                continue
            if payload == b"[DONE]":
                self.done = True
                out.append(b"data: [DONE]\n\n")
                continue
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                self.broken = True  # malformed: nothing after it is relayed; the leg failed
                break
            if "error" in event and "choices" not in event:
                self.errored = True  # the proxy charges the engine and continues elsewhere
                break
            rewritten = self._rewrite(event)
            if rewritten is not None:
                out.append(b"data: " + orjson.dumps(rewritten) + b"\n\n")
        return b"".join(out)

    def _rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        leg = self._leg
        if leg is None:
            if self._head is None:
                self._head = {k: event.get(k) for k in ("id", "created", "model")}
            ids = event.get("prompt_token_ids")
            if self._chat and isinstance(ids, list):
                self._prompt_ids = ids
            if not self._client_ids:
                event.pop("prompt_token_ids", None)
        else:
            event.update(self._head or {})
            event.pop("prompt_token_ids", None)
            if self._chat and leg.endpoint == "completions":
                event["object"] = "chat.completion.chunk"
        choices = event.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = self._choice(choices[0])
            if choice is None:
                return None
            choices[0] = choice
        usage = event.get("usage")
        if isinstance(usage, dict):
            if leg is not None:
                event["usage"] = self._usage(usage)
            if not choices:
                self._usage_sent = True
        return event

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """Learn what a choice delivers; reshape it for the client (None: drop the event)."""
        leg = self._leg
        if leg is None:
            ids = choice.get("prompt_token_ids")
            if not self._chat and isinstance(ids, list):
                self._prompt_ids = ids
        if self._chat and leg is not None and leg.endpoint == "completions":
            text = choice.pop("text", "")
            choice = {"index": choice.pop("index", 0), "delta": {"content": text}, **choice}
        elif self._chat:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
            if leg is not None and isinstance(delta, dict) and "role" in delta and not text:
                return None  # the continuation's own role event: the client had one
        else:
            text = choice.get("text")
        token_ids = _logprob_ids(choice) if self._by_logprobs else choice.get("token_ids")
        if self._by_logprobs:  # logprobs the client did not ask for, as llama.cpp omits them
            if self._chat and (leg is not None or not self._client_logprobs):
                choice.pop("logprobs", None)  # a chat continuation's are a completion's
            elif not self._chat and not self._client_logprobs:
                choice["logprobs"] = None
        if isinstance(token_ids, list):
            self._ids.extend(token_ids)
            self._tokens += len(token_ids)
        elif text:
            self._ids_whole = False
            self._tokens += 1
        if leg is not None and not self._chat and self._chars_before_leg:
            _rebase_offsets(choice, self._chars_before_leg)
        if text:
            self._text.append(text)
        if choice.get("finish_reason") is not None:
            self.finished = True
        if leg is not None or not self._client_ids:
            choice.pop("prompt_token_ids", None)
        if not self._client_ids:
            choice.pop("token_ids", None)
        return choice

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage as the client's request's: its prompt, and every completion
        token once (those delivered before this leg, and this leg's)."""
        before = self._tokens_before_leg
        completion = before + int(usage.get("completion_tokens") or 0)
        if self._prompt_ids is not None:
            prompt = len(self._prompt_ids)
        else:
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - before)
        return _usage(prompt, completion)

    # ------------------------------------------------------------------ what comes next
    @property
    def delivered(self) -> int:
        """Completion tokens the client has."""
        return self._tokens

    @property
    def usage_sent(self) -> bool:
        """An engine's usage event went to the client (the client asked for it)."""
        return self._usage_sent

    def usage_event(self) -> bytes:
        """What the client's stream used, as a data event with `usage` (the access log's
        token counts and flow control's `Done` read it, as they read a stream's last event):
        the prompt's tokens, when an engine gave its ids, and every completion token
        delivered, whichever legs they came from."""
        prompt = None if self._prompt_ids is None else len(self._prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": self._tokens}
        return b"data: " + orjson.dumps({"usage": usage})

    def ending(self) -> bytes:
        """The end of a stream whose generation had finished when its leg failed (before its
        usage or `[DONE]`): the usage if asked for and not sent, then `[DONE]`."""
        out = []
        if self._include_usage and not self._usage_sent and self._prompt_ids is not None:
            usage = _usage(len(self._prompt_ids), self._tokens)
            obj = "chat.completion.chunk" if self._chat else "text_completion"
            event = {**(self._head or {}), "object": obj, "choices": [], "usage": usage}
            out.append(b"data: " + orjson.dumps(event) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        self.done = True
        return b"".join(out)

    def continuation(self, rendered_prompt: str | None = None) -> Continuation | None:
        """The next leg's request, or None when there is nothing left to generate or no way
        to continue (no token ids and a prompt that is not text; a chat that
        `needs_rendered_prompt` without it)."""
        if self.finished or self.done:
            return None
        body, k = self._body, self._tokens
        if self._chat:
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
        else:
            limit = body.get("max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS
        if limit is not None and limit - k <= 0:
            return None
        dropped = _CHAT_ONLY if self._chat else frozenset()
        if self._by_logprobs:
            prompt = rendered_prompt if self._chat else _one_prompt(body.get("prompt"))
            if prompt is None:
                return None
            base = {key: v for key, v in body.items() if key not in dropped}
            if self._ids_whole:  # llama.cpp takes text followed by token ids as one prompt
                head = prompt if isinstance(prompt, list) else [prompt]
                base["prompt"], kind = [*head, *self._ids], TOKEN_IDS
            elif isinstance(prompt, str):
                base["prompt"], kind = prompt + "".join(self._text), TEXT
            else:
                return None
            endpoint: Endpoint = "completions"
        elif self._prompt_ids is not None and self._ids_whole:
            base = {key: v for key, v in body.items() if key not in dropped}
            base["prompt"] = [*self._prompt_ids, *self._ids]
            endpoint = "completions"
            kind = TOKEN_IDS
        elif self._chat:
            base = dict(body)
            text = "".join(self._text)
            base["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
            base["continue_final_message"] = True
            base["add_generation_prompt"] = False
            base.pop("max_completion_tokens", None)
            endpoint, kind = "chat", TEXT
        elif isinstance(body.get("prompt"), str):
            base = dict(body)
            base["prompt"] = body["prompt"] + "".join(self._text)
            endpoint, kind = "completions", TEXT
        else:
            return None
        base.pop("max_tokens", None)
        if limit is not None:
            base["max_tokens"] = limit - k
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
            base["min_tokens"] = max(0, min_tokens - k)
        base["stream"] = True
        if self._by_logprobs:
            if self._chat or not self._client_logprobs:
                base = _with_logprobs(base, chat=False)
        else:
            base["return_token_ids"] = True
        return Continuation(endpoint, base, kind)


def _rebase_offsets(choice: dict[str, Any], chars: int) -> None:
    """A continuation's completion logprobs count `text_offset` from its own first token: in
    the client's stream they follow the `chars` characters already delivered."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return
    offsets = logprobs.get("text_offset")
    if isinstance(offsets, list) and all(type(o) is int for o in offsets):
        logprobs["text_offset"] = [o + chars for o in offsets]


def _with_logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """`body` asking llama.cpp for each token's logprob, which carries its id (one top
    logprob: the least it gives ids with)."""
    if chat:
        return {**body, "logprobs": True, "top_logprobs": 1}
    return {**body, "logprobs": 1}


def _logprob_ids(choice: dict[str, Any]) -> list[int] | None:
    """The token ids of a llama.cpp choice's `logprobs.content`, or None without them."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    ids = [entry.get("id") for entry in content if isinstance(entry, dict)]
    if len(ids) != len(content) or not all(isinstance(i, int) for i in ids):
        return None
    return ids  # type: ignore[return-value]


def _one_prompt(prompt: Any) -> str | list[int] | None:
    """A completion's one prompt, as text or token ids (unwrapped from a one-item list)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return None
