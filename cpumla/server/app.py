"""The ASGI app (Starlette): routes (OpenAI's chat and completions, Anthropic's messages, models), the
API-key gate, CORS, one log line per request, and errors in the API's own shape. The engine's scheduling
is scheduling.py's."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cpumla.chat.generate import Answer
from cpumla.server import anthropic as A
from cpumla.server import protocol as P
from cpumla.server.model import Job, ServedModel
from cpumla.server.scheduling import ClientGone, Runner, Watch
from cpumla.server.structured import FieldError

MAX_BODY = 4 << 20          # bytes of a request body
MESSAGES = "/v1/messages"   # Anthropic's route: its errors take Anthropic's shape
log = logging.getLogger("cpumla.server")

# ---- responses ----
class JobStream(StreamingResponse):
    """Server-sent events of one job; however the response ends (done, client gone, server stopping),
    the job is cancelled and the connection watch closed."""

    def __init__(self, content, job: Job, done: asyncio.Event, watch: Watch, on_end):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job, self.done, self.watch, self.on_end = job, done, watch, on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:                 # the client went away mid-write
            pass
        finally:
            self.job.cancel()
            self.watch.close()
            await self.done.wait()      # the worker stops at its next token; then the log line is final
            self.on_end()


def error_response(e: P.ApiError, path: str = "") -> JSONResponse:
    """OpenAI's error shape, or Anthropic's on its route."""
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else ({"Retry-After": "1"} if e.status == 503 else None)
    body = A.error_body(e) if path == MESSAGES else e.body()
    return JSONResponse(body, status_code=e.status, headers=headers)


def _note(request: Request, **kv) -> None:
    request.scope.setdefault("cpumla.log", {}).update(kv)


def _stats_note(request: Request, job: Job, stream: bool) -> None:
    st = job.stats
    _note(request, job=f"{'stream ' if stream else ''}prompt={st.prompt_tokens} cached={st.cached_tokens} "
                       f"completion={st.completion_tokens} finish={st.finish}")


async def read_json(request: Request) -> dict:
    n = request.headers.get("content-length", "")
    if n.isdigit() and int(n) > MAX_BODY:
        raise P.ApiError(413, f"the request body is {int(n)} bytes; the server takes at most {MAX_BODY}")
    chunks, size = [], 0
    async for c in request.stream():
        size += len(c)
        if size > MAX_BODY:
            raise P.ApiError(413, f"the request body is more than {MAX_BODY} bytes")
        chunks.append(c)
    return P.parse_json(b"".join(chunks))


# ---- the app ----
def create_app(served: ServedModel, *, api_key: str | None = None, max_queue: int = 8, seed: int | None = None,
               runner_ref: list | None = None, cors: list[str] | None = None) -> Starlette:
    """The server's ASGI app. runner_ref, when given, receives the Runner (for a shutdown hook); cors:
    the origins browsers may call it from ("*": any), preflight requests answered before the API key."""
    runner = Runner(served, max_queue, seed)
    if runner_ref is not None:
        runner_ref.append(runner)

    def text_of(i: int) -> str:
        return served.tok.decode([i])

    async def start(request: Request, prepare, sampling, kind, **job_kw):
        """(job, events, done, watch), or a Response when the client left while queued."""
        watch = Watch(request.receive)
        try:
            job, events, done = await runner.start(watch, prepare, sampling, "messages" if kind == "chat" else "prompt",
                                                   **job_kw)
        except ClientGone:
            watch.close()
            _note(request, error="the client went away while queued")
            return Response(status_code=499)
        except BaseException:
            watch.close()
            raise
        return job, events, done, watch

    async def collect(request: Request, job, events, watch) -> Answer:
        """The whole answer of a non-streamed job."""
        answer = Answer()
        try:
            while True:
                ev, payload = await events.get()
                if ev == "done":
                    break
                if ev == "error":
                    raise P.ApiError(500, payload, "server_error")
                answer.add(ev, payload)
        finally:
            job.cancel()
            watch.close()
            _stats_note(request, job, False)
        return answer

    def usage_of(job: Job) -> dict:
        st = job.stats
        return P.usage(st.prompt_tokens, st.completion_tokens, st.cached_tokens, st.reasoning_tokens)

    async def respond(request: Request, prepare, sampling, kind, stream, streamed, whole, **job_kw):
        """Start a job; then its server-sent events, streamed(job, events), or once it has finished the
        JSON of whole(job, answer). 499 when the client went away."""
        got = await start(request, prepare, sampling, kind, **job_kw)
        if isinstance(got, Response):
            return got
        job, events, done, watch = got
        if stream:
            return JobStream(streamed(job, events), job, done, watch, lambda: _stats_note(request, job, True))
        answer = await collect(request, job, events, watch)
        if job.stats.finish == "cancelled":
            return Response(status_code=499)
        return JSONResponse(whole(job, answer))

    async def generate(request: Request, prepare, sampling, stream, kind, include_usage=False, echo=False, **job_kw):
        """OpenAI's chat and completions."""
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")

        def whole(job, answer: Answer) -> dict:
            st, content = job.stats, answer.text
            lps = answer.logprobs if job.logprobs is not None else None
            if kind == "chat":
                reasoning = answer.reasoning_text if (job.prompt.thinks or answer.reasoning) else None
                calls = answer.tool_calls
                return P.chat_response(rid, served.name, content if content or not calls else None, reasoning,
                                       st.finish, usage_of(job), calls,
                                       P.chat_logprobs(lps, text_of) if lps is not None else None)
            head = _echo(job) if echo else ""
            return P.completion_response(rid, served.name, head + content, st.finish, usage_of(job),
                                         P.completion_logprobs(lps, text_of, len(head)) if lps is not None else None)

        return await respond(request, prepare, sampling, kind, stream,
                             lambda job, events: _stream(job, events, rid, kind, include_usage, echo), whole, **job_kw)

    async def _stream(job, events, rid, kind, include_usage, echo):
        name, lp_on = served.name, job.logprobs is not None
        offset, pending, ncalls = 0, [], 0
        if kind == "chat":
            yield P.sse(P.chat_chunk(rid, name, {"role": "assistant", "content": ""}))
        elif echo:
            head = _echo(job)
            offset = len(head)
            yield P.sse(P.completion_chunk(rid, name, head))

        def lp_block():
            nonlocal offset
            if not lp_on:
                return None
            got = P.chat_logprobs(pending, text_of) if kind == "chat" else P.completion_logprobs(pending, text_of, offset)
            if kind != "chat":
                offset += sum(len(t) for t in got["tokens"])
            pending.clear()
            return got

        while True:
            ev, payload = await events.get()
            if ev == "done":
                break
            if ev == "error":
                yield P.sse(P.ApiError(500, payload, "server_error").body())
                return
            if ev == "logprobs":
                pending.extend(payload)
            elif ev == "tool_calls":
                yield P.sse(P.chat_chunk(rid, name, {"tool_calls": P.tool_calls_json(payload, ncalls, stream=True)}))
                ncalls += len(payload)
            elif kind == "chat":
                key = "reasoning_content" if ev == "reasoning" else "content"
                yield P.sse(P.chat_chunk(rid, name, {key: payload}, logprobs=lp_block() if ev == "content" else None))
            else:
                yield P.sse(P.completion_chunk(rid, name, payload, logprobs=lp_block()))
        st = job.stats
        if st.finish == "cancelled":
            return
        chunk = P.chat_chunk if kind == "chat" else P.completion_chunk
        yield P.sse(chunk(rid, name, {} if kind == "chat" else "", st.finish, logprobs=lp_block() if pending else None))
        if include_usage:
            yield P.sse(chunk(rid, name, {} if kind == "chat" else "", use=usage_of(job)))
        yield P.SSE_DONE

    def _echo(job: Job) -> str:
        return served.tok.decode(job.prompt.ids, skip_special_tokens=True)

    def _checked(structured) -> dict:
        """The job fields of a request's tools and response_format; a 400 for what cannot be done."""
        try:
            return structured.job_kw(served)
        except FieldError as e:
            raise P.bad(str(e), e.param) from None

    async def chat_completions(request: Request):
        body = await read_json(request)
        P.check_model(body, served.names)
        req = P.parse_chat(body)
        tools = req.structured.prompt_tools
        job_kw = dict(logprobs=req.logprobs, **served.chat_job(), **_checked(req.structured))
        return await generate(request, lambda: served.chat_prompt(req.messages, req.think, tools), req.sampling,
                              req.stream, "chat", include_usage=req.include_usage, **job_kw)

    async def completions(request: Request):
        body = await read_json(request)
        P.check_model(body, served.names)
        req = P.parse_completion(body)
        job_kw = _checked(req.structured)
        return await generate(request, lambda: served.completion_prompt(req.prompt), req.sampling, req.stream,
                              "completion", include_usage=req.include_usage, echo=req.echo, logprobs=req.logprobs,
                              **job_kw)

    async def messages(request: Request):
        body = await read_json(request)
        P.check_model(body, served.names)
        req = A.parse(body)
        job_kw = _checked(req.structured)
        tools = req.structured.prompt_tools
        mid = A.new_id()
        return await respond(request, lambda: served.chat_prompt(req.messages, req.think, tools), req.sampling, "chat",
                             req.stream, lambda job, events: A.stream(job, events, mid, served.name),
                             lambda job, answer: A.message(mid, served.name, answer, job),
                             **served.chat_job(), **job_kw)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "cpumla", "max_model_len": served.ctx}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card(n) for n in served.names]})

    async def model(request: Request):
        name = request.path_params["model"]
        if name not in served.names:
            raise P.ApiError(404, f"the model '{name}' does not exist; this server serves "
                                  f"{', '.join(repr(n) for n in served.names)}", "not_found_error",
                             param="model", code="model_not_found")
        return JSONResponse(model_card(name))

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": served.name, "running": int(runner.slot.busy),
                             "queued": runner.slot.queued})

    async def on_api_error(request: Request, e: P.ApiError):
        _note(request, error=e.message)
        return error_response(e, request.url.path)

    async def on_http_error(request: Request, e: HTTPException):
        msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return await on_api_error(request, P.ApiError(e.status_code, msg.get(e.status_code, str(e.detail)),
                                                      "not_found_error" if e.status_code == 404 else
                                                      "invalid_request_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        runner.cancel_all()
        await asyncio.get_running_loop().run_in_executor(None, runner.worker.shutdown)

    started = int(time.time())
    middleware = [Middleware(Gate, api_key=api_key)]
    if cors:
        # Starlette's own CORS layer, outside the key: a browser's preflight carries no Authorization
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST", "OPTIONS"],
                                        allow_headers=["*"], max_age=600))
    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route(MESSAGES, messages, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={P.ApiError: on_api_error, HTTPException: on_http_error}, lifespan=lifespan)


