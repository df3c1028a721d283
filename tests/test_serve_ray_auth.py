"""`specrs serve --ray --api-key KEY`: the ingress, the application's one HTTP entry point, requires
the key on every route but /health (one replica on a local Ray Serve, in the private network
namespace of test_serve_ray.py; slow to start, so one focused test)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("ray.serve")
from test_serve_ray import _healthy, _start, _stop, private_network  # noqa: E402,F401  (the namespace fixture)

KEY = "sk-ray-test-key"


def test_the_ingress_requires_the_api_key(tmp_path):
    proc, base = _start(["specrs.serve.ray", "--num-replicas", "1", "--replica-cpus", "1", "--api-key", KEY],
                        tmp_path / "server.log", _healthy(1))
    try:
        good = {"Authorization": f"Bearer {KEY}"}
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("GET", "/nowhere")):
                response = httpx.request(method, f"{base}{path}", json=body if method == "POST" else None,
                                         headers=headers, timeout=120)
                assert response.status_code == 401, (path, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        response = httpx.post(f"{base}/v1/completions", json=body, headers=good, timeout=120)
        assert response.status_code == 200, response.text
        assert httpx.get(f"{base}/v1/models", headers=good, timeout=30).status_code == 200
        assert httpx.get(f"{base}/metrics", headers=good, timeout=30).status_code == 200
    finally:
        _stop(proc)
