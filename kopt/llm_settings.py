"""Settings of the `openai` agent provider, from KOPT_OPENAI_* environment variables.

Any OpenAI-compatible chat-completions endpoint works: api.openai.com, Azure OpenAI's v1 API
(https://<resource>.openai.azure.com/openai/v1/), vLLM, SGLang, Ollama (http://host:11434/v1).
KOPT_OPENAI_BASE_URL names it; where unset, the SDK's OPENAI_BASE_URL is used.
Dicts are JSON in the environment, e.g.

    KOPT_OPENAI_ROLES='{"coder": {"model": "gpt-4.1", "temperature": 0.0}}'
    KOPT_OPENAI_PRICES='{"gpt-4.1": [2.0, 8.0]}'     # USD per 1M input, output tokens

The key itself is never a setting: `api_key_env` names the variable that holds it (empty for
servers that need no key), and only the agent worker reads it, inside each call.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kopt.agent_models import ENV_PREFIX, LLMConfig, RoleOverride, check_roles

_DEFAULTS = LLMConfig()


class LLMSettings(BaseSettings):
    # KOPT_OPENAI_TEMPERATURE=none: send no temperature (models that accept only their default).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", env_parse_none_str="none")

    # The OpenAI SDK's own OPENAI_BASE_URL (what vLLM/SGLang docs tell users to set) is the fallback.
    base_url: str = Field(default=_DEFAULTS.base_url,
                          validation_alias=AliasChoices(f"{ENV_PREFIX}BASE_URL", "OPENAI_BASE_URL"))
    model: str = _DEFAULTS.model
    api_key_env: str = _DEFAULTS.api_key_env
    timeout_s: float = Field(default=_DEFAULTS.timeout_s, gt=0)
    temperature: float | None = _DEFAULTS.temperature
    max_output_tokens: int = Field(default=_DEFAULTS.max_output_tokens, gt=0)
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = _DEFAULTS.max_tokens_param
    json_mode: bool = _DEFAULTS.json_mode
    roles: dict[str, RoleOverride] = Field(default_factory=dict)
    prices: dict[str, tuple[float, float]] = Field(default_factory=dict)

    @field_validator("roles")
    @classmethod
    def _known_roles(cls, roles: dict[str, RoleOverride]) -> dict[str, RoleOverride]:
        return check_roles(roles)


def llm_config(settings: LLMSettings) -> LLMConfig:
    """The settings as the small, secret-free model a workflow request can carry."""
    return LLMConfig.model_validate(settings.model_dump())
