"""tokentrace gateway: one OpenAI-compatible endpoint in front of N upstream engines (Exo, Ollama,
llama.cpp, LM Studio, SGLang, vLLM, mlx_lm.server, tokentrace engines); it routes each request to one
upstream and reports what it observed to the collector (docs/gateway.md)."""

from __future__ import annotations

import argparse
import logging
import signal

from tokentrace.engine_shim.gateway.settings import add_setting_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's options (one per setting)."""
    add_setting_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="log level of the gateway and its HTTP server")


def run(args: argparse.Namespace) -> int:
    """Validate the settings, then serve until interrupted."""
    settings = settings_from_args(args)
    from tokentrace.listen import listen_socket

    sock = listen_socket(settings.host, settings.port)  # a busy port is one line, before anything starts
    import uvicorn

    from tokentrace.engine_shim.emit.spool import Spool, SpoolingSpanExporter
    from tokentrace.engine_shim.gateway.app import Gateway
    from tokentrace.engine_shim.gateway.observe import Observer
    from tokentrace.engine_shim.gateway.prompt import LocalTokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request otherwise

    def exporter(name: str) -> SpoolingSpanExporter:
        spool = (Spool(settings.spool_dir, settings.spool_max_bytes, f"gateway-{name}")
                 if settings.otlp_endpoint and settings.spool_max_bytes else None)
        return SpoolingSpanExporter(settings.otlp_endpoint or None, spool, settings.otlp_token,
                                    timeout=settings.otlp_timeout)

    tokenizer = LocalTokenizer(settings.tokenizer) if settings.tokenizer else None
    observer = Observer(exporter, settings.block_size, tokenizer, settings.capture_content)
    gateway = Gateway(settings, observer)
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler installed
    # before it: by default SIGTERM then killed the gateway (exit -15) before observer.close() below
    # exported what the shutdown's bounded flush had left (issue 44). A recording handler turns it
    # into a clean exit 0 after that close, as the engine does.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)
    try:
        uvicorn.Server(uvicorn.Config(gateway, host=settings.host, port=settings.port, log_level=args.log_level,
                                      access_log=False, lifespan="on")).run(sockets=[sock])
    finally:
        observer.close()
    return 0
