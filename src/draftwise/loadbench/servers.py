"""The servers under load: their command lines, and running one as a child process.

Every server is started on 127.0.0.1 on a free port, in a process group of its own (so a
stop reaches whatever it started), with its output in a log file; it counts as ready once
``/health`` answers 200 (llama-server answers 503 while it loads its model).

* ``draftwise``: ``draftwise serve --slots C``: C generations whose forward passes share one
  llama.cpp batch. ``draftwise-noprediction`` is the same server, asked without the edit
  tasks' predictions.
* ``llama-server``: llama.cpp's own server on the same GGUF file, ``-np C`` slots, each with
  the same context as a draftwise slot (``-c`` is the total).
* ``llama-server-spec``: the same with its own speculation, ``-md DRAFT --spec-type draft-simple``.
* ``llama-server-ngram-simple`` / ``llama-server-ngram-mod``: the same with its draft-model-free
  speculation, ``--spec-type ngram-simple`` / ``ngram-mod`` (n-grams of the prompt and the
  output so far), at llama.cpp's own settings for them.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from draftwise.api.settings import ServerSettings
from draftwise.config import SuffixConfig
from draftwise.loadbench.config import DRAFTWISE_SERVERS, LLAMA_SERVERS, NONE, LoadConfig, LoadError

HOST = "127.0.0.1"
CLI = [sys.executable, "-c", "from draftwise.cli import main; main()"]
LLAMA_SERVER = "llama-server"
HEALTH = "/health"
STOP_WAIT_S = 60.0  # SIGTERM, then this long before SIGKILL
POLL_S = 0.5


@dataclass(frozen=True)
class Server:
    """A server to measure: its name in the report, its command line (without host and
    port), and the model id requests name."""

    name: str
    argv: tuple[str, ...]
    model: str

    @property
    def shown(self) -> str:
        """The command line as a user would type it (``draftwise serve ...``, not python -c)."""
        if self.argv[: len(CLI)] == tuple(CLI):
            return shlex.join(["draftwise", *self.argv[len(CLI) :]])
        return shlex.join(self.argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def gguf(source: str, role: str) -> Path:
    """The GGUF file of a model source (a pulled registry name or a path), for llama-server."""
    from draftwise.loading import resolve

    location = resolve(source)  # a registry name not pulled yet: one line saying how to pull it
    if not isinstance(location, Path) or location.suffix != ".gguf" or not location.is_file():
        raise LoadError(f"llama-server runs .gguf files: the {role} {source} is not one")
    return location


def llama_server_binary(config: LoadConfig) -> Path:
    folder = config.llama_cpp_bin
    binary = Path(folder or ".") / LLAMA_SERVER
    if not binary.is_file():
        raise LoadError(f"no {LLAMA_SERVER} in {folder} (`make llama-cpp-bin` builds it)")
    return binary


def draftwise_settings(config: LoadConfig, slots: int, name: str = "draftwise") -> ServerSettings:
    """``draftwise serve``'s settings with ``slots`` slots, the run's models, threads and context
    (``name``: draftwise; draftwise-noprediction, the same server whose clients send no
    prediction; draftwise-off, the same server decoding plainly; or draftwise-nosuffix, the
    same server drafting from nothing earlier requests wrote). A started server gets them as
    flags (``draftwise_server``), an in-process one as they are."""
    drafter = "off" if name == "draftwise-off" else config.drafter
    suffix = SuffixConfig(scope="none") if name == "draftwise-nosuffix" else SuffixConfig()
    return ServerSettings(
        target=config.target,
        draft=config.draft_model,
        drafter=drafter,
        slots=slots,
        queue_size=slots,
        request_timeout=config.request_timeout,
        models=config.models.model_copy(update={"threads": config.threads, "context": config.context}),
        suffix=suffix,
    )


def draftwise_server(config: LoadConfig, slots: int, name: str = "draftwise") -> Server:
    """``draftwise serve`` started with ``draftwise_settings`` as its flags."""
    settings = draftwise_settings(config, slots, name)
    models = settings.models
    argv = [*CLI, "serve", "--target", settings.target, "--slots", str(slots), "--queue-size", str(slots)]
    argv += ["--threads", str(models.threads), "--context", str(models.context)]
    argv += ["--timeout", f"{settings.request_timeout:g}"]
    if settings.draft is not None:
        argv += ["--draft", settings.draft]
    if settings.drafter is not None:
        argv += ["--drafter", settings.drafter]
    if settings.suffix.scope != SuffixConfig().scope:
        argv += ["--suffix-scope", settings.suffix.scope]
    for field, value in models.model_dump(exclude_defaults=True, exclude={"threads", "context"}).items():
        # `draftwise serve` spells every ModelOptions field as its flag, without an alias (a test
        # checks these against serve's flags); spelt here so this layer does not import the CLI.
        flag = field.replace("_", "-")
        argv += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return Server(name, tuple(argv), settings.served_model)


def draft_model_args(config: LoadConfig) -> list[str]:
    """llama-server-spec's speculation: the draft model's GGUF file, drafting as draftwise's
    defaults do unless told (``--spec-draft-*``)."""
    draft = config.draft_model
    if draft is None:
        raise LoadError("llama-server-spec needs a draft model (--draft)")
    threads = str(config.threads)
    argv = ["-md", str(gguf(draft, "draft")), "--spec-type", "draft-simple"]
    argv += ["--spec-draft-n-max", str(config.spec_draft_n_max), "--spec-draft-n-min", str(config.spec_draft_n_min)]
    argv += ["--spec-draft-p-min", str(config.spec_draft_p_min), "-td", threads, "-tbd", threads]
    return argv + gpu_layer_args(config, "-ngld")


def gpu_layer_args(config: LoadConfig, flag: str) -> list[str]:
    """llama-server's layers on the GPU (``flag``: ``-ngl``, or ``-ngld`` for the draft) as
    draftwise's ``--device`` puts them: every one on cuda, none on cpu; on auto, llama.cpp's own
    auto, which like draftwise's takes a GPU where it finds one."""
    device = config.models.device
    return [] if device == "auto" else [flag, "all" if device == "cuda" else "0"]


