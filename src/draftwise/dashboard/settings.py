"""The dashboard command's settings: which API it watches (or which models a local one runs), and
where the page listens. ``draftwise dashboard`` derives its flags from these fields; the model
flags (``--backend``, ``--threads``, ...) are ``ModelOptions``'.

Plain pydantic: importing this module starts nothing and needs no Streamlit.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from draftwise.config import DrafterName


class DashboardSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_url: str | None = Field(
        None, description="URL of a running draftwise API (`draftwise serve`); None = start one here"
    )
    target: str | None = Field(
        None, description="target model of the local API server; None = `draftwise serve`'s (the default pair)"
    )
    draft: str | None = Field(None, description="draft model of the local API server")
    drafter: DrafterName | None = Field(None, description="default drafter of the local API server")
    host: str = Field("127.0.0.1", description="address of the dashboard page (and of the local API server)")
    port: int = Field(8501, ge=0, le=65535, description="port of the dashboard page")
    bench: Path | None = Field(None, description="`draftwise bench` output folder to open in the report view")
    startup_timeout: float = Field(
        900.0, gt=0, description="seconds to wait for the local API server (a first GGUF load converts the weights)"
    )
