"""The shipped deploy/ configs, with ports and paths substituted so a test can run them on loopback."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def prometheus_config(folder: Path, targets: list[str], interval: str = "1s") -> Path:
    """deploy/prometheus/prometheus.yml scraping `targets` every `interval`."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = interval
    (job,) = cfg["scrape_configs"]
    job["static_configs"][0]["targets"] = targets
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def nginx_config(folder: Path, listen_port: int, upstream_ports: list[int]) -> Path:
    """deploy/nginx/quantkit.conf with its listen port and upstream servers replaced, inside a minimal
    nginx.conf whose pid, logs and temp files live in `folder`."""
    site = (DEPLOY / "nginx" / "quantkit.conf").read_text()
    servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+(.*);$", site, flags=re.M)
    assert servers, "deploy/nginx/quantkit.conf: no upstream server lines"
    lines = "\n".join(f"    server 127.0.0.1:{p}{servers[0]};" for p in upstream_ports)
    site = re.sub(r"(^\s*server 127\.0\.0\.1:\d+.*;\n)+", lines + "\n", site, flags=re.M)
    site, n = re.subn(r"listen 127\.0\.0\.1:\d+;", f"listen 127.0.0.1:{listen_port};", site)
    assert n == 1, "deploy/nginx/quantkit.conf: expected one `listen 127.0.0.1:PORT;`"
    (folder / "quantkit.conf").write_text(site)
    temp = "\n".join(f"    {kind}_temp_path {folder / kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main = (f"daemon off;\nworker_processes 1;\npid {folder / 'nginx.pid'};\nerror_log {folder / 'error.log'} warn;\n"
            f"events {{ worker_connections 1024; }}\n"
            f"http {{\n    access_log off;\n{temp}\n    include {folder / 'quantkit.conf'};\n}}\n")
    path = folder / "nginx.conf"
    path.write_text(main)
    return path
