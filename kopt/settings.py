"""One Settings object, built in the CLI entry point from KOPT_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    # An empty variable is an unset one: `KOPT_HOME= kopt runs` (or a CI template that leaves it
    # blank) means the default home, not the current directory.
    model_config = SettingsConfigDict(env_prefix="KOPT_", extra="ignore", env_ignore_empty=True)

    home: Path = Field(default_factory=lambda: Path.home() / ".kopt")
    # No address: the embedded default (a local dev server started by kopt).
    temporal_address: str | None = None
    namespace: str = "default"
    temporal_tls: bool = False
    temporal_api_key_env: str | None = None  # name of the env var holding the API key, never the key
    # Embedded dev server ports (0 = pick free ports).
    server_port: int = 7233
    ui_port: int = 8233
    artifact_dir: Path | None = None  # default: <home>/artifacts
    log_format: str = "auto"  # auto | console | json
    log_level: str = "info"

    @property
    def artifacts(self) -> Path:
        return self.artifact_dir or self.home / "artifacts"

    @property
    def server_db(self) -> Path:
        return self.home / "temporal.db"

    @property
    def work_dir(self) -> Path:
        return self.home / "work"
