"""draftwise on Ray: the API and the verifier as Ray Serve fleets, and the bench on Ray workers.

One local Ray (2 CPUs, 127.0.0.1 only) serves the whole module; tiny models, greedy decoding
or fixed seeds, so every comparison is exact. The tests run in file order: the last one shuts
Ray down and checks that none of its processes is left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from draftwise.api.app import create_app
from draftwise.api.settings import ServerSettings
from draftwise.backends.tiny import tiny_lm
from draftwise.bench.config import BenchConfig
from draftwise.bench.report import _nodes_lines, nodes
from draftwise.bench.runner import RESULTS, Bench, run_bench
from draftwise.cluster import serve_app, verifier
from draftwise.cluster.bench import WORKER_PREFIX, measure_on_ray
from draftwise.cluster.fleet import REPORT_EVERY_S, served
from draftwise.cluster.runtime import NAMESPACE, ClusterError
from draftwise.config import DraftConfig, GenerationConfig
from draftwise.drafters import ModelDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.prepare import prepare_pair
from draftwise.remote.client import connect
from draftwise.remote.settings import VerifierSettings
from draftwise.scale import BenchWorkers, ServeScale

from ray_support import LocalRay, inet_sockets, is_loopback, needs_ray
from server_support import serve_in_background

pytestmark = [pytest.mark.ray, needs_ray]

KEY = {"authorization": "Bearer k"}
# Two replicas of half a CPU each: both fit on the 2-CPU Ray next to a bench worker.
TWO = ServeScale(replicas=2, cpus_per_replica=0.5)
API = ServerSettings(
    target="tiny:0",
    draft="tiny:1",
    api_key="k",
    max_body_bytes=4096,
    queue_size=4,
    generation=GenerationConfig(max_new_tokens=16),
)
FIXED = {"k_policy": "fixed", "k": 4, "confidence_threshold": 0.0}  # every step drafts: acceptances and corrections


def _wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:g} s"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRay]:
    local = LocalRay()
    try:
        yield local
    finally:
        local.stop()


# The API and the verifier both serve at "/" of the one Serve proxy: each fleet lives for its
# class of tests only.
@pytest.fixture(scope="class")
def api_fleet(cluster: LocalRay) -> Iterator[str]:
    settings = API.model_copy(update={"ray": TWO})
    with served(
        serve_app.ApiReplica,
        (settings,),
        serve_app.APP,
        "127.0.0.1",
        cluster.port,
        serve_app.api_options(settings, TWO),
    ) as url:
        cluster.track()
        yield url


@pytest.fixture(scope="module")
def api_single() -> Iterator[str]:
    pair = prepare_pair(API.target, API.draft, API.models, API.generation.draft, slots=API.slots)
    with serve_in_background(create_app(API, pair)) as url:
        yield url


# --- the API --------------------------------------------------------------------------------------

REQUESTS = [
    (
        "/v1/completions",
        {
            "prompt": "Once upon a time",
            "max_tokens": 24,
            "temperature": 0,
            "speculative": {"drafter": "model", "provenance": True, **FIXED},
        },
    ),
    ("/v1/completions", {"prompt": "1 2 3 4 1 2 3 4 1 2", "temperature": 0, "speculative": {"drafter": "ngram"}}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Say hello."}],
            "temperature": 0,
            "max_tokens": 20,
            "speculative": {"drafter": "hybrid", "provenance": True, **FIXED},
        },
    ),
    (
        "/v1/completions",
        {
            "prompt": "The cat sat",
            "temperature": 0.8,
            "seed": 7,
            "max_tokens": 20,
            "speculative": {"drafter": "model", "provenance": True, **FIXED},
        },
    ),
]


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    """What a response says about the generation, without ids, timestamps, timings and cache hits.

    How much of a prompt a replica finds cached depends on what that replica served last, and
    Serve picks the replica; the generation itself must not depend on it.
    """
    choice = body["choices"][0]
    usage = dict(body["usage"])
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < usage["prompt_tokens"]
    return {
        "text": choice.get("text", choice.get("message")),
        "finish": choice["finish_reason"],
        "usage": usage,
        "tokens": [t["id"] for t in body.get("provenance") or []],
        "sources": [t["source"] for t in body.get("provenance") or []],
    }


def _post(url: str, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny:0", **body}, headers=KEY, timeout=60, **kwargs)


def _streamed_text(url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    with httpx.stream(
        "POST", url + "/v1/completions", json={"model": "tiny:0", **body, "stream": True}, headers=KEY, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), lines


def _error(response: httpx.Response) -> tuple[int, Any]:
    return response.status_code, response.json()


def _samples(url: str) -> list[Any]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _total(samples: list[Any], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class TestApiFleet:
    """`serve --ray` with 2 replicas against a single-process server with the same settings."""

    def test_two_replicas_answer_exactly_as_one_process(self, api_fleet, api_single):
        for path, body in REQUESTS * 2:  # twice: both replicas are likely to serve some
            fleet, single = _post(api_fleet, path, body), _post(api_single, path, body)
            assert fleet.status_code == single.status_code == 200, fleet.text
            assert _answer(fleet.json()) == _answer(single.json())

    def test_streaming_through_the_proxy(self, api_fleet, api_single):
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "speculative": FIXED}
        text, lines = _streamed_text(api_fleet, body)
        assert lines[-1] == "data: [DONE]" and len(lines) > 3  # streamed in several chunks, not one
        assert (
            text
            == _streamed_text(api_single, body)[0]
            == _post(api_fleet, "/v1/completions", body).json()["choices"][0]["text"]
        )

    def test_errors_auth_and_limits_are_the_same(self, api_fleet, api_single):
        def answers(url: str) -> list[tuple[int, Any]]:
            return [
                _error(httpx.get(url + "/v1/models")),  # no key
                _error(httpx.get(url + "/v1/models", headers={"authorization": "Bearer wrong"})),
                _error(_post(url, "/v1/completions", {"model": "other", "prompt": "x"})),
                _error(_post(url, "/v1/completions", {"prompt": "x", "max_tokens": 0})),
                _error(_post(url, "/v1/completions", {"prompt": "x" * 5000})),  # over max_body_bytes
                _error(_post(url, "/v1/completions", {"prompt": "x", "speculative": {"k": -1}})),
                _error(httpx.get(url + "/v1/models", headers=KEY)),
            ]

        fleet, single = answers(api_fleet), answers(api_single)
        fleet[-1][1]["data"][0].pop("created")
        single[-1][1]["data"][0].pop("created")
        assert fleet == single
        assert [status for status, _ in fleet] == [401, 401, 404, 400, 413, 400, 200]
        assert httpx.get(api_fleet + "/health").json()["status"] == "ok"  # probes need no key

    def test_metrics_cover_the_fleet(self, cluster, api_fleet):
        time.sleep(2 * REPORT_EVERY_S)  # every replica has reported the requests of earlier tests
        before = _total(_samples(api_fleet), "draftwise_requests_total", endpoint="/v1/models", code="200")
        for _ in range(6):
            assert httpx.get(api_fleet + "/v1/models", headers=KEY).status_code == 200

        def counted() -> list[Any] | None:
            samples = _samples(api_fleet)
            total = _total(samples, "draftwise_requests_total", endpoint="/v1/models", code="200")
            return samples if total == before + 6 else None

        samples = _wait_for(counted, what="every replica's requests in /metrics")
        assert _total(samples, "draftwise_fleet_replicas") == 2
        live = {name.rsplit("#", 1)[1] for name in cluster.replicas(serve_app.APP)}
        assert {s.labels["replica"] for s in samples if s.name == "draftwise_requests_total"} == live

    def test_a_client_that_disconnects_cancels_its_generation(self, api_fleet):
        def cancelled() -> float:
            return _total(_samples(api_fleet), "draftwise_generations_cancelled_total", reason="disconnect")

        before = cancelled()
        body = {
            "model": "tiny:0",
            "prompt": "Once upon a time",
            "max_tokens": 3000,
            "temperature": 0,  # greedy: sampling could draw the end-of-text token and finish first
            "stream": True,
            "speculative": {"drafter": "off"},
        }
        with httpx.stream("POST", api_fleet + "/v1/completions", json=body, headers=KEY, timeout=60) as response:
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
        # Closed after one chunk: the replica stops generating long before 3000 tokens.
        _wait_for(lambda: cancelled() > before, what="a cancelled generation")
        _wait_for(
            lambda: _total(_samples(api_fleet), "draftwise_active_generations") == 0, what="no generation running"
        )

    def test_the_fleet_binds_loopback_only(self, cluster, api_fleet):
        sockets = inet_sockets(cluster.track())
        listening = [s for s in sockets if s[1] == "LISTEN"]
        assert listening  # Ray's own servers and Serve's proxy
        assert [s for s in listening if not is_loopback(s[2])] == []
        assert all(remote is None or is_loopback(remote) for *_, remote in sockets), sockets

    def test_requests_after_a_replica_is_killed_still_succeed(self, cluster, api_fleet, api_single):
        path, body = REQUESTS[0]
        expected = _answer(_post(api_single, path, body).json())
        victim = cluster.replicas(serve_app.APP)[0]
        cluster.kill(victim, namespace="serve")
        for _ in range(6):
            response = _post(api_fleet, path, body)
            assert response.status_code == 200, response.text
            assert _answer(response.json()) == expected


# --- the verifier ---------------------------------------------------------------------------------

CONFIG = GenerationConfig(max_new_tokens=40, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4))
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "hello world", "The cat sat on the mat."]


@pytest.fixture(scope="class")
def verifier_fleet(cluster: LocalRay) -> Iterator[str]:
    settings = VerifierSettings(target="tiny:0", ray=TWO)
    with served(
        verifier.VerifierReplica,
        (settings,),
        verifier.APP,
        "127.0.0.1",
        cluster.port,
        verifier.verifier_options(settings, TWO),
    ) as url:
        cluster.track()
        yield url


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(0), tiny_lm(1)


class TestVerifierFleet:
    """`serve-verifier --ray` with 2 replicas: sessions routed by ID, output as in one process."""

    def test_verifier_fleet_output_is_identical_to_local(self, verifier_fleet, pair):
        target, draft = pair
        for prompt in PROMPTS:
            local = SpeculativeEngine.from_models(target, draft).generate(prompt, CONFIG).tokens
            with connect(verifier_fleet, tokenizer=draft.tokenizer) as remote:
                assert remote.info.routing_header == verifier.ROUTING_HEADER
                result = SpeculativeEngine(remote, ModelDrafter(draft), tokenizer=draft.tokenizer).generate(
                    prompt, CONFIG
                )
            assert result.tokens == local
        health = _wait_for(
            lambda: (h := httpx.get(verifier_fleet + "/health").json()) and len(h["replicas"]) == 2 and h,
            what="both replicas in /health",
        )
        assert health["affinity"]["hits"] > 0
        assert health["affinity"]["hits"] == sum(r["affinity"]["hits"] for r in health["replicas"].values())

    def test_a_verifier_client_recovers_when_its_replica_is_killed(self, cluster, verifier_fleet, pair):
        target, draft = pair
        local = SpeculativeEngine.from_models(target, draft).generate(PROMPTS[0], CONFIG).tokens

        def holders() -> list[str]:
            replicas = httpx.get(verifier_fleet + "/health").json()["replicas"]
            return [replica for replica, health in replicas.items() if health["sessions"]]

        # Another replica's figures in /health are up to REPORT_EVERY_S old: wait until no replica
        # reports the earlier tests' closed sessions, so that the one holder seen below is this one's.
        _wait_for(lambda: not holders(), what="no open session in /health")
        with connect(verifier_fleet, tokenizer=draft.tokenizer) as remote:
            stream = SpeculativeEngine(remote, ModelDrafter(draft), tokenizer=draft.tokenizer).stream(
                PROMPTS[0], CONFIG
            )
            events = [next(stream)]
            # Two replicas can hold a session of this client: where Serve routed a verify before
            # it knew the session's replica, the client opened it again there, and the first
            # copy waits for eviction. Kill the holders one at a time until the client has had
            # to reopen its session.
            for victim in _wait_for(holders, what="the replica holding the session"):
                cluster.kill(f"SERVE_REPLICA::{verifier.APP}#VerifierReplica#{victim}", namespace="serve")
                events.append(next(stream))
                if remote.reopens:
                    break
            events += list(stream)
        assert [t for e in events for t in e.tokens] == local
        assert events[-1].finish_reason == "length"
        assert remote.reopens >= 1 and sum(e.extra.get("reopened", 0) for e in events) == remote.reopens


# --- the bench ------------------------------------------------------------------------------------

ROWS = [
    {"id": f"p{i}", "subtask": "ab"[i % 2], "prompt": f"The cat {i} sat on the mat. The cat sat on"} for i in range(5)
]


def _bench(tmp_path: Path, name: str, workers: int | None) -> BenchConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ray = None if workers is None else BenchWorkers(workers=workers, cpus_per_worker=0.5)
    return BenchConfig(
        target="tiny:0",
        draft="tiny:1",
        data=str(data),
        out=tmp_path / name,
        warmup=False,
        methods=("baseline", "model", "ngram"),
        generation=GenerationConfig(max_new_tokens=12),
        ray=ray,
    )


def _tokens(out: Path) -> dict[str, list[int]]:
    lines = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    keys = [r["key"] for r in lines]
    assert len(keys) == len(set(keys)), "a record was written twice"
    return {r["key"]: r["tokens"] for r in lines}


def test_bench_on_workers_gives_the_same_tokens_and_survives_a_killed_worker(cluster, tmp_path):
    local = _bench(tmp_path, "local", None)
    run_bench(local)
    one = _bench(tmp_path, "one", 1)
    run_bench(one, measure=measure_on_ray)
    killed: list[str] = []

    def kill_first_worker(record: dict[str, Any]) -> None:
        if not killed:  # its next prompt is then given to a dead worker: it must run elsewhere
            killed.append(record["node"]["worker"])
            cluster.kill(killed[0], namespace=NAMESPACE)

    two = _bench(tmp_path, "two", 2)
    bench = Bench(two)
    bench.run(on_record=kill_first_worker, measure=measure_on_ray)
    assert bench.retried_units >= 1 and killed[0].startswith(WORKER_PREFIX)
    expected = _tokens(local.out)
    assert len(expected) == len(ROWS) * 3
    assert _tokens(one.out) == expected
    assert _tokens(two.out) == expected  # nothing lost, nothing twice, the same tokens
    workers = {r["node"]["worker"] for r in bench.records()}
    assert len(workers) >= 2 and all(r["node"]["cpu"] and r["node"]["cores"] for r in bench.records())
    named = cluster.ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith(WORKER_PREFIX)]  # the workers are stopped


def test_a_worker_that_cannot_load_its_models_stops_the_bench_with_its_error(cluster, tmp_path):
    config = _bench(tmp_path, "broken", 1).model_copy(update={"draft": "no-such-model"})
    with pytest.raises(ClusterError, match="unknown model 'no-such-model'"):
        run_bench(config, measure=measure_on_ray)
    assert not (config.out / RESULTS).exists()


def test_the_report_says_when_nodes_differ():
    def record(prompt: str, host: str, cpu: str) -> dict[str, Any]:
        return {"prompt_id": prompt, "node": {"host": host, "cpu": cpu, "cores": 2, "cpu_flags": "avx2"}}

    same = [record("p1", "a", "Xeon"), record("p2", "a", "Xeon")]
    assert _nodes_lines(nodes(same)) == []
    mixed = [*same, record("p3", "b", "EPYC")]
    (line,) = _nodes_lines(nodes(mixed))
    assert "nodes differ" in line and "machines that differ" in line and "`b`: EPYC" in line


# --- last: shutdown -------------------------------------------------------------------------------


def test_shutdown_leaves_no_ray_process(cluster):
    assert cluster.track()  # Ray's processes were running
    assert cluster.stop() == []
