"""Narwhal's benchmark harness: `python -m bench --mode quick|full --report FILE --results DIR`.

Everything runs on loopback: simulated engines (`narwhal-sim`), the routers under test (Narwhal and
its peers, installed by `bench.venv` into a separate virtualenv), a load generator in its own
process, and a TCP tap that counts which engine receives traffic. See docs/benchmarks.md.
"""
