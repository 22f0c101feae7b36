"""Logging for the driver (CLI, router, HTTP edge) and every Ray actor, from one ``LogConfig``.

The driver gets a root handler here (text: ``time level logger: message``; json: one object per line);
the actors get Ray's own ``LoggingConfig`` with the same level and encoding, passed to ``ray.init`` so
it applies to every worker process of the job (their lines reach the driver's stderr through Ray's log
forwarding). ``ray.init`` would also add its handler to the driver's root logger: ``after_ray_init``
takes it back off when the driver is already configured here, so no line prints twice.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

from cluster.config import LogConfig

_MARK = "_pdserve_handler"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (ISO 8601, UTC), level, logger, message (+ exc_info, extras)."""

    STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        if record.exc_info:
            payload["exc_info"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in self.STANDARD and not key.startswith("_"):
                payload[key] = (
                    value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
                )
        return json.dumps(payload, ensure_ascii=False)


def make_formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(config: LogConfig, stream: Any = None) -> logging.Handler:
    """(Re)configure the driver's root logger: one pdserve handler at ``config.level`` in
    ``config.format``; a handler installed by an earlier call is replaced. Returns the handler."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(config.format))
    setattr(handler, _MARK, True)
    root.addHandler(handler)
    root.setLevel(config.level)
    # NOTE: uvicorn's access log is one line per request; keep it at WARNING unless asked for DEBUG.
    logging.getLogger("uvicorn.access").setLevel("DEBUG" if config.level == "DEBUG" else "WARNING")
    return handler


def is_configured() -> bool:
    return any(getattr(h, _MARK, False) for h in logging.getLogger().handlers)


def ray_logging_config(config: LogConfig) -> Any:
    """Ray's ``LoggingConfig`` for every actor of the job: same level, TEXT or JSON, logger name added."""
    import ray

    return ray.LoggingConfig(
        encoding=config.format.upper(), log_level=config.level, additional_log_standard_attrs=["name"]
    )


def after_ray_init(handlers_before: list[logging.Handler]) -> None:
    """Drop the root handlers ``ray.init`` added when the driver was configured by ``configure_logging``
    (its handler is among ``handlers_before``). Otherwise keep only the newest handler Ray installed:
    every ``ray.init`` with a logging config adds one more, so a process that starts one cluster after
    another (tests, ``bench serve --compare``) printed each line once per cluster so far."""
    root = logging.getLogger()
    added = [h for h in root.handlers if h not in handlers_before]
    if any(getattr(h, _MARK, False) for h in handlers_before):
        stale = added
    elif any(_is_rays(h) for h in added):
        stale = [h for h in handlers_before if _is_rays(h)]
    else:
        stale = []
    for handler in stale:
        root.removeHandler(handler)


def _is_rays(handler: logging.Handler) -> bool:
    """A handler ``ray.init`` installed: its formatter or a filter is one of Ray's (a later ``ray.init``
    gives an earlier handler a plain formatter but leaves its filter)."""
    parts = [handler.formatter, *handler.filters]
    return any(type(p).__module__.split(".")[0] == "ray" for p in parts)
