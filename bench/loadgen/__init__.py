"""The load generator: an async HTTP client that runs in its own process (`bench.loadgen.worker`).

`driver.LoadGen` (in the orchestrator) sends it one `RunSpec` at a time and gets a `RunResult`.
"""
