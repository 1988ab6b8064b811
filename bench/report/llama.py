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
    spread = (unified.get("ttft_ms_max") or 0) - (unified.get("ttft_ms_min") or 0)
    h = suite["handoff"]
    intro = (
        f"Real `llama-server` processes (Gemma 3 270M Q4_K_M, CPU, {suite['threads']} threads "
        f"each, `--swa-full`), one streamed completion at a time with a {suite['prompt_words']}"
        f"-word prompt whose head is unique per request (no prefix cache hit) and "
        f"`max_tokens: {suite['tokens']}`, targets rotated, {suite['reps']} requests per target; "
        "TTFT is the time to the first event with text."
    )
    verdict = "within the run-to-run spread" if abs(extra) <= spread else "more than the spread"
    note = (
        f"PD minus unified median TTFT: {num(extra, 0)} ms, {verdict} of unified TTFT "
        f"({num(spread, 0)} ms min to max). The handoff itself, timed by the servers for a "
        f"{num(h['tokens'], 0)}-token prompt (median of 3): slot save {num(h['save_ms'], 0)} ms "
        f"and restore {num(h['restore_ms'], 0)} ms for a {num(h['file_mb'], 1)} MB file, small "
        "against evaluating the prompt, which both paths do once (the PD decode server evaluated "
        "one prompt token). On one CPU host the split buys nothing; it pays off when prefill "
        "and decode run on separate hardware, where long prompts would otherwise stall other "
        "requests' decoding. Slot files left behind after the run: "
        f"{len(suite['leftover_slot_files'])}."
    )
    return intro + "\n\n" + table(header, body) + "\n\n" + note + "\n"
