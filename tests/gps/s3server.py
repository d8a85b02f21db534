"""A local S3-compatible server for the tests (moto's, from PyPI via the dev extra), bound to 127.0.0.1.

`s3_endpoint()` starts it once per test process and points botocore at it through the standard
environment (`AWS_ENDPOINT_URL`, fake credentials), which child processes inherit; tests skip with the
reason only when moto or s3fs is missing or the server cannot start.
"""

from __future__ import annotations

import os
import uuid

import pytest

_SERVER: dict[str, object] = {}


def s3_endpoint() -> str:
    if "url" in _SERVER:
        return str(_SERVER["url"])
    try:
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        pytest.skip(f"S3 tests need moto[server] and s3fs (the dev extra: `make setup`): {exc}")
    try:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
    except Exception as exc:  # pragma: no cover - environment-specific
        pytest.skip(f"the moto S3 server could not start on 127.0.0.1: {type(exc).__name__}: {exc}")
    url = f"http://{host}:{port}"
    os.environ.update({
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    })
    _SERVER.update(server=server, url=url)
    return url


def new_bucket() -> str:
    """A fresh bucket; returns its s3:// URL."""
    import s3fs

    s3_endpoint()
    name = f"pivotrl-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return f"s3://{name}"
