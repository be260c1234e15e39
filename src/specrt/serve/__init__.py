"""`specrt serve`: an OpenAI-compatible HTTP server over one bundle (the `serve` extra).

settings (what the server is told) -> app (routes, auth, SSE) -> worker (the one thread that
owns the engines, behind a bounded FIFO) -> runtime. The web stack stays here: nothing in the
runtime imports it, and nothing here imports torch.
"""

from specrt.serve.app import create_app
from specrt.serve.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]
