"""Errors whose message is one sentence a user can act on (never a traceback)."""


class CadenceError(Exception):
    """Base class: ``str(error)`` is shown to the user as it is."""


class ModelError(CadenceError):
    """A model could not be found, read or loaded."""


class AudioError(CadenceError):
    """An audio file could not be read or holds no usable audio."""


class RequestError(CadenceError):
    """A request's parameters are invalid."""
