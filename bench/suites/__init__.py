"""The benchmark suites; each `run(ctx)` returns a JSON-able dict for the results file."""
