"""Where a server's CPU goes under load: start a server, drive it with `draftwise load --url`,
and print each of its threads' CPU seconds over the run, its process total, and (for
draftwise) its drafting counters from /metrics.

    python benchmarks/load_profile_amd/server_threads.py NAME PORT CLIENTS SERVER-KIND -- COMMAND...

NAME labels the run (results go to /tmp/load_NAME), SERVER-KIND is the name `draftwise load`
reports (draftwise or llama-server), COMMAND starts the server on 127.0.0.1:PORT. With
PERF=1 in the environment, `perf record -F 199` samples the server over the run into
/tmp/perf_NAME.data.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

COUNTERS = ("draftwise_draft_tokens", "draftwise_generated", "draftwise_target_passes", "draftwise_pass_rows")


def thread_seconds(pid: int) -> dict[str, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of ``pid``, by thread id, with its name."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat, open(f"/proc/{pid}/task/{tid}/comm") as comm:
                fields = stat.read().rsplit(")", 1)[1].split()
                out[tid] = (comm.read().strip(), (int(fields[11]) + int(fields[12])) / tick)
        except OSError:
            continue  # the thread ended meanwhile
    return out


def wait_healthy(url: str, seconds: int = 600) -> None:
    for _ in range(seconds):
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} never answered /health")


def counters(url: str) -> list[str]:
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    except OSError:
        return []  # llama-server has no such endpoint unless told
    lines = text.splitlines()
    return [line for line in lines if line.startswith(COUNTERS) and not any(s in line for s in ("_created", "_bucket"))]


def main() -> None:
    name, port, clients, kind = sys.argv[1:5]
    command = sys.argv[6:] if sys.argv[5] == "--" else sys.argv[5:]
    url = f"http://127.0.0.1:{port}"
    with open(f"/tmp/server_{name}.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url)
        before, started = thread_seconds(server.pid), time.time()
        perf = None
        if os.environ.get("PERF"):
            argv = ["perf", "record", "-F", "199", "-p", str(server.pid), "-o", f"/tmp/perf_{name}.data"]
            perf = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        load = ["draftwise", "load", "--url", url, "--servers", kind, "--concurrency", clients, "--limit", "2"]
        subprocess.run([*load, "--no-audit", "--no-progress", "--out", f"/tmp/load_{name}"], check=True)
        wall, after = time.time() - started, thread_seconds(server.pid)
        if perf is not None:
            perf.send_signal(2)
            perf.wait(60)
        print("\n".join(counters(url)))
    finally:
        server.terminate()
        server.wait(30)
    used = sorted(((seconds - before.get(tid, ("", 0.0))[1], label) for tid, (label, seconds) in after.items()))
    used.reverse()
    total = sum(seconds for seconds, _ in used)
    print(f"{name}: wall {wall:.1f} s; threads: " + ", ".join(f"{label} {seconds:.1f}" for seconds, label in used[:6]))
    print(f"{name}: CPU {total:.1f} s = {total / wall:.2f} cores")


if __name__ == "__main__":
    main()
