"""`reload_changes`: which changed keys apply to new requests and which wait for a restart,
and the config the router runs from then on."""

from __future__ import annotations

from typing import Any

from narwhal.config import Config
from narwhal.control.reload import reload_changes


def config(**sections: Any) -> Config:
    base: dict[str, Any] = {
        "model": "m",
        "engines": [{"id": "p0", "url": "http://10.0.0.1:8000", "role": "both"}],
    }
    return Config.model_validate({**base, **sections})


def test_flow_control_applies_to_new_requests() -> None:
    """The queue is resized and new limits apply (docs/flow.md, Reload); a wait that follows
    the request timeout follows it on reload too."""
    running = config(serving={"policy": "bounded", "request_timeout_s": 60})
    new = config(serving={"policy": "bounded", "request_timeout_s": 20}, flow={"queue_limit": 8})
    changes = reload_changes(running, new)
    assert {"flow.queue_limit", "flow.max_wait_s", "serving.request_timeout_s"} <= set(
        changes.applied
    )
    assert not [k for k in changes.restart_required if k.startswith("flow")]
    assert changes.config.flow.queue_limit == 8
    assert changes.config.flow.max_wait_s == 20


def test_sizes_built_at_start_wait_for_a_restart() -> None:
    changes = reload_changes(config(), config(serving={"queue_limit": 7, "max_connections": 9}))
    assert set(changes.restart_required) == {"serving.queue_limit", "serving.max_connections"}
    assert changes.config.serving.queue_limit == config().serving.queue_limit
