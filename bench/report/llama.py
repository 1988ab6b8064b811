"""The real-engine section: time to first token with and without the PD split (llama.cpp)."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import num, ratio, table

LABELS = {
    "direct": "direct to one llama-server (unified)",
    "narwhal-unified": "Narwhal, unified (`role: both`)",
    "narwhal-pd": "Narwhal, PD split (slot save + restore)",
}


def render(suite: dict[str, Any]) -> str:
    rows = suite["rows"]
    body = []
    for target, label in LABELS.items():
        r = rows.get(target)
        if r is None:
            continue
        spread = f"{num(r['ttft_ms_min'], 0)}-{num(r['ttft_ms_max'], 0)}"
        body.append(
            [
                label,
                num(r["prompt_tokens"], 0),
                num(r["prompt_evaluated"], 0),
                num(r["ttft_ms_median"], 0),
                spread,
                num(r["total_ms_median"], 0),
                ratio(r["ttft_ms_median"], rows["direct"]["ttft_ms_median"]),
            ]
        )
    header = [
        "path", "prompt tokens", "prompt tokens the answering server evaluated",
        "TTFT median ms", "TTFT min-max ms", "total median ms", "TTFT ÷ direct",
    ]  # fmt: skip
    pd, unified = rows.get("narwhal-pd", {}), rows.get("narwhal-unified", {})
    extra = (pd.get("ttft_ms_median") or 0) - (unified.get("ttft_ms_median") or 0)
    intro = (
        f"Real `llama-server` processes (Gemma 3 270M Q4_K_M, CPU, {suite['threads']} threads "
        f"each, `--swa-full`), one streamed completion at a time with a {suite['prompt_words']}"
        f"-word prompt whose head is unique per request (no prefix cache hit) and "
        f"`max_tokens: {suite['tokens']}`, targets rotated, {suite['reps']} requests per target; "
        "TTFT is the time to the first event with text."
    )
    note = (
        f"The split adds {num(extra, 0)} ms to the median TTFT over Narwhal unified: the "
        "prefill server evaluates the whole prompt and writes its slot file, the decode server "
        "reads it back and evaluates one token. On one CPU host that is pure cost; the split "
        "pays off when prefill and decode run on separate hardware and long prompts would "
        "otherwise stall other requests' decoding. Slot files left behind after the run: "
        f"{len(suite['leftover_slot_files'])}."
    )
    return intro + "\n\n" + table(header, body) + "\n\n" + note + "\n"
