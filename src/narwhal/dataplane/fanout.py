"""Batched prompts and `n > 1` (issue 20 §3), served as independent PD requests.

vLLM's PD path runs one prefill and one decode per request, and its KV connector transfers one
sequence's blocks: there is no "one prefill, n decodes" to ask for. A request with k prompts and
`n` samples each is therefore k·n ordinary requests (each with one prompt and n=1; the prefill of
a prompt's later samples hits the prefill engine's prefix cache), run a few at a time, and their
whole answers are merged in vLLM's order: prompt i's sample j is choice i·n + j. Usage counts
each prompt once and every completion. A client `seed` gives sample j the seed `seed + j`, so
the n samples differ as vLLM's do. Only whole answers are merged: a streamed request with
several choices is refused when it is parsed.

Pure: `split` and `merge`; `fanout_runner.FanOut` runs the parts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from narwhal.dataplane.requests import ClientRequest

PARALLEL = 8
"""Parts of one client request in flight at once: a large batch takes its turn instead of
taking the fleet (and the data pool) for itself."""


def split(req: ClientRequest) -> list[ClientRequest]:
    """The request as its parts, in choice order: one prompt and one sample each."""
    prompts: tuple[Any, ...] = req.batch if req.batch is not None else (None,)
    parts = []
    for prompt in prompts:
        body = {k: v for k, v in req.body.items() if k != "n"}
        text, count = req.prompt_text, req.prompt_token_count
        if prompt is not None:
            body["prompt"] = prompt
            text, count = (prompt, None) if isinstance(prompt, str) else (None, len(prompt))
        seed = body.get("seed")
        for sample in range(req.n):
            part = body if seed is None or sample == 0 else {**body, "seed": seed + sample}
            parts.append(
                replace(req, body=part, prompt_text=text, prompt_token_count=count, n=1, batch=None)
            )
    return parts


def merge(answers: list[bytes], n: int) -> bytes:
    """One answer from the parts' answers (in `split`'s order): their choices renumbered, their
    usage summed with each prompt counted once (its first sample's)."""
    docs = [orjson.loads(a) for a in answers]
    choices = []
    for index, doc in enumerate(docs):
        for choice in doc["choices"]:
            choices.append({**choice, "index": index})
    merged = {**docs[0], "choices": choices}
    usages: list[Any] = [doc.get("usage") for doc in docs]
    if all(isinstance(u, dict) for u in usages):
        prompt = sum(int(u["prompt_tokens"]) for u in usages[::n])
        completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
        merged["usage"] = {
            **usages[0],
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    return orjson.dumps(merged)
