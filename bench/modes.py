"""Run sizes: `quick` (a smoke test, under a minute), `full` (docs/benchmarks.md, ~45 min) and
`soak` (the chaos soak alone: 3 minutes per router, Narwhal then each peer)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    # overhead suite
    overhead_targets: tuple[str, ...]
    concurrency: tuple[int, ...]
    run_s: float
    reps: int
    paired_s: float  # c=1 paired latency run, per stream mode
    # many-streams suite
    streams_targets: tuple[str, ...]
    streams: int
    streams_run_s: float
    streams_ramp_s: float
    streams_tokens: int
    # goodput under faults
    fault_scenarios: tuple[str, ...]
    fault_routers: tuple[str, ...]
    fault_warm_s: float
    fault_s: float
    fault_after_s: float
    # control-plane cost
    control_sizes: tuple[int, ...]
    control_s: float
    # hot-path profile
    profile_s: float
    # time to first token on real llama-server processes, PD split vs unified
    llama_reps: int
    llama_prompt_words: int
    llama_tokens: int
    llama_threads: int
    # the suites a run without --suites runs
    suites: tuple[str, ...]
    # chaos soak (bench.suites.soak): seconds per router, the schedule's seed, peers too?
    soak_s: float = 60.0
    soak_seed: int = 99
    soak_routers: tuple[str, ...] = ("narwhal", "vllm-router", "sglang-router")
    # the HTTP stack A/B, router-bound (bench.suites.floor_ab; part of full mode)
    floor_ab_targets: tuple[str, ...] = (
        "direct",
        "floor",
        "floor-uvloop",
        "floor-raw",
        "floor-granian",
        "narwhal",
        "narwhal-uvloop",
        "vllm-router",
        "sglang-router",
    )
    floor_ab_s: float = 4.0  # seconds per measured run
    floor_ab_c: int = 64  # concurrent clients
    floor_ab_reps: int = 3
    # router-bound with data-plane workers (bench.suites.router_bound; part of full mode):
    # Narwhal once per `serving.workers` value (`--workers-sweep` replaces the list), the peers
    # beside it; 5 targets x 2 stream modes x 2 concurrencies x 3 rounds of 4 s is ~6 min, ~7
    # with the bounded twin below, ~9 with the edge twins
    router_bound_workers: tuple[str, ...] = ("1", "2", "auto")
    router_bound_c: tuple[int, ...] = (64, 256)
    router_bound_s: float = 4.0  # seconds per measured run
    router_bound_reps: int = 3
    # the bounded twin: each of these `serving.workers` values (those also in
    # `router_bound_workers`) runs a second time under `serving.policy: bounded`
    # (`narwhal-w<N>-bounded`), in these stream modes ("no" json, "yes" stream), at every
    # concurrency, for "bounded ÷ single_attempt" in the same run; () turns it off
    # (`--bounded-twin` replaces the list). At `auto`, json and stream: 2 x 2 x 3 rounds, ~1 min
    router_bound_bounded: tuple[str, ...] = ("auto",)
    router_bound_bounded_streams: tuple[str, ...] = ("no", "yes")
    # the edge twins: Narwhal at `serving.workers: auto` (when `auto` is in
    # `router_bound_workers`) again with client keys on (`auth`: `narwhal-wauto-auth`, the load
    # generator sending `Authorization: Bearer <key>`), with the access log on (`access`:
    # `narwhal-wauto-access`, `logging.access: true`), placing by prefix (`prefix`:
    # `narwhal-wauto-prefix`, `placement.policy: prefix` with the bench's tokenizer) and with
    # flow control on (`flow`: `narwhal-wauto-flow`, `flow.enabled: true`), in every cell and
    # round beside `narwhal-wauto`, for "edge ÷ plain" in the same run; () turns them off
    # (`--edge-twins` replaces the list). All four, json and stream, c=64 and c=256:
    # 4 x 4 x 3 rounds, ~4 min
    router_bound_edge: tuple[str, ...] = ("auth", "access", "prefix", "flow")
    # cache-aware placement against the peers (bench.suites.cache; part of full mode): every
    # arm runs each workload as a ramp of closed-loop steps of this many clients; 8 arms
    # (two only on the sharing workloads) x 3 workloads x 3 steps of 12 s is ~16 min
    cache_steps: tuple[int, ...] = (4, 16, 40)
    cache_step_s: float = 12.0
    cache_workloads: tuple[str, ...] = ("shared_prefix", "multi_turn", "no_sharing")
    # flow control under overload (bench.suites.flow; part of full mode): each of 4 arms runs
    # `flow_unloaded_s` unloaded, then `flow_s` at twice the fleet's capacity (then up to
    # 12 s of answers): ~6 min (`--flow-s` replaces `flow_s`)
    flow_s: float = 60.0
    flow_unloaded_s: float = 10.0
    flow_max_wait_s: int = 5  # Narwhal's flow.max_wait_s, the peers' --queue-timeout-secs
    # router-bound measured with wrk (bench.suites.router_wrk; part of full mode): mock engines
    # that answer at once, each target x 2 stream modes x each concurrency x reps rounds of a
    # 1 s warm-up and `router_wrk_s` measured: 5 x 2 x 2 x 3 x ~6.5 s, ~7 min
    router_wrk_targets: tuple[str, ...] = (
        "narwhal-w1",
        "narwhal-wauto",
        "vllm-router",
        "sglang-router",
        "floor-raw",
    )
    router_wrk_c: tuple[int, ...] = (64, 256)  # issue 32's cells
    router_wrk_s: float = 5.0  # seconds per measured run (wrk's -d, whole seconds)
    router_wrk_reps: int = 3
    # the profile suite's Narwhal targets (bench.suites.profile)
    profile_targets: tuple[str, ...] = ("narwhal-w1", "narwhal-wauto")


ALL_TARGETS = ("direct", "floor", "narwhal", "vllm-router", "sglang-router")
ALL_FAULTS = ("decode_killed", "prefill_5xx", "stall_mid_stream", "handoff_garbage", "frozen")
ALL_FAULT_ROUTERS = (
    "narwhal",
    "narwhal-bounded",
    "vllm-router",
    "vllm-router-hc1",
    "sglang-router",
    "sglang-router-hc1",
)

MODES = {
    "quick": Mode(
        name="quick",
        overhead_targets=ALL_TARGETS,
        concurrency=(1, 64),
        run_s=0.6,
        reps=1,
        paired_s=3.0,
        streams_targets=("direct", "floor", "narwhal"),
        streams=100,
        streams_run_s=1.5,
        streams_ramp_s=0.3,
        streams_tokens=20,
        fault_scenarios=("prefill_5xx",),
        fault_routers=("narwhal", "narwhal-bounded"),
        fault_warm_s=1.0,
        fault_s=2.5,
        fault_after_s=2.0,
        control_sizes=(16,),
        control_s=2.0,
        profile_s=0.0,
        llama_reps=2,
        llama_prompt_words=300,
        llama_tokens=4,
        llama_threads=2,
        suites=("overhead", "streams", "faults", "control", "profile"),
        floor_ab_s=0.6,
        floor_ab_c=8,
        floor_ab_reps=1,
        router_bound_s=1.0,
        router_bound_reps=1,
        cache_steps=(4, 16),
        cache_step_s=3.0,
        flow_s=4.0,
        flow_unloaded_s=2.0,
        flow_max_wait_s=1,
        router_wrk_c=(8,),
        router_wrk_s=2.0,
        router_wrk_reps=1,
    ),
    "full": Mode(
        name="full",
        overhead_targets=ALL_TARGETS,
        concurrency=(1, 16, 64, 256),
        run_s=1.5,
        reps=3,
        paired_s=30.0,
        streams_targets=ALL_TARGETS,
        streams=1000,
        streams_run_s=8.0,
        streams_ramp_s=2.0,
        streams_tokens=40,
        fault_scenarios=ALL_FAULTS,
        fault_routers=ALL_FAULT_ROUTERS,
        fault_warm_s=2.0,
        fault_s=5.0,
        fault_after_s=5.0,
        control_sizes=(16, 64, 256),
        control_s=6.0,
        profile_s=6.0,
        llama_reps=7,
        llama_prompt_words=1500,
        llama_tokens=16,
        llama_threads=2,
        suites=(
            "overhead",
            "streams",
            "faults",
            "control",
            "profile",
            "llama",
            "floor_ab",
            "router_bound",
            "cache",
            "flow",
            "router_wrk",
        ),
    ),
}

MODES["soak"] = replace(MODES["quick"], name="soak", suites=("soak",), soak_s=180.0)
