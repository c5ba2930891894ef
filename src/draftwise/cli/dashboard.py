"""``draftwise dashboard``: the live Streamlit dashboard, with a local API server when none is given.

Flags derive from ``DashboardSettings`` and ``ModelOptions`` (``draftwise.cli.options.with_flags``).

Without ``--api-url`` it starts ``draftwise serve`` (on a free loopback port, with the given
or default models) as a child process, waits for its ``/health``, then runs ``streamlit run``
on the dashboard page; both children stop when the command stops.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from draftwise.cli.options import Flags, aliases_of, built, with_flags, with_model_options
from draftwise.config import ModelOptions
from draftwise.dashboard.settings import DashboardSettings
from draftwise.errors import ConfigError, DraftwiseError

HEALTH_POLL_S = 0.5
PAGE = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"


class LocalServerError(DraftwiseError):
    """The local API server the dashboard started stopped, or did not answer in time."""

    exit_code = 1  # the models may be missing, but so may be memory or a port: not necessarily the user's input


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _stop(process: subprocess.Popen[Any] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _spawn_server(args: list[str], host: str, log: Path) -> tuple[subprocess.Popen[Any], str]:
    """Start ``draftwise serve`` with ``args`` on a free port; return the process and its URL."""
    port = _free_port(host)
    command = [
        sys.executable,
        "-c",
        "from draftwise.cli import main; main()",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        *args,
    ]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return process, f"http://{host}:{port}"


def _wait_healthy(process: subprocess.Popen[Any], url: str, log: Path, timeout: float, what: str) -> None:
    """Wait until the server answers /health; fail with its last words if it stops first."""
    import httpx
    from rich.console import Console

    deadline = time.monotonic() + timeout
    with Console(stderr=True).status(f"starting the API server ({what}) ..."):
        while True:
            if process.poll() is not None:
                raise LocalServerError(
                    f"the local API server stopped: {_last_line(log)} (pull the models with "
                    "`draftwise pull default`, or try the dashboard on tiny random models: "
                    "--target tiny:0 --draft tiny:1)"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet: the models are still loading
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"the local API server did not answer within {timeout:g} s (last output: {_last_line(log)})"
                )
            time.sleep(HEALTH_POLL_S)


def _local_flags(
    target: str | None, draft: str | None, drafter: str | None, models_given: dict[str, Any] | None
) -> dict[str, Any]:
    """The flags handed on to the local `draftwise serve`, as given."""
    local = {
        name: value for name, value in (("target", target), ("draft", draft), ("drafter", drafter)) if value is not None
    }
    local.update({name.replace("_", "-"): value for name, value in (models_given or {}).items()})
    return local


def _check(api_url: str | None, local: dict[str, Any]) -> None:
    """Refuse what cannot work before anything starts."""
    import importlib.util

    if importlib.util.find_spec("streamlit") is None:
        raise DraftwiseError("the dashboard needs streamlit: pip install 'draftwise[dashboard]'")
    if api_url is not None and local:
        raise ConfigError(
            f"{', '.join('--' + name for name in local)} configure the local API server; with "
            "--api-url the server is already running"
        )


def _page(api_url: str, host: str, port: int, bench: Path | None) -> None:
    """Run the Streamlit page against ``api_url`` until it stops."""
    from draftwise.dashboard.client import API_URL_ENV
    from draftwise.dashboard.page import BENCH_DIR_ENV

    env = {**os.environ, API_URL_ENV: api_url}
    if bench is not None:
        env[BENCH_DIR_ENV] = str(bench.resolve())
    typer.echo(f"dashboard: http://{host}:{port}  (API: {api_url}; Ctrl-C stops)", err=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(PAGE),
            "--server.address",
            host,
            "--server.port",
            str(port),
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
            "--server.fileWatcherType",
            "none",
            "--client.toolbarMode",
            "minimal",
        ],
        env=env,
        check=False,
    )


def _warn_if_unhealthy(api_url: str) -> None:
    from draftwise.dashboard.client import ApiClient, DashboardApiError

    try:
        ApiClient(api_url).health()
    except DashboardApiError as exc:
        typer.echo(f"warning: {exc}", err=True)


def _run(
    api_url: str | None, local: dict[str, Any], host: str, port: int, bench: Path | None, startup_timeout: float
) -> None:
    """Start the local API server unless ``api_url`` is given, then the page; stop both at the end."""
    # A plain `kill` must still stop the children: turn SIGTERM into a normal exit.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = None
    with tempfile.TemporaryDirectory(prefix="draftwise-dashboard-") as tmp:
        try:
            if api_url is None:
                args = [f"--{name}={value}" for name, value in local.items()]
                log = Path(tmp) / "serve.log"
                server, api_url = _spawn_server(args, host, log)
                _wait_healthy(server, api_url, log, startup_timeout, " ".join(args) or "default models")
            else:
                _warn_if_unhealthy(api_url)
            _page(api_url, host, port, bench)
        except KeyboardInterrupt:
            pass
        finally:
            _stop(server)
            signal.signal(signal.SIGTERM, previous)


FLAGS = (Flags(DashboardSettings),)


def register(app: typer.Typer) -> None:
    @app.command()
    @with_model_options()
    @with_flags(*FLAGS)
    def dashboard(
        given: dict[Any, dict[str, Any]],
        models: ModelOptions = ModelOptions(),
        models_given: dict | None = None,
    ) -> None:
        """Live dashboard: watch the drafter and the target token by token, compare with the plain target,
        browse bench reports (Streamlit; opens at http://HOST:PORT)."""
        settings = built(DashboardSettings, aliases=aliases_of(*FLAGS), **given[DashboardSettings])
        local = _local_flags(settings.target, settings.draft, settings.drafter, models_given)
        _check(settings.api_url, local)
        _run(settings.api_url, local, settings.host, settings.port, settings.bench, settings.startup_timeout)
