"""`serve:` what the serve stage measures on the exported model before it hands it over."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class ServeConfig(Section):
    """A short load test through the real HTTP server (like `eightfold bench serve`), so the stage's
    artifact, MLflow and the report carry serving latency: TTFT, TPOT, ITL, end to end."""

    load_requests: int = Field(32, ge=0, description="requests of the load test; 0 skips it")
    load_concurrency: int = Field(8, ge=1, description="requests in flight at once")
    load_input_len: int = Field(64, ge=1, description="prompt tokens per request (±25%; both lengths shrink to fit "
                                                     "the model's context)")
    load_output_len: int = Field(32, ge=1, description="generated tokens per request (±25%)")
    threads: int | None = Field(None, ge=1, description="the server's torch threads (default: torch's)")
