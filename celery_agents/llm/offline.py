"""The offline models, `demo/<anything>` (llm/demo.py) and `test/tools` (llm/tools_model.py),
served through litellm as custom providers: deterministic, no network, answered in this process.

Each answers at once, whole. When the call streams, its reasoning and text go to the live output
in one write (one round trip): the demo model's as one delta each, as any answer that arrives
within one batching interval does; the `test/tools` model's in several pieces of a few words
(`pieces`), so that a client under test sees an answer arrive in several deltas and must join them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_agents.llm.demo import PROVIDER as DEMO
from celery_agents.llm.demo import demo_reply
from celery_agents.llm.tools_model import PROVIDER as TEST
from celery_agents.llm.tools_model import tools_reply
from celery_agents.scheduler.ports import DeltaKind

Reply = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], dict[str, Any]]

#: provider -> the function that answers a conversation
REPLIES: dict[str, Reply] = {DEMO: demo_reply, TEST: tools_reply}


#: about how many characters each piece of a `test/tools` answer streams in
PIECE_CHARS = 24


def is_offline(model: str) -> bool:
    return "/" in model and model.split("/", 1)[0] in REPLIES


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of about `size` characters, each ending after a space where the text
    has one: what a model streaming its answer sends. Joined, they are `text`."""
    out: list[str] = []
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            space = text.rfind(" ", start + 1, end + 1)
            end = space + 1 if space > start else end
        out.append(text[start:end])
        start = end
    return out


def live_parts(model: str, reasoning: str | None, text: str | None) -> list[tuple[DeltaKind, str]]:
    """What an offline model's answer writes to the live output, in order: its reasoning, then its
    text; in pieces for `test/tools`, whole for the demo model."""
    cut = model.split("/", 1)[0] == TEST
    given: list[tuple[DeltaKind, str | None]] = [("reasoning", reasoning), ("text", text)]
    return [(kind, piece) for kind, whole in given if whole for piece in (pieces(whole) if cut else [whole])]


_priced: set[str] = set()


def register_offline_model(litellm: Any, model: str) -> None:
    """Price an offline model at zero, once: its cost is then known (0) and looked up directly."""
    if model not in _priced:
        litellm.register_model(
            {
                model: {
                    "input_cost_per_token": 0.0,
                    "output_cost_per_token": 0.0,
                    "litellm_provider": model.split("/", 1)[0],
                    "mode": "chat",
                }
            }
        )
        _priced.add(model)


def register_offline_providers(litellm: Any) -> None:
    """Register the offline providers with litellm (idempotent)."""
    known = {p.get("provider") for p in litellm.custom_provider_map}
    added = [{"provider": name, "custom_handler": _handler(name, reply)} for name, reply in REPLIES.items()]
    added = [p for p in added if p["provider"] not in known]
    if not added:
        return
    litellm.custom_provider_map = [*litellm.custom_provider_map, *added]
    from litellm.utils import custom_llm_setup

    custom_llm_setup()  # type: ignore[no-untyped-call]  # litellm leaves it unannotated


def _handler(provider: str, reply_of: Reply) -> Any:
    from litellm.llms.custom_llm import CustomLLM
    from litellm.types.utils import ChatCompletionMessageToolCall, Choices, Function, Message, Usage

    def fill(model: str, messages: list[dict[str, Any]], optional_params: dict[str, Any], model_response: Any) -> Any:
        reply = reply_of(messages, optional_params.get("tools"))
        tool_calls = [
            ChatCompletionMessageToolCall(
                id=c["id"], type="function", function=Function(name=c["name"], arguments=c["arguments"])
            )
            for c in reply["tool_calls"]
        ] or None
        msg = Message(
            content=reply["content"], role="assistant", tool_calls=tool_calls, reasoning_content=reply["reasoning"]
        )
        model_response.choices = [Choices(index=0, message=msg, finish_reason="tool_calls" if tool_calls else "stop")]
        p, c = reply["usage"]
        model_response.usage = Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
        model_response.model = f"{provider}/{model}"
        # The provider states its own price (nothing): litellm then takes this cost as computed
        # instead of looking the model up in its cost map on every call (~15 % of the call's CPU).
        model_response._hidden_params["response_cost"] = 0.0
        return model_response

    class OfflineLLM(CustomLLM):
        def completion(
            self,
            model: str,
            messages: list[dict[str, Any]],
            api_base: str,
            custom_prompt_dict: Any,
            model_response: Any,
            print_verbose: Any,
            encoding: Any,
            api_key: Any,
            logging_obj: Any,
            optional_params: dict[str, Any],
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            return fill(model, messages, optional_params, model_response)

        async def acompletion(self, *args: Any, **kwargs: Any) -> Any:
            return self.completion(*args, **kwargs)

    return OfflineLLM()
