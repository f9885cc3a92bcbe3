"""(twenty-third session) MAPT=auto|none|N PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-05-zen4-23rd/restart_split.py [BASE_DIR]
The eighteenth session's restart_split.py (bench.tiers' restart, 8 users, taken apart) with MAPT=
taking what --max-admitted-prefill-tokens takes: auto (the default here, as the engine's), none or an int."""
import os
import runpy
from pathlib import Path

import prefixkv
from prefixkv.engine_args import admitted_prefill_tokens

cap = admitted_prefill_tokens(os.environ.pop("MAPT", "auto"))


class LLM(prefixkv.LLM):
    def __init__(self, **kw):
        super().__init__(**{**kw, "max_admitted_prefill_tokens": cap})


prefixkv.LLM = LLM
runpy.run_path(str(Path(__file__).parents[1] / "cpu-2026-12-04-zen4-18th" / "restart_split.py"), run_name="__main__")
