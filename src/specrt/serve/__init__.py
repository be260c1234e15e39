"""`specrt serve`: an OpenAI-compatible HTTP server over one bundle (the `serve` extra).

settings (what the server is told) -> app (routes, auth, SSE) -> service (the engines' side:
in this process, or engine replicas on Ray Serve, see ray.py) -> worker (the one thread that
owns the engines, behind a bounded FIFO) -> runtime. The web stack stays here: nothing in the
runtime imports it, nothing here imports torch, and only ray.py imports Ray.
"""

from specrt.serve.app import create_app
from specrt.serve.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]
