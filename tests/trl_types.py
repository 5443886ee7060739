"""The one rule that writes a TRL field's type over builtins (tests/test_trl_entry.py and the generator of
grpo_engine/trl/fields.py share it)."""

from __future__ import annotations

import re

_NAMES = {r"transformers\.\w+\.\w+(Strategy|Type|Names)": "str",
          r"transformers\.debug_utils\.DebugOption": "str",
          r"accelerate\.parallelism_config\.ParallelismConfig": "dict", r"typing\.Any": "Any",
          r"typing\.Union\[str, NoneType, typing\.Literal\[False\]\]": "str | None"}


def type_text(annotation: object) -> str:
    """``annotation`` as text over builtins: ``int | None``, ``dict[str, Any] | str | None``, ..."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    for pattern, plain in _NAMES.items():
        text = re.sub(pattern, plain, text)
    parts = list(dict.fromkeys(text.split(" | ")))  # an enum written as str next to str: once
    return " | ".join(parts)
