"""How every benchmark runs a contender: in a fresh process of its own, whose last line of output is its result as
JSON (the scripts put this directory on ``sys.path`` by being run from it)."""

from __future__ import annotations

import json
import subprocess


def run_contender(cmd: list[str], **kwargs) -> dict:
    """Run ``cmd`` (``subprocess.run`` keywords in ``kwargs``), fail if it fails, return its last line's JSON."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, **kwargs)
    return json.loads(out.stdout.strip().splitlines()[-1])
