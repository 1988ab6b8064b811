"""Engine state and its one owner: the leaf package every other layer reads.

`state` holds the immutable per-engine records, `events` what may change them, `reducer` the
one pure function that applies an event, and `store` the `Fleet` that keeps the current
states, runs the reducer, logs `from -> to (reason)` and answers eligibility questions. It
imports nothing from the control plane, the data plane or durable state.
"""
