"""`minillm bench --speculative`: plain vs speculative decode on copy-heavy prompts, in one run."""
from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).parent / "data" / "copy_heavy_prompts.json"


def copy_heavy_prompts() -> list[dict]:
    """The shipped prompts whose answers mostly repeat or edit their input: each {"kind", "messages" or "text"}."""
    return json.loads(PROMPTS_FILE.read_text())["prompts"]
