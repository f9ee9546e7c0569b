"""A judge named as ART names it (`"openai/o4-mini"`, `"anthropic/..."`, `"openrouter/..."`,
`"hosted_vllm/..."`), reached through LiteLLM with ART's `extra_litellm_params`.

`LiteLLMJudge` has the face of an `openai.AsyncOpenAI` client that RULER uses
(`chat.completions.create(**request)`, `models.list()`), so RULER treats every judge alike:
`create` is `litellm.acompletion(**request, caching=False, **extra_litellm_params)`, the
caller's parameters winning over RULER's own (`temperature`, `max_tokens`, `response_format`).
When `extra_litellm_params` name an `api_base` of an OpenAI-compatible provider (`openai/`,
`hosted_vllm/`, `litellm_proxy/`: ART's pattern for a local judge), `models.list()` asks that
server's `/v1/models`, so a judge served by tempering is recognised (and held to RULER's answer
schema); for other providers there is no such route. LiteLLM is the `ruler` extra
(`pip install 'tempering[ruler]'`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..errors import ConfigError, MissingDependencyError

__all__ = ["LiteLLMJudge", "import_litellm"]

OPENAI_COMPATIBLE = ("openai", "hosted_vllm", "litellm_proxy")
"""LiteLLM providers that speak to an OpenAI-compatible server at `api_base`."""


def import_litellm() -> Any:
    """The `litellm` module.

    Raises:
        MissingDependencyError: naming the extra that installs it.
    """
    try:
        import litellm
    except ImportError:
        raise MissingDependencyError(
            "RULER reaches a judge named as ART names it (a provider-prefixed judge_model such as 'openai/o4-mini', "
            "or extra_litellm_params) through LiteLLM, which is not installed: pip install 'tempering[ruler]' "
            "(or pass client= or base_url= for an OpenAI-compatible endpoint)") from None
    return litellm


class LiteLLMJudge:
    """`judge_model` through LiteLLM, with the face of an `openai.AsyncOpenAI` client.

    Args:
        judge_model: LiteLLM's model name, provider first ("openai/o4-mini").
        extra_litellm_params: LiteLLM's parameters for every request (api_base, api_key, timeout,
            temperature, mock_response, ...).

    Raises:
        MissingDependencyError: if LiteLLM is not installed.
        ConfigError: if `extra_litellm_params` sets `model` or `messages` (RULER's own).
    """

    def __init__(self, judge_model: str, extra_litellm_params: dict[str, Any] | None = None) -> None:
        self._litellm = import_litellm()
        self.extra = dict(extra_litellm_params or {})
        taken = sorted({"model", "messages"} & set(self.extra))
        if taken:
            raise ConfigError(f"extra_litellm_params may not set {', '.join(taken)}: RULER sends the judge_model and "
                              "the judge's prompt")
        self.model = judge_model
        self.base_url = self.extra.get("api_base") or self.extra.get("base_url")
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        provider = judge_model.partition("/")[0] if "/" in judge_model else "openai"
        self.models = SimpleNamespace(list=self._list_models) if self.base_url and provider in OPENAI_COMPATIBLE else None

    async def _create(self, **request: Any) -> Any:
        return await self._litellm.acompletion(**{**request, "model": self.model, "caching": False, **self.extra})

    async def _list_models(self) -> Any:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=self.base_url, api_key=self.extra.get("api_key") or "none", max_retries=0,
                               timeout=30.0) as client:
            return await client.models.list()

    def cost_usd(self, completion: Any) -> float | None:
        """What `completion` cost, in USD, when LiteLLM knows the model's price; else None."""
        try:
            cost = self._litellm.completion_cost(completion_response=completion)
        except Exception:  # a local or unpriced model: LiteLLM raises instead of answering "unknown"
            return None
        return float(cost) if cost else None
