"""Where a server's API key is kept: the system keyring (the ``keyring`` package: Secret Service on Linux,
the Keychain on macOS, the Credential Manager on Windows) where one works, else in this process only, for
this session. Never in the settings file."""

from __future__ import annotations

import threading

SERVICE = "Cadence"  # the keyring's service name; each key is stored under its server's address

_session: dict[str, str] = {}  # server address -> key, where no keyring works
_lock = threading.Lock()
_works: bool | None = None  # whether a keyring backend answered (asked once per process)


def _keyring():
    """The keyring module where a usable backend exists, else None."""
    global _works
    try:
        import keyring
        from keyring.errors import KeyringError
    except ImportError:
        return None
    if _works is None:
        try:
            backend = keyring.get_keyring()
            _works = float(getattr(backend, "priority", 0)) > 0
            if _works:
                keyring.get_password(SERVICE, "(probe)")  # a locked or absent Secret Service fails here
        except (KeyringError, RuntimeError, OSError, ValueError):
            _works = False
        except Exception:  # backends raise their own errors (D-Bus, ...): none of them may reach the user
            _works = False
    return keyring if _works else None


def keyring_available() -> bool:
    return _keyring() is not None


def where_kept() -> str:
    """One sentence saying where the key is kept, for the settings panel."""
    if keyring_available():
        return "The API key is kept in the system keyring, never in the settings file."
    return ("No system keyring works here, so the API key is kept for this session only (never written to the "
            "settings file): give it again after Cadence restarts.")


def get_key(server: str) -> str:
    """The key stored for ``server`` ('' when none)."""
    if not server:
        return ""
    with _lock:
        if server in _session:
            return _session[server]
    keyring = _keyring()
    if keyring is None:
        return ""
    try:
        return keyring.get_password(SERVICE, server) or ""
    except Exception:  # a keyring that stopped answering: as if no key were stored
        return ""


def set_key(server: str, key: str) -> bool:
    """Keep ``key`` for ``server`` ('' forgets it). True: in the system keyring; False: for this session only."""
    keyring = _keyring()
    if keyring is not None:
        try:
            if key:
                keyring.set_password(SERVICE, server, key)
            else:
                try:
                    keyring.delete_password(SERVICE, server)
                except Exception:  # nothing stored
                    pass
            with _lock:
                _session.pop(server, None)
            return True
        except Exception:  # refused (a locked keyring): keep it for this session rather than lose it
            pass
    with _lock:
        if key:
            _session[server] = key
        else:
            _session.pop(server, None)
    return False
