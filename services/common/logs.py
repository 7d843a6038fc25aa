"""Logging for the service processes (`solrl serve <role>`, `python -m services.<role>.server`).

One setup for every entry point: timestamps and levels on stderr, the level from SOLRL_LOG_LEVEL
(default INFO), optional JSON lines (SOLRL_LOG_FORMAT=json: one object per record, for log
collectors), Python warnings routed through logging, and third-party noise kept out: transformers,
diffusers and huggingface_hub log at WARNING or above through the same handler, without their
progress bars ("Loading weights ...").
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

ENV_LOG_LEVEL = "SOLRL_LOG_LEVEL"
ENV_LOG_FORMAT = "SOLRL_LOG_FORMAT"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log chattily at INFO or draw progress bars while a service loads its model.
NOISY = ("transformers", "diffusers", "huggingface_hub", "urllib3", "httpx", "httpcore", "filelock", "PIL",
         "matplotlib", "torch", "torchao", "peft", "asyncio", "uvicorn", "uvicorn.error")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601 with ms), level, logger, message, and exc_info
    when there is one. Written here: the standard library has no JSON formatter, and this is all a
    log collector needs."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def log_settings(environ: Mapping[str, str]) -> tuple[int, str]:
    """(level, "text" | "json") from the environment; ValueError naming the variable otherwise."""
    level = environ.get(ENV_LOG_LEVEL, "").strip().upper() or "INFO"
    if level not in LEVELS:
        raise ValueError(f"{ENV_LOG_LEVEL} must be one of {', '.join(LEVELS)}, got {environ[ENV_LOG_LEVEL]!r}")
    fmt = environ.get(ENV_LOG_FORMAT, "").strip().lower() or "text"
    if fmt not in ("text", "json"):
        raise ValueError(f"{ENV_LOG_FORMAT} must be 'text' or 'json', got {environ[ENV_LOG_FORMAT]!r}")
    return getattr(logging, level), fmt


def configure_logging(environ: Mapping[str, str] | None = None) -> None:
    """Set up the process's logging for a service (idempotent: replaces the root handlers)."""
    environ = os.environ if environ is None else environ
    level, fmt = log_settings(environ)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    for name in NOISY:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    # transformers and diffusers install their own stderr handler and draw tqdm bars: route their records
    # through ours instead and turn the bars off (their logging utilities exist for exactly this)
    for lib in ("transformers", "diffusers"):
        try:
            utils = __import__(f"{lib}.utils.logging", fromlist=["logging"])
        except ImportError:
            continue
        utils.disable_default_handler()
        utils.enable_propagation()
        utils.set_verbosity(max(level, logging.WARNING))
        utils.disable_progress_bar()
