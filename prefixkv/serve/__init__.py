"""prefixkv on Ray Serve: engine replicas behind one OpenAI ingress, routed on their real prefix
caches. Needs ``ray[serve]`` (``pip install 'prefixkv[ray]'``); ``import prefixkv`` never imports Ray.

``build_app`` (serve/app.py) builds the application; ``prefixkv serve --replicas N`` runs it.
"""

from __future__ import annotations

from typing import Any


def build_app(*args: Any, **kwargs: Any):
    from prefixkv.serve.app import build_app as _build

    return _build(*args, **kwargs)


__all__ = ["build_app"]
