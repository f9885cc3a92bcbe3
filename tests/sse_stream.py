"""A streamed completion's SSE body, read back by the tests."""

from __future__ import annotations

import json


def completion_chunks(body: bytes) -> list[dict]:
    """The chunks of an OpenAI-style SSE body (``data: {...}`` events), checking that ``[DONE]``
    closes it."""
    events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]", body[-200:]
    return [json.loads(e) for e in events[:-1]]
