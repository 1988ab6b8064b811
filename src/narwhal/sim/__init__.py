"""narwhal-sim: a simulated vLLM engine speaking the OpenAI API and the NixlConnector handoff.

The demo, the tests and the benchmarks run the router against it. Start it with
`narwhal-sim serve`; see docs/simulator.md.
"""
