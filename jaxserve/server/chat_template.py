"""Chat prompts: messages -> token ids through the model's chat template (or a trusted request's).

A template is a program. Requests may not send their own unless the server was started with
--trust-request-chat-template; keyword arguments the server sets itself are refused; every render
runs off the event loop within --render-timeout, and its output is held to the prompt-size bound.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.errors import UserError
from jaxserve.server import protocol as P
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import bad_request
from jaxserve import limits
from jaxserve.server.offload import run_bounded

# apply_chat_template's own arguments: the server sets them, a request may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "conversation",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
    }
)


class ChatTemplate:
    def __init__(self, tokenizer, cfg: ServerConfig, check_chars: Callable[[int, str], None]):
        self.tok = tokenizer
        self.cfg = cfg
        self.check_chars = check_chars  # (num_chars, param): a 400 if too long for the model

    async def render(
        self,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The prompt ids of `messages` (and the request's `tools`, for templates that show
        them), rendered off the event loop within the time bound."""
        kwargs = dict(template_kwargs or {})
        for key in kwargs:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise bad_request(
                    f"'chat_template_kwargs.{key}' is set by the server: remove it"
                    + (" (use the top-level field)." if key in P.ChatCompletionRequest.model_fields
                       else "."),
                    f"chat_template_kwargs.{key}",
                )
        if "chat_template" in kwargs:
            chat_template = chat_template or kwargs.pop("chat_template")
            param = "chat_template_kwargs.chat_template"
        else:
            param = "chat_template"
        if chat_template is not None and not self.cfg.trust_request_chat_template:
            raise bad_request(
                "A request-supplied chat template runs code on the server and is refused: "
                "remove it, or start the server with --trust-request-chat-template.",
                param,
            )
        if chat_template is None and not self.tok.has_chat_template:
            raise bad_request("This model has no chat template: use /v1/completions.", "messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "'continue_final_message' needs 'add_generation_prompt' set to false.",
                "continue_final_message",
            )
        if len(messages) > limits.MAX_MESSAGES:
            raise bad_request(f"The request has {len(messages)} messages, more than the limit of "
                              f"{limits.MAX_MESSAGES}.", "messages")
        parts = sum(len(m.content) for m in messages if isinstance(m.content, list))
        if parts > limits.MAX_CONTENT_PARTS:
            raise bad_request(f"The messages have {parts} content parts, more than the limit of "
                              f"{limits.MAX_CONTENT_PARTS}.", "messages")
        self.check_chars(sum(m.num_chars for m in messages), "messages")
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools:
            kwargs["tools"] = tools

        def render() -> list[int]:
            msgs = [m.to_template(i) for i, m in enumerate(messages)]  # off the loop: O(body)
            text = self.tok.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
            self.check_chars(len(text), "messages")  # the template's output-size bound
            return self.tok.encode(text, add_special_tokens=False)

        try:
            return await run_bounded(
                render, self.cfg.render_timeout, "Rendering the chat template", "messages"
            )
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) are the client's
            msg = str(e)[:300]
            raise bad_request(f"The chat template rejected the messages: {msg}", "messages") from None
