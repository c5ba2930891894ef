"""``--ray`` from the command line: a real ``draftwise serve --ray`` in its own process (its own
local Ray on 127.0.0.1), stopped as ``kill`` would; and the one-line error without Ray."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import psutil
import pytest

from cli_support import cli_server, run_cli
from ray_support import inet_sockets, is_loopback, needs_ray

pytestmark = pytest.mark.ray


@needs_ray
def test_serve_ray_serves_and_stops_cleanly(tmp_path: Path):
    log = tmp_path / "serve.log"
    args = [
        "serve",
        "--ray",
        "--replicas",
        "2",
        "--cpus-per-replica",
        "0.5",
        "--target",
        "tiny:0",
        "--draft",
        "tiny:1",
        "--max-tokens",
        "8",
    ]
    with cli_server(args, "/health", log, startup_s=300, env={"OMP_NUM_THREADS": "1"}) as (url, process):
        deadline = time.monotonic() + 60
        while "serving tiny:0" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        answer = httpx.post(url + "/v1/completions", json={"model": "tiny:0", "prompt": "Once upon a time"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        assert len(ray_processes) > 3  # Ray's own, Serve's and the replicas
        listening = [s for s in inet_sockets(ray_processes) if s[1] == "LISTEN"]
        assert listening and [s for s in listening if not is_loopback(s[2])] == []
    # cli_server stopped it with SIGTERM to its process group, as `kill` or a terminal would.
    assert process.returncode == 0, log.read_text()[-2000:]
    assert "Traceback" not in log.read_text()
    deadline = time.monotonic() + 30
    while alive := [p for p in ray_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"left behind: {[p.name() for p in alive]}"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "--target", "tiny:0", "--ray"],
        ["serve-verifier", "--target", "tiny:0", "--ray", "--replicas", "2"],
        ["bench", "--target", "tiny:0", "--draft", "tiny:0", "--ray", "--workers", "2"],
    ],
)
def test_ray_flags_without_ray_are_one_line_saying_how_to_install(tmp_path: Path, command: list[str]):
    # A `ray` package that cannot be imported, ahead of the real one (if any) on the path.
    fake = tmp_path / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    path = os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])
    result = run_cli(
        *command,
        "--out" if command[0] == "bench" else "--port",
        str(tmp_path / "out") if command[0] == "bench" else "0",
        timeout=120,
        env={"PYTHONPATH": path},
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --ray needs Ray, which is not installed: pip install 'draftwise[ray]'"]
    assert "Traceback" not in result.stderr


def test_cluster_flags_need_ray():
    result = run_cli("serve", "--target", "tiny:0", "--replicas", "2", timeout=60)
    assert result.returncode == 2 and "--replicas only applies with --ray" in result.stderr
