"""A model server on loopback for the real agent CLIs (issue 10): test tooling, not part of the daemon.

One threaded HTTP server speaks

* the Anthropic Messages API — ``POST /v1/messages`` (SSE stream or one JSON body),
  ``POST /v1/messages/count_tokens`` — for Claude Code (``ANTHROPIC_BASE_URL``);
* the OpenAI Responses API — ``POST /v1/responses`` (SSE stream), ``GET /v1/models`` — for Codex
  (a ``model_providers`` entry with ``base_url = <url>/v1`` and ``wire_api = "responses"``).

A test scripts the *agent* requests (those carrying the CLI's tool list: the conversation itself)
with ``Reply`` objects, consumed in order; requests the CLIs make on the side (titles, quota
probes, token counts) get a short default answer and consume nothing.  Every request is recorded
(``requests``) so a test can check what the CLI sent, e.g. that a resumed turn carries the earlier
conversation.

    standin = ModelStandin().start()
    standin.script(Reply(tools=[Tool.bash("echo hi > f.txt")]), Reply(text="done"))
    ... ANTHROPIC_BASE_URL=standin.url ...
    standin.close()
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ERRORS = {  # status -> (Anthropic error type, OpenAI error code, message)
    400: ("invalid_request_error", "invalid_request_error", "bad request"),
    401: ("authentication_error", "invalid_api_key", "invalid x-api-key"),
    403: ("permission_error", "permission_denied", "forbidden"),
    429: ("rate_limit_error", "rate_limit_exceeded", "rate limit exceeded"),
    500: ("api_error", "server_error", "internal server error"),
    529: ("overloaded_error", "server_is_overloaded", "Overloaded"),
}


@dataclass
class Tool:
    """One tool call the model makes: ``name`` as the CLI offered it, ``input`` its arguments."""

    name: str
    input: dict[str, Any]

    # Claude Code's tools
    @classmethod
    def bash(cls, command: str) -> Tool:
        return cls("Bash", {"command": command, "description": "run a command"})

    @classmethod
    def write(cls, path: str, content: str) -> Tool:
        return cls("Write", {"file_path": path, "content": content})

    @classmethod
    def edit(cls, path: str, old: str, new: str) -> Tool:
        return cls("Edit", {"file_path": path, "old_string": old, "new_string": new})


@dataclass
class Reply:
    """One model answer. ``status`` != 200 answers an error instead; ``hang`` streams the start
    and then nothing, until the stand-in closes; ``drop`` streams the start and the text, then
    closes the connection mid-message (no stop event); ``stream_error`` streams the start and the
    text, then an SSE ``error`` event of that HTTP status (e.g. 529 overloaded mid-stream);
    ``delay_s`` sleeps between streamed chunks; ``gate`` (a ``threading.Event``) holds the answer
    until the test sets it, so the CLI waits on that request for as long as the test needs."""

    text: str | None = None
    tools: list[Tool] = field(default_factory=list)
    status: int = 200
    hang: bool = False
    drop: bool = False
    stream_error: int | None = None
    delay_s: float = 0.0
    chunks: int = 4
    usage: tuple[int, int, int, int] = (11, 7, 0, 0)   # input, output, cache read, cache write
    headers: dict[str, str] = field(default_factory=dict)
    repeat: bool = False                               # stays at the head of the script
    gate: threading.Event | None = None


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]   # names lower-cased
    body: Any
    agent: bool          # an agent request (consumed a scripted reply)
    at: float


class ModelStandin:
    def __init__(self):
        self.requests: list[Recorded] = []
        self._script: list[Reply] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.default = Reply(text="ok")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ModelStandin:
        self._thread = threading.Thread(target=self.server.serve_forever, name="model-standin", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()  # releases hanging streams
        self.server.shutdown()
        self.server.server_close()

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def agent_requests(self, path_suffix: str = "") -> list[Recorded]:
        return [r for r in list(self.requests) if r.agent and r.path.endswith(path_suffix)]

    def next_reply(self) -> Reply:
        with self._lock:
            if not self._script:
                return self.default
            reply = self._script[0]
            if not reply.repeat:
                self._script.pop(0)
            return reply

    def wait(self, seconds: float) -> bool:
        """Sleep, or return True at once when the stand-in is closing."""
        return self._closing.wait(seconds)


def _handler(standin: ModelStandin):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # ------------------------------------------------------------ plumbing
        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.headers.get("Content-Encoding") == "zstd" or self.headers.get("Content-Encoding") == "gzip":
                import gzip
                try:
                    raw = gzip.decompress(raw)
                except OSError:
                    pass
            try:
                return json.loads(raw or b"null")
            except ValueError:
                return raw.decode("utf-8", "replace")

        def _record(self, body: Any, agent: bool) -> None:
            standin.requests.append(Recorded(self.command, self.path.split("?")[0],
                                             {k.lower(): v for k, v in self.headers.items()},
                                             body, agent, time.time()))

        def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _sse_start(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True

        def _drop(self) -> None:
            """Close the connection at once, mid-response."""
            import socket

            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _sse(self, event: str, data: dict) -> None:
            self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        # ------------------------------------------------------------ routes
        def do_GET(self):
            self._record(None, False)
            path = self.path.split("?")[0]
            if path.endswith("/models"):
                return self._json(200, {"object": "list", "data": [{"id": "standin-model", "object": "model"}],
                                        "models": []})
            return self._json(404, {"error": {"type": "not_found_error", "message": path}})

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            body = self._body()
            path = self.path.split("?")[0]
            try:
                if path.endswith("/messages/count_tokens"):
                    self._record(body, False)
                    return self._json(200, {"input_tokens": 42})
                if path.endswith("/messages"):
                    agent = isinstance(body, dict) and bool(body.get("tools"))
                    self._record(body, agent)
                    reply = standin.next_reply() if agent else Reply(text=standin.default.text)
                    return self._anthropic(body if isinstance(body, dict) else {}, reply)
                if path.endswith("/responses"):
                    self._record(body, True)
                    return self._openai(body if isinstance(body, dict) else {}, standin.next_reply())
                self._record(body, False)
                return self._json(404, {"error": {"type": "not_found_error", "message": path}})
            except (BrokenPipeError, ConnectionResetError):
                pass  # the CLI went away (stopped mid-stream)

        def _hold(self, reply: Reply) -> None:
            while reply.gate is not None and not reply.gate.is_set() and not standin.wait(0.02):
                pass

        # ------------------------------------------------------------ Anthropic Messages
        def _anthropic(self, body: dict, reply: Reply) -> None:
            self._hold(reply)
            if reply.status != 200:
                kind, _code, message = ERRORS.get(reply.status, ("api_error", "", "error"))
                return self._json(reply.status, {"type": "error", "error": {"type": kind, "message": message},
                                                 "request_id": "req_standin"},
                                  {"request-id": "req_standin", **reply.headers})
            model = body.get("model") or "standin-model"
            inp, out, cread, cwrite = reply.usage
            message_id = "msg_" + uuid.uuid4().hex[:20]
            blocks: list[dict] = []
            if reply.text:
                blocks.append({"type": "text", "text": reply.text})
            for tool in reply.tools:
                blocks.append({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:20], "name": tool.name,
                               "input": tool.input})
            stop = "tool_use" if reply.tools else "end_turn"
            usage = {"input_tokens": inp, "output_tokens": out, "cache_read_input_tokens": cread,
                     "cache_creation_input_tokens": cwrite}
            if not body.get("stream"):  # also the CLI's fallback after a broken stream: it fails the same way
                if reply.drop or reply.hang:
                    return self._drop()
                if reply.stream_error:
                    return self._anthropic(body, Reply(status=reply.stream_error))
                return self._json(200, {"id": message_id, "type": "message", "role": "assistant", "model": model,
                                        "content": blocks or [{"type": "text", "text": ""}], "stop_reason": stop,
                                        "stop_sequence": None, "usage": usage})
            self._sse_start()
            self._sse("message_start", {"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 1}}})
            if reply.hang or reply.drop or reply.stream_error:
                self._sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
                self._sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": "text_delta", "text": reply.text or "Thinking"}})
                if reply.stream_error:
                    kind, _code, message = ERRORS.get(reply.stream_error, ("api_error", "", "error"))
                    self._sse("error", {"type": "error", "error": {"type": kind, "message": message}})
                elif reply.hang:
                    standin.wait(3600)
                self._drop()
                return
            for index, block in enumerate(blocks):
                if block["type"] == "text":
                    self._sse("content_block_start", {"type": "content_block_start", "index": index,
                                                      "content_block": {"type": "text", "text": ""}})
                    for piece in _pieces(block["text"], reply.chunks):
                        if reply.delay_s and standin.wait(reply.delay_s):
                            return
                        self._sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                          "delta": {"type": "text_delta", "text": piece}})
                else:
                    self._sse("content_block_start", {"type": "content_block_start", "index": index,
                                                      "content_block": {**block, "input": {}}})
                    self._sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                self._sse("content_block_stop", {"type": "content_block_stop", "index": index})
            self._sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                        "usage": {"output_tokens": out}})
            self._sse("message_stop", {"type": "message_stop"})

        # ------------------------------------------------------------ OpenAI Responses
        def _openai(self, body: dict, reply: Reply) -> None:
            self._hold(reply)
            if reply.status != 200:
                _kind, code, message = ERRORS.get(reply.status, ("", "server_error", "error"))
                return self._json(reply.status, {"error": {"message": message, "type": code, "code": code,
                                                           "param": None}}, reply.headers)
            inp, out, cread, _cwrite = reply.usage
            response_id = "resp_" + uuid.uuid4().hex[:20]
            model = body.get("model") or "standin-model"
            base = {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
                    "status": "in_progress", "output": []}
            self._sse_start()
            seq = iter(range(1, 10**6))

            def send(kind: str, **data):
                self._sse(kind, {"type": kind, "sequence_number": next(seq), **data})

            send("response.created", response=base)
            send("response.in_progress", response=base)
            items: list[dict] = []
            if reply.text or reply.hang:
                item_id = "msg_" + uuid.uuid4().hex[:20]
                send("response.output_item.added", output_index=0, item={
                    "id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []})
                send("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": []})
                if reply.hang:
                    send("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                         delta=reply.text or "Thinking")
                    standin.wait(3600)
                    return
                for piece in _pieces(reply.text, reply.chunks):
                    if reply.delay_s and standin.wait(reply.delay_s):
                        return
                    send("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=piece)
                send("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=reply.text)
                item = {"id": item_id, "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": reply.text, "annotations": []}]}
                send("response.output_item.done", output_index=0, item=item)
                items.append(item)
            for tool in reply.tools:
                index = len(items)
                call_id = "call_" + uuid.uuid4().hex[:20]
                if tool.name == "apply_patch" and _custom_tool(body, "apply_patch"):
                    item = {"id": "ctc_" + uuid.uuid4().hex[:16], "type": "custom_tool_call", "status": "completed",
                            "call_id": call_id, "name": "apply_patch", "input": tool.input.get("input", "")}
                else:
                    item = {"id": "fc_" + uuid.uuid4().hex[:16], "type": "function_call", "status": "completed",
                            "call_id": call_id, "name": tool.name, "arguments": json.dumps(tool.input)}
                send("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
                send("response.output_item.done", output_index=index, item=item)
                items.append(item)
            send("response.completed", response={**base, "status": "completed", "output": items, "usage": {
                "input_tokens": inp + cread, "input_tokens_details": {"cached_tokens": cread},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": inp + cread + out}})

    return Handler


def _custom_tool(body: dict, name: str) -> bool:
    return any(isinstance(t, dict) and t.get("type") == "custom" and t.get("name") == name
               for t in body.get("tools") or [])


def _pieces(text: str, count: int) -> list[str]:
    count = max(1, min(count, len(text) or 1))
    size = -(-len(text) // count)
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]
