"""Cadence's PySide6 desktop front end. It talks to the engine only through ``engine``'s public API."""
