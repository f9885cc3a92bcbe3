"""The request routers living in this process, by the deployment they route to: the ingress reads
the replicas' routing stats and the routers' decisions here (its ``/metrics``, ``/health``).

Its own module because Serve pickles the router's module by value (``RequestRouterConfig``): a
registry there would be a copy in the process that unpickles it."""

from __future__ import annotations

import threading
from typing import Any

_ROUTERS: dict[str, list[Any]] = {}
_LOCK = threading.Lock()


def register(deployment: str, router: Any) -> None:
    with _LOCK:
        _ROUTERS.setdefault(deployment, []).append(router)


def routers_for(deployment: str) -> list[Any]:
    with _LOCK:
        return list(_ROUTERS.get(deployment, ()))
