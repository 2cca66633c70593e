"""``POST /v1/chat/completions``: the conversation, rendered as a scene by the model's chat
template (``model.chat``), is completed as a prompt of token ids; a ChatWriter gives the answer
OpenAI's chat shape. Everything between — validation against the model, the engine, streaming,
cancellation, timeouts — is the completions path itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from model.chat import ChatTemplateError, Message, Scene
from server.api.completions import Names, build_job, choice_seed, respond
from server.api.errors import APIError
from server.api.job import Job
from server.api.offload import CHAT_POOL, check_prompt_size, in_lane
from server.api.schemas import ChatMessage, ChatRequest, CompletionRequest, Constraint
from server.api.service import ServedModel, Service
from server.api.structured import ToolCallWriter, compile_constraint
from server.api.writer import ChatWriter


async def create_chat_completion(body: ChatRequest, request: Request, service: Service) -> Response:
    """Answer one chat completion request (400/404/429/503 are raised as APIError)."""
    served = service.get(body.model)
    call = body.tool_call()
    writer = ChatWriter if call is None else partial(ToolCallWriter, call)
    jobs, writers = await chat_jobs(body, served, writer, body.constraint())
    return await respond(jobs, writers, served, request, service)


async def render_scene(conversation: Sequence[ChatMessage], served: ServedModel) -> Scene:
    """The conversation as the model's chat template renders it, tokenised (its prompt ids and
    its speakers' stop strings), off the event loop and within a time bound; a 400 naming
    ``messages`` when the template refuses it or it cannot fit."""
    messages = [
        Message("system" if m.role == "developer" else m.role, m.text, m.name) for m in conversation
    ]
    for message in messages:
        check_prompt_size(message.content, served.max_prompt_bytes, served.name, "messages")
    try:
        return await in_lane(
            CHAT_POOL,
            served.chat_template.encode,
            served.tokenizer,
            messages,
            served.max_prompt_bytes,
        )
    except ChatTemplateError as error:
        raise APIError(400, f"messages: {error}", param="messages") from None


# Makes a choice's writer from (completion, served, prompt ids, choice index).
WriterOf = Callable[[CompletionRequest, ServedModel, list[int], int], ChatWriter]


async def chat_jobs(
    body: ChatRequest, served: ServedModel, writer: WriterOf, constraint: Constraint | None
) -> tuple[list[Job | None], list[ChatWriter]]:
    """The conversation's jobs, one per choice, and the ``writer`` of each: the chat endpoint's
    and the Responses endpoint's (which writes the same pieces in its own shape). The scene is
    rendered and tokenised off the event loop, within a time bound. ``constraint``: what the
    reply keeps to (its grammar, not the scene's speaker lines, then says where it ends)."""
    grammar = await compile_constraint(constraint, served)
    scene = await render_scene(body.messages, served)
    room = served.max_context - len(scene.prompt_ids)
    # Already validated as a chat request: built as a completion without validating again
    # (the scene's own stop strings may pass the 4 a client may send).
    completion = CompletionRequest.model_construct(
        **body.sampling_fields(),
        prompt=scene.prompt_ids,
        echo=False,
        max_tokens=body.token_budget or max(room, 1),
        seed=body.seed,
        stop=[*(body.stop or []), *(scene.stops if grammar is None else [])],
        stream=body.stream,
        stream_options=body.stream_options,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        n=body.n,
        user=body.user,
        return_tokens_as_token_ids=False,
        ignore_eos=body.ignore_eos,
        priority=body.priority,
    )
    # The client sent messages, not a prompt, and maybe max_completion_tokens: 400s name those.
    budget = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    names = Names("messages", "messages: the scene", budget)
    jobs = [
        build_job(completion, served, scene.prompt_ids, choice_seed(body.seed, j), names, grammar)
        for j in range(body.n)
    ]
    writers = [writer(completion, served, scene.prompt_ids, index) for index in range(body.n)]
    return jobs, writers
