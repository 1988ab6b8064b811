"""The chaos soak (`make soak`): load through a router while a seeded schedule injects faults,
and the invariants checked over what was seen. See bench.suites.soak and docs/soak.md."""
