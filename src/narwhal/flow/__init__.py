"""Flow control (DESIGN §13, docs/flow.md): pure decisions over snapshots, `now` passed in.

`saturation` says when an engine, and a role, is full; `vtc` keeps each client's virtual token
counter; `queue` is the router's one wait queue (priority, then the least-served client, then
FIFO; shedding and deadlines); `ratelimit` keeps each key's requests and tokens per minute;
`priority` reads a request's priority. Nothing here does I/O or keeps a global.
"""
