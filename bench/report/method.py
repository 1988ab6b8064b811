"""How the numbers were made: commands, what runs, the routers' settings, definitions, caveats."""

from __future__ import annotations

import re
from typing import Any

import yaml

_VENV = re.compile(r"\S*/(\.venv|bench/\.venv)/bin/")


def _short(command: str) -> str:
    """Paths inside the checkout, shortened so the report does not depend on where it ran."""
    command = _VENV.sub(lambda m: "bench/.venv/bin/" if "bench" in m[1] else ".venv/bin/", command)
    return re.sub(r"/\S*/(bench-results|work-\w+)/", "<results>/", command)


def render(doc: dict[str, Any]) -> str:
    commands = "\n".join(f"{name}: {_short(cmd)}" for name, cmd in doc.get("commands", {}).items())
    narwhal = doc.get("narwhal_configs", {}).get("narwhal")
    config = yaml.safe_dump(narwhal, sort_keys=False).strip() if narwhal else "(not run)"
    config = re.sub(r"/\S*/(work-\w+)/", "<results>/", config)
    return f"""### Running it

```sh
make bench          # full mode: this file, raw JSON in bench-results/full.json (~28 min)
make bench-quick    # quick mode: bench-results/quick.md (under a minute once set up)
.venv/bin/python -m bench --mode full --report docs/benchmarks.md --results bench-results \\
    [--suites overhead,streams,faults,control,profile,llama,floor_ab,router_bound] [--no-peers]
# the router-bound suite alone, e.g. on a bigger machine with its own workers list (~7 min here):
.venv/bin/python -m bench --mode full --suites router_bound --workers-sweep 1,2,4,8,auto \\
    --report bench-results/router_bound.md --results bench-results/router_bound
# ... with the bounded twin (serving.policy: bounded) at every workers value, not only auto:
.venv/bin/python -m bench --mode full --suites router_bound --bounded-twin 1,2,auto \\
    --report bench-results/rb-bounded.md --results bench-results/rb-bounded
# ... only the edge twins (client keys, access log, prefix placement, flow control) beside
# plain Narwhal at workers auto (~5 min):
.venv/bin/python -m bench --mode full --suites router_bound --no-peers --workers-sweep auto \\
    --bounded-twin none --edge-twins auth,access,prefix,flow \\
    --report bench-results/rb-edge.md --results bench-results/rb-edge
# the router-bound suite again with wrk in front of mock engines that answer at once (~7 min):
.venv/bin/python -m bench --mode full --suites router_wrk \\
    --report bench-results/router_wrk.md --results bench-results/router_wrk
# ... as an A/B of this tree against another revision (a worktree), same rounds, no peers:
git worktree add /tmp/ab_base <rev>
.venv/bin/python -m bench --mode full --suites router_wrk --wrk-targets narwhal-w1,narwhal-wauto \\
    --reps 5 --ab-src /tmp/ab_base/src --report bench-results/ab.md --results bench-results/ab
# where each process's CPU per request goes, step by step (py-spy on every process, ~1 min):
.venv/bin/python -m bench --mode full --suites profile \\
    --profile-targets narwhal-w1,narwhal-wauto,narwhal-wauto-prefix \\
    --report bench-results/profile.md --results bench-results/profile
```

**Regression check.** Every run with the router_wrk suite (`make bench` included) compares each
Narwhal cell's CPU per request, as a ratio to floor-raw's in the same rounds (so the machine's
drift between runs, 10-30% here, falls on both), with the last accepted run in
`bench/baselines/router_wrk.json`; a rise beyond the larger of 10% and either run's spread of
that ratio over its rounds is printed as `REGRESSION` and the run exits with status 3.
`--record-baseline` records the run as the new baseline, after a change that was measured and
kept.

The first run creates `bench/.venv` and installs the peers there with pip (`vllm-router==0.1.17`,
`sglang-router==0.3.2`), plus `py-spy==0.4.3`, and `uvloop` and `aiohttp` for the load
generator; later runs reuse it. Nothing leaves 127.0.0.1: the engines are `narwhal-sim`
processes, and sglang-router is given a local tokenizer directory (below) so that it never tries
to download one.

### What runs

- **Engines**: `narwhal-sim` processes (`python -m narwhal.sim.cli serve`, one per engine,
  `--kv-role kv_producer` for prefill and `kv_consumer` for decode), started with
  `--model <results>/work-*/tokenizer`: a directory holding a tiny word-level `tokenizer.json`.
  The served model name and the `model_path` the sims report are that path, so sglang-router
  loads its tokenizer from disk.
- **Real engines** (llama suite, full mode only): three `llama-server` processes built by
  `scripts/get-llama-server.sh` (docs/engines.md), the first use on a machine builds it (~4 min).
  Their requests come from the orchestrator itself, one at a time, not from the load generator.
- **Load generator**: `python -m bench.loadgen.worker` in its own process (bench venv, uvloop,
  one aiohttp session, request bodies spliced from pre-encoded bytes), a closed loop of N
  clients bounded by a request count and a duration. Its CPU use is recorded with every run.
  **direct** is the load generator doing the PD round trip itself: a prefill leg with
  `max_tokens: 1` and `kv_transfer_params.do_remote_decode: true`, then the decode leg with the
  returned `kv_transfer_params` spliced into the original body (the no-router limit).
- **Floor** (overhead and streams suites): `python -m bench.floor`, a PD relay on Narwhal's own
  HTTP stack (aiohttp, orjson) that does only the wire work every vLLM PD proxy must do — read
  the body, prefill, take the handoff, decode, relay the bytes — with no validation, deadlines,
  placement, evidence or metrics. Not a router: it shows which part of Narwhal's cost is the
  stack's and which is Narwhal's own.
- **Tap** (faults and control-plane suites): `python -m bench.tap`, a TCP relay with one port
  per engine id. It timestamps every client request passing to an engine (the load generator's
  prompts carry a marker; probes and health checks do not) and resets the router's connection
  when the engine behind it refuses or drops one, as a dead process would.
- **wrk and the mock engines** (router_wrk suite): `wrk -t1 -c64 -d5s --latency`, then `-c256`
  (Debian's `wrk`, installed with apt-get when missing, as `make system-deps` installs packages;
  without it the suite is recorded as not run) sends one fixed completion (`max_tokens` 8, a
  32-word prompt, set by a Lua script written into the work directory) to each router in front
  of one prefill and one decode `python -m bench.mock_engine`: an aiohttp app that answers at
  once from pre-built bytes (a prefill leg gets a NixlConnector handoff, any other leg
  `max_tokens` tokens, SSE or JSON), with no KV store or side channel, and that counts what each
  router asks of it (`/mock/stats`: vllm-router asks `/tokenize` and `/v1/completions/render`
  before each leg, which the mock answers 404). CPU of the router's tree, of both engines and of
  wrk (from `wait4`) per 1,000 completed requests; a run where most requests failed is flagged.
- **Router CPU and memory**: `utime + stime` of the router process (all threads) from
  `/proc/<pid>/stat` before and after each run; peak memory is `VmHWM` from
  `/proc/<pid>/status`, reset before each run (`echo 5 > /proc/<pid>/clear_refs`), so it is the
  run's own peak RSS. The floor_ab and router_bound suites sum every process of the router
  (the process started and its descendants, e.g. Narwhal's control process and its
  data-plane workers); router_bound reports each process's VmRSS at the end of the run.
- **Medians**: the overhead suite runs every target once per round, in a rotated order, for
  `reps` rounds; tables show the median of the rounds (the p50/p99 columns are each run's
  percentiles, then the median over rounds). The c=1 target is judged on a separate
  **paired** run: one request at a time, each round sending one request to every target in a
  rotated order, so that the machine's slow drift in speed (about ±1 ms between runs) falls on
  every target alike.

### Routers and their settings

All routers listen on 127.0.0.1, log at warning level (per-request logging would otherwise be
part of what is measured) and get the same request deadline (`--request-timeout-secs` for the
peers, `serving.request_timeout_s` for Narwhal). Every router's stdout and stderr go to a file,
`<results>/work-<mode>/logs/<router>.log`; router_bound's `narwhal-wauto-access` measures
per-request logging on purpose (`logging.access: true`), its access lines going to that file
(a regular file on the results disk, not /dev/null), and `narwhal-wauto-auth` requires a client
key (`auth.api_keys_env: NARWHAL_BENCH_API_KEYS`, the variable set for its process only), which
the load generator sends to it, and to no other router, as `Authorization: Bearer <key>`.
Otherwise the peers run with their defaults; the `-hc1` variants add
`--health-check-interval-secs 1` (Narwhal's monitor interval). The peers use their default
`cache_aware` policy; with one engine per role (overhead, profile) the policy cannot matter.

```
{commands}
```

Narwhal's configuration (overhead suite; the streams suite raises `serving.max_connections` and
`queue_limit` to 4096, `narwhal-bounded` and router_bound's `narwhal-w<N>-bounded` set
`serving.policy: bounded`, its `narwhal-wauto-auth` adds `auth` and `narwhal-wauto-access`
`logging`, `-prefix` targets and the cache suite's arms set their own `placement`, nothing else
changes; every Narwhal target places by load, `least_loaded`, unless it says otherwise, though
the default is `prefix`):

```yaml
{config}
```

### Caveats

- **Two cores for everything.** Engines, router, load generator and tap share the machine's two
  cores, so throughput is what the whole set-up sustains, and a router that uses less CPU
  leaves more for the engines. Latency at concurrency 1 is the cleanest overhead figure. The
  load average is recorded at start and end: other work on the machine moves every number.
- **sglang-router does not speak vLLM's NixlConnector protocol.** It sends every request to a
  prefill and a decode engine at once, with SGLang's `bootstrap_host/port/room`, and expects
  the engines to meet through SGLang's bootstrap server. The sim ignores those fields, so both
  engines serve the request as a plain (unified) completion: no KV handoff, and the prefill
  engine generates all the tokens too. sglang-router's throughput and latency are therefore
  not a PD round trip, and because it waits for the prefill engine's (here: full) answer
  before streaming the decode's, its streaming TTFT equals its total latency and its streams
  arrive in bursts. Its CPU and memory per request are still comparable.
- **Peak RSS is the process's high-water mark during the run**, reset before it; allocators
  keep memory that earlier, larger runs freed, so a small run after a big one shows the big
  one's resident set.
- **A killed engine is seen through the tap**: after SIGKILL the tap accepts the router's
  connection and resets it once the sim's port refuses, rather than the kernel refusing the
  connection itself. Both are connection failures to every router tested.
"""
