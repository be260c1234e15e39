"""How `specrt serve` starts: uvicorn in this process, or a Ray Serve application (`--ray`).

Both check the settings first, so a missing or damaged bundle fails before anything starts.
Ray is imported only on the Ray path, so a machine without the `ray` extra serves as before
and `--ray` names what to install.
"""

from __future__ import annotations

from collections.abc import Callable

from specrt.errors import SpecrtError
from specrt.serve.settings import RayOptions, ServeSettings


def serve(
    settings: ServeSettings,
    *,
    ray: RayOptions | None = None,
    address: str | None = None,
    log_level: str = "info",
    say: Callable[[str], None] = print,
) -> None:
    """Serve until interrupted: here, or (ray given) as engine replicas on Ray Serve."""
    settings.check()
    if ray is None:
        from specrt.serve.server import run

        where = f"http://{settings.host}:{settings.port}/v1"
        say(f"serving {settings.served_model} on {where} (loading the engines)")
        run(settings, log_level=log_level)
        return
    ray.check()
    try:
        from specrt.serve import ray as on_ray
    except ImportError as err:
        raise SpecrtError(f"--ray needs Ray Serve: pip install 'specrt[ray]' ({err})") from err
    say(f"deploying {settings.served_model} on Ray Serve (engine replicas load the bundle)")
    on_ray.run(settings, ray, address, say=say)
