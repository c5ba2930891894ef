"""Running the real ``draftwise`` command in a child process, as a user would: start it on a
free loopback port, wait until it answers, stop it the way Ctrl-C or ``kill`` would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CLI = [sys.executable, "-c", "from draftwise.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cli(*args: str, timeout: float = 600.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``draftwise ARGS`` to the end; stdout and stderr as text."""
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def run_cli_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``draftwise ARGS`` run in this process by typer's test runner, answered as ``run_cli``
    answers: for what a command says of its arguments before it loads anything, without a new
    interpreter's imports each time. An exception the command lets out is raised here (the
    real command would print its traceback), so that it fails the test."""
    from typer.testing import CliRunner

    from draftwise.cli import build_app

    result = CliRunner().invoke(build_app(), list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def wait_until_ready(process: subprocess.Popen, url: str, log: Path, timeout: float, expect: str | None = None) -> None:
    """Poll ``url`` until it answers 200 (and its body holds ``expect``); fail with the log if
    the process exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(
                f"{' '.join(map(str, process.args[3:]))} exited ({process.returncode}):\n"
                f"{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            answer = httpx.get(url, timeout=2.0, trust_env=False)
            if answer.status_code == 200 and (expect is None or expect in answer.text):
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            pytest.fail(f"{url} did not answer within {timeout:g} s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


def stop(process: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
    """Send ``sig`` to the process group (as a terminal's Ctrl-C would) and return the exit code;
    kill it if it does not stop in time."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"{' '.join(map(str, process.args[3:]))} did not stop within {timeout:g} s of signal {sig}")
    return process.returncode


@contextmanager
def cli_server(
    args: list[str],
    health_path: str,
    log: Path,
    port: int | None = None,
    startup_s: float = 600.0,
    expect: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``draftwise ARGS --port P`` in its own process group; yields (base URL, process) once
    ``health_path`` answers, and stops the group on exit."""
    port = port or free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [*CLI, *args, "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url + health_path, log, startup_s, expect)
        yield url, process
    finally:
        stop(process, signal.SIGTERM)
