"""Stream a completion from an ``ordinal serve`` server and print it as it arrives.

    python clients/stream.py "ROMEO:" --url http://127.0.0.1:8000 --model rope --max-tokens 200

Without ``--url`` the server is ``$ORDINAL_URL``, else ``http://127.0.0.1:$ORDINAL_PORT`` (the
variable ``ordinal serve`` listens on), else ``http://127.0.0.1:8000``. The text goes to stdout
chunk by chunk; time to first token and tokens/s go to stderr at the end.
Only HTTP is spoken here (no import of ``model`` or ``server``), so this file also works as a
standalone example of the streaming API.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import httpx

PROG = "stream.py"
# Sampling options sent only when given, so the server's defaults apply otherwise.
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")


def default_url(environ: dict[str, str] | None = None) -> str:
    """``$ORDINAL_URL``, else the local server on ``$ORDINAL_PORT`` (default 8000)."""
    environ = dict(os.environ) if environ is None else environ
    if environ.get("ORDINAL_URL"):
        return environ["ORDINAL_URL"].rstrip("/")
    return f"http://127.0.0.1:{environ.get('ORDINAL_PORT') or 8000}"


class ServerError(Exception):
    """The server answered with an error status or sent an error in the middle of the stream."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument(
        "--url",
        default=default_url(),
        help="server base URL (default: $ORDINAL_URL, else http://127.0.0.1:$ORDINAL_PORT, "
        "else port 8000; now %(default)s)",
    )
    parser.add_argument("--model", help="checkpoint name (default: the server's default)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--api-key", default=os.environ.get("ORDINAL_API_KEY"))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait per chunk")
    return parser


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for these command-line arguments."""
    body: dict[str, Any] = {"prompt": args.prompt, "max_tokens": args.max_tokens, "stream": True}
    # The last chunk counts the tokens: a chunk may carry several (the server's stream interval).
    body["stream_options"] = {"include_usage": True}
    if args.model is not None:
        body["model"] = args.model
    given = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
    body.update({name: value for name, value in given.items() if value is not None})
    return body


def error_message(payload: Any, fallback: str) -> str:
    """The message of an OpenAI-style ``{"error": {"message": ...}}`` payload, else ``fallback``."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return fallback


def stream_chunks(client: httpx.Client, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yield the JSON chunks of the server-sent event stream, up to ``data: [DONE]``."""
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.is_error:
            response.read()
            try:
                message = error_message(response.json(), response.text)
            except ValueError:  # not JSON: a proxy's HTML page, say
                message = response.text.strip() or response.reason_phrase
            raise ServerError(f"server error {response.status_code}: {message}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and SSE comments (keep-alives)
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"server error mid-stream: {error_message(chunk, data)}")
            yield chunk


def print_completion(client: httpx.Client, body: dict[str, Any], out: TextIO) -> str:
    """Print the streamed text to ``out`` as it arrives; return the timing line for stderr."""
    started = time.perf_counter()
    first_at: float | None = None
    text_chunks = 0
    tokens: int | None = None  # the usage chunk's count
    for chunk in stream_chunks(client, body):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        text = "".join(choice.get("text") or "" for choice in chunk.get("choices", []))
        if not text:
            continue  # the usage chunk, or a final chunk that only carries finish_reason
        if first_at is None:
            first_at = time.perf_counter()
        text_chunks += 1
        out.write(text)
        out.flush()
    out.write("\n")
    if first_at is None:
        return "no text received"
    elapsed = time.perf_counter() - first_at
    if tokens is None:  # a server that sent no usage: one token a chunk, as most do
        tokens = text_chunks
    # The first token's time is latency (prompt processing), so the rate counts the ones after it
    # (the first token is sent alone, at once).
    rate = f"{(tokens - 1) / elapsed:.1f} tokens/s" if elapsed > 0 else "n/a tokens/s"
    took = f"time to first token {first_at - started:.3f} s, {rate}"
    return f"{took} ({tokens} tokens in {text_chunks} chunks)"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=timeout) as client:
            timing = print_completion(client, request_body(args), sys.stdout)
    except ServerError as error:
        return fail(str(error))
    except httpx.ConnectError as error:
        return fail(f"cannot reach the server at {args.url}: {error}")
    except httpx.TimeoutException:
        return fail(f"the server at {args.url} did not answer within {args.timeout:g} s")
    except (httpx.HTTPError, httpx.InvalidURL, json.JSONDecodeError) as error:
        return fail(f"bad response from {args.url}: {error}")
    except KeyboardInterrupt:
        print(file=sys.stderr)  # leave the shell prompt on a fresh line after ^C
        return 130
    print(timing, file=sys.stderr)
    return 0


def fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
