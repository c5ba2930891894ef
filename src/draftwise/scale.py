"""Scale-out settings the servers and the bench share, below every service that reads them.

How a server or the bench spreads over Ray (``--ray``, ``--ray-address``, ``--replicas`` and
the rest) is one source of truth here. The settings hang off the ones they extend
(``ServerSettings.ray``, ``VerifierSettings.ray``, ``BenchConfig.ray``); ``None`` there means
one process. They live in the config layer, not in ``draftwise.cluster``, so that the
one-process servers can name them without importing the Ray code above them.

Plain pydantic: importing this module does not need Ray.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The environment variable `draftwise serve` reads its API key from, and the dashboard its
# client's: here, below both, so the dashboard need not import the API server for a name.
API_KEY_ENV = "DRAFTWISE_API_KEY"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RayOptions(_Strict):
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join (the address `ray start --head` printed, e.g. 10.0.0.5:6379); "
        "default: a local Ray on this machine, bound to 127.0.0.1",
    )


class ServeScale(RayOptions):
    """How many replicas of a server Ray Serve runs (each loads the models once)."""

    replicas: int = Field(1, ge=1, le=1024, description="replicas (with --ray); each loads the models once")
    min_replicas: int | None = Field(
        None, ge=0, le=1024, description="autoscaling: fewest replicas (with --max-replicas); replaces --replicas"
    )
    max_replicas: int | None = Field(
        None, ge=1, le=1024, description="autoscaling: most replicas (with --min-replicas)"
    )
    cpus_per_replica: float = Field(
        1.0, gt=0, description="CPUs Ray reserves per replica (Ray also sizes its thread pools to this)"
    )

    @model_validator(mode="after")
    def _check_range(self) -> ServeScale:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"--min-replicas ({self.min_replicas}) exceeds --max-replicas ({self.max_replicas})")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None


class BenchWorkers(RayOptions):
    """The bench's Ray actors: each loads the models once and runs whole prompts."""

    workers: int = Field(1, ge=1, le=1024, description="bench workers (Ray actors), each loading the models once")
    cpus_per_worker: float = Field(
        1.0,
        gt=0,
        description="CPUs Ray reserves per worker; one worker per node keeps nodes' timings apart",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="tries per prompt before the bench gives up (a worker that dies has its prompt retried on another)",
    )
