"""Fixtures of the attribution tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def write_log(tmp_path):
    """Write ``text`` (str or bytes) to a file under tmp_path and return its path."""

    def _write(text, name: str = "job.log") -> str:
        path = tmp_path / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return str(path)

    return _write


@pytest.fixture
def attr_root(tmp_path):
    root = tmp_path / "logs"
    root.mkdir()
    return root


@pytest.fixture
def start_server(tmp_path, attr_root):
    """start_server(**cfg_overrides) -> running ServerThread; all stopped at teardown."""
    from attr_data import ServerThread

    from trainguard.attribution import ServiceConfig
    from trainguard.testing import free_port

    servers = []

    def _start(**overrides):
        kwargs = {"allowed_roots": [str(attr_root)], "api_keys": ["k-secret-1"],
                  "db_url": f"sqlite:///{tmp_path / 'svc.db'}"}
        kwargs.update(overrides)
        srv = ServerThread(ServiceConfig(**kwargs), free_port()).start()
        servers.append(srv)
        return srv

    yield _start
    for srv in servers:
        srv.stop()
