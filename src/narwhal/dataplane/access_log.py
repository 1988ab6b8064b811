"""The access log (`logging.access`): one JSON line per client request, or one in N.

Written by the `narwhal.access` logger as the bare JSON object (no log envelope, whatever
`--log-format` says), so that a log shipper reads each line as one record. Sampling is one
request in every N, by count, in each data-plane process.
"""

from __future__ import annotations

import logging

import orjson

from narwhal.dataplane.record import RequestRecord

log = logging.getLogger("narwhal.access")


class AccessLog:
    def __init__(self, every: int) -> None:
        self._every = every
        self._seen = 0

    def log(self, record: RequestRecord) -> None:
        self._seen += 1
        if self._seen >= self._every:
            self._seen = 0
            log.info(orjson.dumps(record.to_json()).decode())
