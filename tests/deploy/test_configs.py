"""The Prometheus and nginx files pass their own tools' checks (the live runs are in tests/serve)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from tests_support.deploy_configs import nginx_config, prometheus_config


def tool(name: str, package: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if path is None:
        pytest.skip(f"{name} not installed (Debian package `{package}`; .ci/run installs it)")
    return path


def test_prometheus_config_checks(tmp_path):
    promtool = tool("promtool", "prometheus")
    path = prometheus_config(tmp_path, ["127.0.0.1:9"])
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


def test_nginx_config_checks(tmp_path):
    nginx = tool("nginx", "nginx")
    path = nginx_config(tmp_path, 9, [10, 11, 12])
    text = (tmp_path / "quantkit.conf").read_text()
    assert text.count("server 127.0.0.1:1") == 3 and "least_conn" in text and "proxy_buffering off" in text
    done = subprocess.run([nginx, "-t", "-c", str(path), "-e", str(tmp_path / "error.log")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
