"""Shared fixtures: simulated engines as processes, and an in-loop router."""

from tests.support.etcd import etcd_server
from tests.support.http import http
from tests.support.router import start_router
from tests.support.sim_process import sim_factory

__all__ = ["etcd_server", "http", "sim_factory", "start_router"]
