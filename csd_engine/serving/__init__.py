"""Serving: `AsyncEngine` (many asyncio callers, one engine thread) and, in `server`, the
OpenAI-compatible HTTP app behind `csd-engine serve` (needs the `serve` extra: fastapi, uvicorn,
prometheus_client; imported only there)."""
from csd_engine.scheduler import QueueFull
from csd_engine.serving.async_engine import AsyncEngine, EngineStopped

__all__ = ["AsyncEngine", "EngineStopped", "QueueFull"]
