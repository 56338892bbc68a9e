"""
Serve a model over HTTP, with OpenAI's API (what every client, SDK, chat UI and lm-evaluation-harness
speaks), to many users at once:

    python serve.py --out_dir=out-shakespeare-char          # http://127.0.0.1:8000: a web page, and /v1/...
    python serve.py --init_from=gpt2 --port=8080 --api_key=secret

The model is chosen as in sample.py (--out_dir / --init_from / --ckpt / --meta, --device, --dtype). Requests
are batched together by the generation engine (machinery/generation/engine.py), each with its own settings and seed;
machinery/serving/openai_api.py lists the routes and what they do. Clients:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="out-shakespeare-char", prompt="ROMEO:", max_tokens=100)

A chat model (finetuned on conversations: prepare.py chat) answers /v1/chat/completions in its own chat format,
each reply ending at its end of turn, and the web page talks with it turn by turn; a base model's chat is a
plain User: / Assistant: dialogue.

Ctrl-C or SIGTERM ends the generations in progress (their streams end with finish_reason "abort" and
[DONE]) and exits 0. Needs FastAPI and uvicorn: pip install fastapi==0.165.0 uvicorn==0.54.0
"""

import os
import socket
from dataclasses import dataclass
from typing import Optional

import machinery.torch_import  # noqa: F401  (first: torch imported with the collector paused, a faster start)
from machinery import configurator
from machinery.generation import decode_attention, engine, loading, packing
from machinery.serving import openai_api
from machinery.generation.calibration_cache import CalibrationCache
from machinery.configurator import setting
from machinery.errors import UserError, run_main

INSTALL = "pip install fastapi==0.165.0 uvicorn==0.54.0"
# Bytes of each connection's kernel send buffer, fixed (Linux would grow it to MBs, tcp_wmem, and a stream nobody reads
# would run on for minutes first, holding its slot), and of asyncio's write buffer before a stream waits. A client that
# stops reading then blocks its stream after some tens of KB (~50 KB in the kernel, which counts its own overhead, and
# 16 KB in asyncio); the stream's events wait in the engine, and its generation pauses (openai_api.STREAM_BACKLOG) and
# gives its slot to a waiting request (docs/benchmarks-history.md, issue 41). 16 KiB is ~90 chunks ahead of a reader
# that keeps up.
SEND_BUFFER = 16 * 1024


@dataclass
class ServeConfig(loading.EngineSource):
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface; then set an api_key)")
    port: int = setting(8000, "port to listen on")
    api_key: Optional[str] = setting(None, "require Authorization: Bearer API_KEY on the API's routes")
    model_name: Optional[str] = setting(None, "the model's name in the API (None: the out_dir's or init_from's "
                                              "last part)")
    max_batch: int = setting(32, "requests decoded together at most (the others wait their turn)")
    max_waiting: int = setting(256, "requests waiting at most; more are answered 429")
    max_tokens: int = setting(1024, "tokens a request may ask to generate at most (per choice); more: 400")
    max_n: int = setting(8, "choices per request at most (prompts x n); more: 400")
    max_body: int = setting(1 << 20, "bytes of a request body at most; more: 413")
    prefill_chunk: int = setting(64, "prompt tokens encoded per pass: a new prompt delays the running streams by "
                                     "one such pass per token at most")
    stream_timeout: float = setting(60.0, "seconds a stream may leave its tokens unread (a client that stopped "
                                          "reading) before it is ended")

    def validate(self):
        super().validate()
        configurator.check_positive(self, "max_batch", "max_waiting", "max_n", "max_body", "max_tokens",
                                    "prefill_chunk", "stream_timeout")
        if not 0 < self.port < 65536:
            raise UserError(f"port must be from 1 to 65535, got {self.port}")

    @property
    def served_name(self):
        return self.model_name or os.path.basename(os.path.normpath(self.name))


def build(cfg):
    """The model loaded, its engine (not started) and the API's shared state."""
    loaded = loading.load_run(cfg)
    model = packing.prepare(loaded.model, loaded.device, loaded.dtype, compile=cfg.compile, quantize=cfg.quantize)
    runner = engine.Engine(model, loaded.tokenizer, loaded.device, cfg.max_batch, cfg.max_waiting,
                           prefill_chunk=cfg.prefill_chunk, stall_timeout=cfg.stream_timeout, compile=cfg.compile,
                           prefix_cache_mb=cfg.prefix_cache_mb, calibration=CalibrationCache(),
                           ahead=cfg.decode_ahead,
                           decode_attention=decode_attention.default(cfg.decode_attention, loaded.device, True))
    limits = openai_api.Limits(cfg.max_tokens, cfg.max_n, cfg.max_body)
    server = openai_api.Server(runner, loaded.tokenizer, cfg.served_name, limits, cfg.api_key, loaded.data_meta.chat,
                               source=cfg)
    return server, loaded


def bounded_http():
    """uvicorn's HTTP protocol, each connection's unsent bytes bounded: a fixed kernel send buffer of SEND_BUFFER
    bytes (a fixed size also turns Linux's growing of it off) and asyncio's write buffer paused past as many."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class BoundedHTTP(AutoHTTPProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            transport.set_write_buffer_limits(high=SEND_BUFFER)

    return BoundedHTTP


def import_uvicorn():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError(f"serve.py needs FastAPI and uvicorn: {INSTALL}") from None
    return uvicorn


def main(argv=None):
    cfg = configurator.parse(ServeConfig, argv, usage="python serve.py [--key=value ...]", extra_files_ok=False)
    cfg.validate()
    uvicorn = import_uvicorn()
    server, loaded = build(cfg)
    app = openai_api.create_app(server)

    class Uvicorn(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(f"serving {server.name} ({loaded.device}, {loaded.dtype}) on http://{cfg.host}:{cfg.port} "
                      f"(web page: /, API: /v1)", flush=True)

        def handle_exit(self, sig, frame):
            server.engine.abort_all()  # open streams end now (finish_reason abort, [DONE]), then uvicorn stops
            super().handle_exit(sig, frame)
            # handled in full: uvicorn would raise the signal again once stopped (a death by SIGTERM, or a
            # KeyboardInterrupt traceback); the server exits 0 instead
            self._captured_signals.clear()

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, http=bounded_http(), log_level="warning",
                            timeout_graceful_shutdown=10)
    http = Uvicorn(config)
    server.engine.start()
    try:
        http.run()
    finally:
        server.engine.stop()
    if not http.started:
        raise UserError(f"cannot listen on {cfg.host}:{cfg.port} (in use, or not an address of this machine); "
                        f"pick another --port or --host")


if __name__ == "__main__":
    run_main(main)
