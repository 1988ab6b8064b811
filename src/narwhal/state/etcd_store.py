"""The `etcd` lease store (v3), over etcd's HTTP/JSON gateway.

Lease writes are transactions guarded by the lease key's `mod_revision` as read and verified
in the same operation. Acquisition also writes `<key>/owner` = "holder:epoch"; handoff
writes (`<key>/handoff`) are transactions comparing that value, so a router that no longer
holds its epoch cannot write, and renewals never refuse the holder's own writes.
The same gateway serves the maintenance calls: status (revision, database size), alarms,
and compaction of the history. Guarantees and limits: docs/lease.md.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from narwhal.state.lease import LeaseRecord, StoreUnavailable


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


class EtcdRefused(StoreUnavailable):
    """etcd answered, with an error (e.g. `mvcc: database space exceeded`): `detail` is its
    message. Still a store failure for the lease; the compactor reads `detail`."""

    def __init__(self, where: str, status: int, detail: str) -> None:
        super().__init__(f"etcd {where}: HTTP {status}: {detail}")
        self.detail = detail


COMPACTED = "required revision has been compacted"
"""etcd's error when a revision is at or below the last compaction (ours or another's)."""


@dataclass(frozen=True, slots=True)
class EtcdStatus:
    """`/v3/maintenance/status` of the member answering: its current revision and database
    size (`db_size_in_use_bytes` is None when the server does not report it)."""

    revision: int
    db_size_bytes: int
    db_size_in_use_bytes: int | None


def _error_detail(data: bytes) -> str:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:200].decode(errors="replace")
    if isinstance(body, dict):
        return str(body.get("error") or body.get("message") or body)
    return str(body)


class EtcdLeaseStore:
    def __init__(self, endpoints: tuple[str, ...], key: str, timeout_s: float) -> None:
        self._endpoints = endpoints
        self._key = key
        self._handoff_key = key.rstrip("/") + "/handoff"
        # "holder:epoch", written only on acquisition: the handoff guard compares it by value,
        # so the holder's own renewals (which change the lease key) never refuse its writes.
        self._owner_key = key.rstrip("/") + "/owner"
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._next = 0

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=4),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            )
        errors = []
        for i in range(len(self._endpoints)):
            endpoint = self._endpoints[(self._next + i) % len(self._endpoints)]
            try:
                async with self._session.post(endpoint + path, data=orjson.dumps(body)) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        raise EtcdRefused(endpoint + path, resp.status, _error_detail(data))
                    result: dict[str, Any] = orjson.loads(data)
                    self._next = (self._next + i) % len(self._endpoints)
                    return result
            except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
                errors.append(f"{endpoint}: {type(exc).__name__}: {exc}")
        raise StoreUnavailable("etcd unreachable: " + "; ".join(errors))

    async def _get(self, key: str) -> tuple[bytes | None, str]:
        """(value, mod_revision); mod_revision "0" when the key does not exist."""
        data = await self._post("/v3/kv/range", {"key": _b64(key)})
        kvs = data.get("kvs") or []
        if not kvs:
            return None, "0"
        return base64.b64decode(kvs[0].get("value", "")), str(kvs[0].get("mod_revision", "0"))

    async def _record(self) -> tuple[LeaseRecord | None, str]:
        value, rev = await self._get(self._key)
        if value is None:
            return None, rev
        try:
            return LeaseRecord.from_json(orjson.loads(value)), rev
        except (orjson.JSONDecodeError, ValueError, AttributeError) as exc:
            raise StoreUnavailable(f"unreadable lease record in etcd: {exc}") from None

    async def _txn(self, compare: dict[str, Any], puts: dict[str, bytes]) -> bool:
        success = [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in puts.items()]
        data = await self._post("/v3/kv/txn", {"compare": [compare], "success": success})
        return bool(data.get("succeeded", False))

    def _unchanged_since(self, guard_rev: str) -> dict[str, Any]:
        """Compare: the lease key is as read (or still absent)."""
        if guard_rev == "0":
            return {
                "key": _b64(self._key),
                "target": "CREATE",
                "result": "EQUAL",
                "create_revision": "0",
            }
        return {
            "key": _b64(self._key),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": guard_rev,
        }

    async def read(self) -> LeaseRecord | None:
        record, _ = await self._record()
        return record

    async def swap(self, expected: LeaseRecord | None, record: LeaseRecord) -> bool:
        current, rev = await self._record()
        if current != expected:  # the whole record; the txn then guards this very revision
            return False
        owner = f"{record.holder}:{record.epoch}".encode()
        return await self._txn(
            self._unchanged_since(rev),
            {self._key: orjson.dumps(record.to_json()), self._owner_key: owner},
        )

    async def renew(self, holder: str, epoch: int, expires_at: float) -> bool:
        current, rev = await self._record()
        if current is None or current.holder != holder or current.epoch != epoch:
            return False
        value = orjson.dumps(LeaseRecord(holder, epoch, expires_at).to_json())
        return await self._txn(self._unchanged_since(rev), {self._key: value})

    async def write_handoff(self, holder: str, epoch: int, data: bytes) -> bool:
        owner = _b64(f"{holder}:{epoch}")
        guard = {"key": _b64(self._owner_key), "target": "VALUE", "result": "EQUAL", "value": owner}
        return await self._txn(guard, {self._handoff_key: data})

    async def read_handoff(self) -> bytes | None:
        value, _ = await self._get(self._handoff_key)
        return value

    # ---------------------------------------------------------------- maintenance
    async def status(self) -> EtcdStatus:
        data = await self._post("/v3/maintenance/status", {})
        try:
            in_use = data.get("dbSizeInUse")
            return EtcdStatus(
                revision=int(data["header"]["revision"]),
                db_size_bytes=int(data["dbSize"]),
                db_size_in_use_bytes=None if in_use is None else int(in_use),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreUnavailable(f"unreadable etcd status: {exc!r}") from None

    async def alarms(self) -> frozenset[str]:
        """The active alarms of the cluster (`NOSPACE`, `CORRUPT`); empty when none."""
        data = await self._post("/v3/maintenance/alarm", {"action": "GET"})
        return frozenset(str(a.get("alarm", "NONE")) for a in data.get("alarms") or ()) - {"NONE"}

    async def compact(self, revision: int) -> bool:
        """Compact the key-value history up to `revision` (every key: the whole cluster).
        False when it was already compacted at or past it (by us or another client)."""
        try:
            await self._post("/v3/kv/compaction", {"revision": str(revision)})
        except EtcdRefused as exc:
            if COMPACTED in exc.detail:
                return False
            raise
        return True

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.sleep(0)
