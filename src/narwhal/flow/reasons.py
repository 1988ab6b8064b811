"""Why flow control refused a request: the `reason` of `narwhal_shed_total{reason}`."""

from __future__ import annotations

from enum import StrEnum


class ShedReason(StrEnum):
    QUEUE_FULL = "queue_full"  # the queue was full and this was its worst request
    DEADLINE = "deadline"  # it could not start before its deadline (`flow.max_wait_s`)
    REQUESTS_PER_MINUTE = "requests_per_minute"  # its key's request rate limit
    TOKENS_PER_MINUTE = "tokens_per_minute"  # its key's token rate limit
