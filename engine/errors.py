"""Errors whose message is one sentence a user can act on (never a traceback)."""


class CadenceError(Exception):
    """Base class: ``str(error)`` is shown to the user as it is."""


class ModelError(CadenceError):
    """A model could not be found, read or loaded."""


class AudioError(CadenceError):
    """An audio file could not be read or holds no usable audio."""


class RequestError(CadenceError):
    """A request's parameters are invalid."""


def record_fault(exc: BaseException) -> str:
    """Append an unexpected error's traceback to the fault log in the user data folder (for bug
    reports) and return where, so the sentence shown to the user can point there."""
    import time
    import traceback

    from engine.paths import data_dir

    path = data_dir() / "faults.log"
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.write("".join(traceback.format_exception(exc)))
    except OSError:
        return "nowhere (the fault log could not be written)"
    return str(path)
