"""`cadence serve`'s default bounds, apart from the server itself so the command line reads them without
importing the web framework (every `cadence` command builds the serve parser)."""

DEFAULT_MAX_WAITING = 256  # requests waiting for a slot before new ones are turned away (429)
DEFAULT_MAX_AUDIO_MB = 512  # an upload to transcribe: an hour of 44.1 kHz stereo WAV is about 635 MB