class Gate:
    """Outermost of the app's own layers: the API key, one log line per request, and a 500 for anything
    unexpected: its stack goes to the server log, the client gets one line without it. A client that
    goes away (mid-body or mid-answer) is logged as 499, not as a fault."""

    def __init__(self, app, api_key: str | None = None):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None

    def _authorized(self, scope) -> bool:
        """Authorization: Bearer KEY (OpenAI's clients) or x-api-key: KEY (Anthropic's)."""
        headers = dict(scope.get("headers", ()))
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.key)
        return hmac.compare_digest(b"Bearer " + headers.get(b"x-api-key", b""), self.key) or bearer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [0]
        note = scope.setdefault("cpumla.log", {})

        async def send_(msg) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if self.key is not None and not self._authorized(scope):
                e = P.ApiError(401, "a valid API key is needed (Authorization: Bearer KEY, or x-api-key: KEY)",
                               code="invalid_api_key")
                note["error"] = e.message
                await error_response(e, scope.get("path", ""))(scope, receive, send_)
            else:
                await self.app(scope, receive, send_)
        except (OSError, ClientDisconnect):
            note.setdefault("error", "the client went away")
        except Exception as e:
            note["error"] = f"internal error: {type(e).__name__}"
            log.error("internal error on %s %s", scope.get("method", ""), scope.get("path", ""), exc_info=e)
            if not status[0]:
                with contextlib.suppress(Exception):
                    await error_response(P.ApiError(500, f"internal error ({type(e).__name__}; the server log has "
                                                         f"the details)", "server_error"),
                                         scope.get("path", ""))(scope, receive, send_)
        finally:
            client = scope.get("client") or ("-", 0)
            parts = [f"{client[0]}:{client[1]}", scope.get("method", ""), scope.get("path", ""), str(status[0] or 499)]
            parts += [v for v in (note.get("job"), note.get("error")) if v]
            parts.append(f"{time.perf_counter() - t0:.3f}s")
            log.info(" ".join(parts))
