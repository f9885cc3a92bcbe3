"""The engine in its own process, for ``prefixkv serve`` and the Ray replicas (vLLM v1's split)::

    HTTP process(es), or a Ray replica                     engine-core process (core.py)
    ----------------------------------                     -----------------------------
    parse, chat templates, tokenize, grammars (checked)    EngineCore: receive -> LLMEngine.step() -> send
    EngineCoreClient (client.py): an EngineClient          scheduler, KV manager, runner, grammars
      detokenize, stop strings, RequestOutputs            (token ids in, token ids out)
      SSE, metrics, the cache view
            |  DEALER  --- AddRequests / Abort / Call --->  ROUTER
            |          <-- Reply / StepOutputs / Dead ---   (messages.py: msgspec, MessagePack)

Why: in one process the engine's step waits for whatever Python the server runs between steps
(request parsing, templates, detokenization, SSE, JSON, the event loop) because they share the
GIL; in its own process the step runs while the front end works. The core sends one message per
step and client with every request's new tokens; the client does everything textual.

The in-process ``AsyncEngine`` stays for ``LLM``, notebooks and tests that want one process.
Imports zmq and msgspec: nothing under ``import prefixkv`` imports this package.
"""
