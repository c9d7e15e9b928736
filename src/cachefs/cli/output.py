"""What the commands print besides their one-line errors."""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["print_json"]


def print_json(obj: Any) -> None:
    """What ``--json`` prints: one indented JSON document."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
