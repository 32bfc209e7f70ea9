"""What the parent learns about a failure in the engine process."""

from __future__ import annotations

import pickle
import signal
import traceback


class EngineProcessExited(Exception):
    """The engine process ended without a word: killed by a signal or exited on its own.

    The ``__cause__`` of the ``EngineDeadError`` that ``ProcessEngine.run()`` raises;
    ``returncode`` is the exit status (negative: the signal that killed it).
    """

    def __init__(self, pid: int, returncode: int | None) -> None:
        self.pid = pid
        self.returncode = returncode
        super().__init__(f"engine process {pid} exited with status {describe_status(returncode)}")


class RemoteError(Exception):
    """An exception from the engine process that could not cross the boundary as itself."""

    def __init__(self, type_name: str, message: str) -> None:
        self.type_name = type_name
        super().__init__(f"{type_name}: {message}")


def describe_status(returncode: int | None) -> str:
    if returncode is None:
        return "unknown (still running)"
    if returncode < 0:
        try:
            return f"{returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return str(returncode)
    return str(returncode)


def portable(exc: BaseException, *, with_traceback: bool = False) -> BaseException:
    """``exc`` if it survives pickling, else a ``RemoteError`` with its type and message.

    ``with_traceback`` adds the engine process's traceback as a note (a traceback does
    not cross a process boundary).
    """
    try:
        copy: BaseException = pickle.loads(pickle.dumps(exc))
    except Exception:  # any failure to pickle: send what can be sent
        copy = RemoteError(type(exc).__name__, str(exc))
    if with_traceback and exc.__traceback__ is not None:
        remote = "".join(traceback.format_exception(exc)).rstrip()
        copy.add_note(f"in the engine process:\n{remote}")
    return copy
