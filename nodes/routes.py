"""HTTP routes for the frontend: live worker status, and releasing the workers' weights on request.

Workers keep their weights between prompts (a re-run loads nothing); `POST /paradit/release` is the
user's way to give the memory back without restarting ComfyUI, `POST /paradit/shutdown` ends the
worker processes too. Registered once, when ComfyUI asks for the node list.
"""
from __future__ import annotations

_registered = False


def register_routes() -> None:
    global _registered
    if _registered:
        return
    try:
        from aiohttp import web
        from server import PromptServer
    except ImportError:  # not inside ComfyUI (unit tests)
        return
    routes = PromptServer.instance.routes

    @routes.get("/paradit/status")
    async def status(request):
        from parallel_runtime.runtime.client import active_clients

        return web.json_response({"clients": [c.status() for c in active_clients()], "cluster": _cluster_status()})

    @routes.post("/paradit/release")
    async def release(request):
        return web.json_response(await _each_client(lambda c: c.release()))

    @routes.post("/paradit/shutdown")
    async def shutdown(request):
        return web.json_response(await _each_client(lambda c: c.shutdown()))

    _registered = True


async def _each_client(action) -> dict:
    import asyncio

    from parallel_runtime.runtime.client import active_clients

    clients = active_clients()
    # The client's lock waits for a running job to finish; keep the event loop free meanwhile.
    await asyncio.gather(*(asyncio.to_thread(action, c) for c in clients))
    return {"clients": len(clients)}


def _cluster_status() -> dict | None:
    """The front door's address, its agents and its last refusals, also before any prompt (None where none is
    open: a failed one is logged, and repeated by the loader)."""
    from parallel_runtime.runtime import cluster

    try:
        door = cluster.front_door()
    except Exception:  # the loader's sentence says why; status must not fail on it
        return None
    return door.status() if door is not None else None
