"""``portable``: an exception made fit to cross a process boundary."""

from __future__ import annotations

import pickle
import traceback

from ..errors import RemoteError


def portable(exc: BaseException, *, with_traceback: bool = False) -> BaseException:
    """``exc`` if it survives pickling, else a ``RemoteError`` with its type and message.

    ``with_traceback`` adds this process's traceback as a note (a traceback does not cross
    a process boundary).
    """
    try:
        copy: BaseException = pickle.loads(pickle.dumps(exc))
    except Exception:  # any failure to pickle: send what can be sent
        copy = RemoteError(type(exc).__name__, str(exc))
    if with_traceback and exc.__traceback__ is not None:
        remote = "".join(traceback.format_exception(exc)).rstrip()
        copy.add_note(f"in the engine process:\n{remote}")
    return copy
