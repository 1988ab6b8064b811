"""The `etcd` lease store (v3), over etcd's HTTP/JSON gateway.

Lease writes are transactions guarded by the lease key's `mod_revision` as read and verified
in the same operation. Acquisition also writes `<key>/owner` = "holder:epoch"; handoff
writes (`<key>/handoff`) are transactions comparing that value, so a router that no longer
holds its epoch cannot write, and renewals never refuse the holder's own writes.
Guarantees and limits: docs/lease.md.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp
import orjson

from narwhal.state.lease import LeaseRecord, StoreUnavailable


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


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
                        raise StoreUnavailable(f"etcd {endpoint}{path}: HTTP {resp.status}")
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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.sleep(0)
