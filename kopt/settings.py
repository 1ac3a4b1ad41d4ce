"""One Settings object, built in the CLI entry point from KOPT_* environment variables."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# host:port, the host a name, an IPv4 address or a bracketed IPv6 address
ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})")


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
    server_port: int = Field(7233, ge=0, le=65535)
    ui_port: int = Field(8233, ge=0, le=65535)
    artifact_dir: Path | None = None  # default: <home>/artifacts
    log_format: Literal["auto", "console", "json"] = "auto"
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    # The candidates' jail (containment/jail.py reads these two in every process that runs candidates;
    # here they are checked once, where a command starts). Off only with the escape hatch set to 1.
    allow_unsandboxed: Literal["0", "1"] = "0"
    sandbox: Literal["on", "off"] = "on"

    @field_validator("log_level", "log_format", "sandbox", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("sandbox")
    @classmethod
    def _sandbox_off_needs_the_hatch(cls, value: str, info: ValidationInfo) -> str:
        if value == "off" and info.data.get("allow_unsandboxed") != "1":
            raise ValueError("the sandbox is off only with KOPT_ALLOW_UNSANDBOXED=1 as well (candidates then run "
                             "with your rights: for benchmarks and hosts without namespaces)")
        return value

    @field_validator("temporal_address")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        m = ADDRESS.fullmatch(value.strip())
        if m is None or not 0 < int(m.group(1)) <= 65535:
            raise ValueError("expected HOST:PORT, e.g. temporal.example.com:7233 or 127.0.0.1:7233")
        return value.strip()

    @field_validator("home")
    @classmethod
    def _usable_home(cls, value: Path) -> Path:
        """A home that exists is a directory; one that does not is made below a directory (when it is
        first used)."""
        value = value.expanduser()
        if value.exists() and not value.is_dir():
            raise ValueError(f"{value} is not a directory")
        return value

    @property
    def artifacts(self) -> Path:
        return self.artifact_dir or self.home / "artifacts"

    @property
    def server_db(self) -> Path:
        return self.home / "temporal.db"

    @property
    def work_dir(self) -> Path:
        return self.home / "work"
