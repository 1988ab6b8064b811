"""The load generator process: one JSON command per stdin line, one JSON answer per stdout line.

Commands: `{"cmd": "run", "spec": {...}}` -> `{"result": {...}}`; `{"cmd": "flow", "spec":
{...}}` (an open-loop `bench.loadgen.flow` run) -> `{"result": {...}}`; `{"cmd": "reset"}`
closes the client's connections; `{"cmd": "quit"}` (or EOF) ends the process. Uses uvloop when
installed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from bench.loadgen.client import Client
from bench.loadgen.flow import FlowSpec, run_flow
from bench.loadgen.spec import RunSpec


async def serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    client = Client()
    try:
        while line := await reader.readline():
            command = json.loads(line)
            answer: dict[str, Any] = {"ok": True}
            if command["cmd"] == "run":
                spec = RunSpec.from_json(command["spec"])
                result = await (client.paired(spec) if spec.paired else client.run(spec))
                answer = {"result": result.to_json()}
            elif command["cmd"] == "flow":
                flow = await run_flow(await client.session(), FlowSpec.from_json(command["spec"]))
                answer = {"result": flow.to_json()}
            elif command["cmd"] == "reset":
                await client.close()
            elif command["cmd"] == "quit":
                break
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        await client.close()


def main() -> None:
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


if __name__ == "__main__":
    main()
