"""The simulated engine's typed, frozen configuration (what `narwhal-sim serve` accepts)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from narwhal.sim.kv_events import BlockHashFormat, EventEncoding


class Role(StrEnum):
    """The serving role an operator assigned; informational (reported by /server_info)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
    EMBED = "embed"  # a pooling model: serves /v1/embeddings, and no completions


class KvRole(StrEnum):
    """vLLM's `kv_role`: which side of a KV transfer this engine may take."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"


class LoadFailurePolicy(StrEnum):
    """What a decode leg does with a handoff it cannot read (vLLM's `kv_load_failure_policy`)."""

    FAIL = "fail"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 0
    role: Role = Role.BOTH
    kv_role: KvRole = KvRole.BOTH
    model: str = "demo-model"
    max_model_len: int = 4096
    engine_id: str = "sim-engine"
    ttft_per_token_ms: float = 0.05
    itl_ms: float = 2.0
    transfer_per_block_ms: float = 0.1
    max_concurrency: int = 256
    kv_ttl_s: float = 30.0
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.FAIL
    kv_load_timeout_s: float = 5.0
    # Whether `return_token_ids` is honoured (vLLM >= 0.10.2 does; off, the sim is an engine
    # that gives no token ids, which a router can continue only from text).
    token_ids: bool = True
    # LoRA adapters served under their own names, as vLLM's `--lora-modules NAME=PATH` lists
    # them in /v1/models (the generation is the base model's).
    lora: tuple[str, ...] = ()
    # The prefix cache: `kv_blocks` blocks of `block_size` tokens (0: no cache, every prompt
    # computed in full, as before the cache existed).
    block_size: int = 16
    kv_blocks: int = 0
    # vLLM's `--max-num-seqs`: requests running at once; the others wait (None: no limit).
    max_num_seqs: int | None = None
    # Prompts computed one at a time in arrival order, as a GPU's prefill throughput is shared
    # by the running requests (vLLM fills each step's token budget first come, first served);
    # off, each running request's prefill runs on its own timer, however many run at once.
    serial_prefill: bool = False
    # KV events (vLLM's `--kv-events-config`): None: not published; 0: any free port.
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_topic: str = ""
    kv_events_encoding: EventEncoding = EventEncoding.MAP
    kv_events_block_hash: BlockHashFormat = BlockHashFormat.INT
    kv_events_drop_fraction: float = 0.0
    # A tokenizer.json (or a directory with one); None: a token per word.
    tokenizer: str | None = None

    def problem(self) -> str | None:
        """Why these settings cannot run together (naming the options), or None."""
        if self.kv_events_port is not None and self.kv_blocks == 0:
            return "--kv-events-port needs a prefix cache (--kv-blocks)"
        if self.kv_events_replay_port is not None and self.kv_events_port is None:
            return "--kv-events-replay-port needs --kv-events-port"
        if self.kv_blocks and self.kv_blocks * self.block_size < self.max_model_len:
            return (
                f"--kv-blocks {self.kv_blocks} x --block-size {self.block_size} tokens cannot "
                f"hold one prompt of --max-model-len {self.max_model_len}"
            )
        return None

    @property
    def advertised_host(self) -> str:
        """The host a decode engine should dial for this engine's side channel."""
        wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
        return wildcard.get(self.host, self.host)