def speculation_args(config: LoadConfig, name: str) -> list[str]:
    """The speculation flags of llama-server configuration ``name``: none, a draft model, or
    llama.cpp's n-gram drafting (``--spec-type ngram-simple`` / ``ngram-mod``, its defaults)."""
    if name == "llama-server":
        return []
    if name == "llama-server-spec":
        return draft_model_args(config)
    if name in ("llama-server-ngram-simple", "llama-server-ngram-mod"):
        return ["--spec-type", name.removeprefix("llama-server-")]
    raise LoadError(f"unknown llama-server configuration {name}")


def llama_server(config: LoadConfig, slots: int, name: str = "llama-server") -> Server:
    """llama-server with ``slots`` slots of ``config.context`` positions each, speculating as
    configuration ``name`` says (``speculation_args``)."""
    threads = str(config.threads)
    argv = [str(llama_server_binary(config)), "-m", str(gguf(config.target, "target"))]
    argv += ["-t", threads, "-tb", threads, "-np", str(slots), "-c", str(config.context * slots)]
    argv += gpu_layer_args(config, "-ngl")
    if config.structured != NONE:
        argv.append("--jinja")  # tools and their calls go through the model's own chat template
    return Server(name, tuple(argv + speculation_args(config, name)), config.target)


def server_for(name: str, config: LoadConfig, slots: int) -> Server:
    if name in DRAFTWISE_SERVERS:
        return draftwise_server(config, slots, name)
    if name in LLAMA_SERVERS:
        return llama_server(config, slots, name)
    raise LoadError(f"unknown server {name}")


def _last_line(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "no output"


def wait_healthy(name: str, process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Until ``url``/health answers 200; a LoadError if the process exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise LoadError(f"{name} exited ({process.returncode}) before it was ready: {_last_line(log)} (log: {log})")
        try:
            if httpx.get(url + HEALTH, timeout=5.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise LoadError(f"{url}{HEALTH} did not answer 200 within {timeout:g} s (log: {log})")
        time.sleep(POLL_S)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL if it is still there after STOP_WAIT_S."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def running(server: Server, log: Path, startup_timeout: float) -> Iterator[str]:
    """``server`` on a free loopback port; yields its base URL once healthy, stops it on exit."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        try:
            process = subprocess.Popen(
                [*server.argv, "--host", HOST, "--port", str(port)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            raise LoadError(f"cannot run {server.argv[0]}: {exc.strerror}") from None
    try:
        url = f"http://{HOST}:{port}"
        wait_healthy(server.name, process, url, log, startup_timeout)
        yield url
    finally:
        stop(process)


def served_model(url: str) -> str:
    """The first model id a running server lists at /v1/models."""
    import httpx

    try:
        answer = httpx.get(url + "/v1/models", timeout=30.0, trust_env=False)
        return str(answer.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise LoadError(f"{url}/v1/models names no model: is it an OpenAI-compatible server?") from None


def llama_server_version(config: LoadConfig) -> str | None:
    """What ``llama-server --version`` says (its build number and commit), if it runs."""
    try:
        done = subprocess.run(
            [str(llama_server_binary(config)), "--version"], capture_output=True, text=True, timeout=60
        )
    except (LoadError, OSError, subprocess.TimeoutExpired):
        return None
    lines = [x.strip() for x in (done.stdout + done.stderr).splitlines() if x.strip().startswith("version")]
    return lines[0].removeprefix("version:").strip() if lines else None
