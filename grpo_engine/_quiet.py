"""Known third-party noise, silenced where it arises (never with a global warnings filter).

- bitsandbytes logs, on import on some CPUs, that an optional ``kernels`` package is missing (its
  fallback kernel works): a filter on that one logger drops that one message.
- transformers 5 warns that ``is_gradient_checkpointing`` is deprecated whenever peft wraps a model:
  :func:`quiet_peft` ignores that one FutureWarning around our calls into peft.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

__all__ = ["quiet_peft"]


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community"))


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Ignores transformers' ``is_gradient_checkpointing`` deprecation warning, which peft triggers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing. is deprecated",
                                category=FutureWarning)
        yield
