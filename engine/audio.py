"""Decode an audio (or video) file to 16 kHz mono float32 samples.

What is read, and how:

- The format is found from the file's content, never from its name: a FLAC file named ``.mp4``,
  an M4A named ``.wav`` or an MP3 named ``.txt`` decodes all the same.
- The first 4 KB decide the order. WAV (also RF64, float and 24-bit), FLAC, Ogg Vorbis / Opus, AIFF
  and CAF go to libsndfile (soundfile), with PyAV (its own FFmpeg) as the fallback. M4A, AAC (ADTS),
  MP4, MOV, MKV, WEBM, WMA go to PyAV only. MP3 and anything not recognised go to PyAV first and
  to libsndfile only when FFmpeg could make nothing of the file: libsndfile's mpg123 prints its
  complaints about common MP3s (LAME MPEG-2 at 16 / 22.05 kHz, cut-off files, junk named .mp3)
  on the process's stderr, which would break the one-sentence promise of the command line. The
  first audio stream of a file is decoded; video streams are skipped.
- Any sample rate and channel count: channels are averaged to mono, and the rate is converted to
  16 kHz with soxr (quality "HQ"), streaming.
- Memory: the file is decoded in blocks (64k frames for libsndfile, FFmpeg's packets gathered into
  ~64k samples for PyAV); each block is downmixed in float32 and fed to a ``soxr.ResampleStream``,
  and the 16 kHz result is written into one growing float32 array sized from the file's declared
  length. A 2-hour file therefore needs its 16 kHz result (~460 MB) plus a few small blocks, never
  a float64 or multi-channel copy of the whole recording (measured: 2 h of 44.1 kHz stereo WAV,
  peak RSS 483 MB, 5.7 s).

Bad input raises :class:`engine.errors.AudioError` with one sentence naming the file:

====================================  =====================================================
missing path                          "X does not exist."
a folder                              "X is a folder, not an audio file."
a device, pipe, ...                   "X is not a regular file."
no read permission                    "X cannot be read (permission denied)."
0 bytes                               "X is empty (0 bytes)."
a text file                           "X is a text file, not audio or video."
unknown content (random bytes, ...)   "X is not an audio or video file Cadence can read."
a known container nothing decodes in  "X looks like a|an FORMAT file but is damaged or
                                      incomplete: no audio could be decoded from it."
more bad packets than good frames     "X is too damaged to use: most of its audio could not be
                                      decoded."
video without an audio stream         "X has no audio track."
audio track with no decoder           "X has an audio track in a codec Cadence cannot decode."
decodes to zero samples               "X contains no audio (it is zero seconds long)."
NaN / infinite samples                "X holds invalid (non-finite) samples."
removed while being decoded           "X was removed while it was being read."
out of memory                         "X is too long to decode in the memory available."
any other decoder failure             "X could not be decoded (REASON)." / "could not be read"
====================================  =====================================================

Truncated and partly damaged files: what the decoders can decode is kept. A WAV, FLAC, MP3, AAC,
MKV... cut short decodes up to where it ends (libsndfile or FFmpeg, whichever gets further), and
FFmpeg skips a damaged packet and carries on, so a recording cut off by a crash still gives the
text that is there. When the file shows that it was cut (its header or container declares more
than could be decoded, or a decoder failed part way), :func:`decode_audio` says so in
``DecodedAudio.note`` and :func:`load_audio` logs that sentence as a warning; an Ogg file declares
no length, so a cut one is just shorter. A file of which only a small part decodes (more bad
packets than good frames) is refused as too damaged. Containers whose index sits at the end (an
MP4/M4A written without "fast start" and cut short) cannot be opened at all: they get the "damaged
or incomplete" sentence. Very short audio (0.1 s, say) is returned as it is; the transcription
layer decides what is too short to transcribe.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import AudioError

SAMPLE_RATE = 16000
# What a dropped or given folder is searched for (content decides how a file is decoded, not this).
AUDIO_EXTENSIONS = frozenset({
    ".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".m4b", ".aac", ".mp4", ".mkv", ".webm", ".mov",
    ".wma", ".aif", ".aiff", ".caf", ".3gp",
})

BLOCK_FRAMES = 1 << 16  # frames per decoded block (libsndfile) / samples gathered before resampling (PyAV)

log = logging.getLogger(__name__)


@dataclass
class DecodedAudio:
    """What :func:`decode_audio` found: the 16 kHz mono samples and where they came from."""

    samples: np.ndarray  # float32, 16 kHz mono
    source_rate: int  # the file's own sample rate (of its first audio stream)
    channels: int
    decoder: str  # "soundfile" or "pyav"
    container: str  # libsndfile's format name or FFmpeg's demuxer name
    note: str = ""  # set when the file was truncated or damaged and only part of it decoded

    @property
    def duration(self) -> float:
        return self.samples.size / SAMPLE_RATE


# ---------------------------------------------------------------------------- building blocks
class _Collector:
    """Mono float32 blocks at any rate -> one 16 kHz float32 array, resampled as a stream."""

    def __init__(self, name: str, expected_samples: int = 0):
        self.name = name
        self.buf = np.empty(max(int(expected_samples * 1.01) + 4096, BLOCK_FRAMES), np.float32)
        self.size = 0
        self.rate: int | None = None
        self.stream = None

    def _append(self, out: np.ndarray) -> None:
        if out.size == 0:
            return
        if not np.isfinite(out).all():
            raise AudioError(f"{self.name} holds invalid (non-finite) samples.")
        end = self.size + out.size
        if end > self.buf.size:  # grow by half: a file's declared length is usually right, so rarely
            grown = np.empty(max(end, self.buf.size + self.buf.size // 2), np.float32)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        self.buf[self.size:end] = out
        self.size = end

    def add(self, mono: np.ndarray, rate: int) -> None:
        if rate != self.rate:  # a rate change inside a stream (rare): finish the old resampler first
            self._flush()
            self.rate = rate
            if rate != SAMPLE_RATE:
                import soxr

                self.stream = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
        if mono.size == 0:
            return
        mono = np.ascontiguousarray(mono, dtype=np.float32)
        if self.stream is None:
            self._append(mono)
        else:
            self._append(self.stream.resample_chunk(mono, last=False))

    def _flush(self) -> None:
        if self.stream is not None:
            self._append(self.stream.resample_chunk(np.zeros(0, np.float32), last=True))
        self.stream = None

    def result(self) -> np.ndarray:
        self._flush()
        out = self.buf[: self.size]
        if self.buf.size - self.size > self.size // 64 + BLOCK_FRAMES:  # don't keep much unused memory
            out = out.copy()
        self.buf = np.empty(0, np.float32)
        return out


def _downmix(block: np.ndarray) -> np.ndarray:
    """[frames, channels] float32 -> [frames] float32 (the mean of the channels)."""
    if block.shape[1] == 1:
        return block[:, 0]
    return block.mean(axis=1, dtype=np.float32)


_INT_SCALE = {"u8": 128.0, "s16": 32768.0, "s32": 2147483648.0, "s64": 9223372036854775808.0}


def _frame_to_mono(frame) -> np.ndarray:
    """A PyAV AudioFrame of any sample format and layout -> mono float32."""
    fmt = frame.format.name.rstrip("p")
    channels = frame.layout.nb_channels or 1
    data = frame.to_ndarray()
    if frame.format.is_planar:  # [channels, samples]
        data = data.T
    else:  # [1, samples * channels], interleaved
        data = data.reshape(-1, channels)
    if fmt in ("flt", "dbl"):
        data = data.astype(np.float32, copy=False)
    elif fmt == "u8":
        data = (data.astype(np.float32) - 128.0) / 128.0
    else:
        data = (data.astype(np.float32) / np.float32(_INT_SCALE[fmt])).astype(np.float32, copy=False)
    return _downmix(data)


def _head(path: Path, size: int = 4096) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def _looks_like_text(head: bytes) -> bool:
    """Text (UTF-8, UTF-16 with a byte-order mark, or an 8-bit code page such as Latin-1): no audio
    or video format's first 4 KB look so (their sizes and samples hold NUL and control bytes)."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            text = head[: len(head) // 2 * 2].decode("utf-16")
        except UnicodeDecodeError:
            return False
    else:
        if not head or b"\x00" in head:
            return False
        text = None
        for cut in range(4):  # the 4 KB read may end inside a multi-byte character
            try:
                text = head[: len(head) - cut].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        if text is None:
            text = head.decode("latin-1")  # 0xA0-0xFF: letters of some code page
    text = text.lstrip("\ufeff")
    if not text:
        return False
    control = sum(not (c.isprintable() or c in "\t\n\r\f\x1b") for c in text)
    return control <= 0.02 * len(text)


def _container_kind(head: bytes) -> str | None:
    """A name for the container the first bytes announce (for the 'damaged' sentence), if any."""
    if head[:4] in (b"RIFF", b"RF64", b"BW64") and head[8:12] == b"WAVE":
        return "WAV"
    if head[:4] == b"fLaC":
        return "FLAC"
    if head[:4] == b"OggS":
        return "Ogg"
    if head[:3] == b"ID3":
        return "MP3"
    if head[4:8] == b"ftyp":
        return "MP4/M4A/MOV"
    if head[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return "QuickTime"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "Matroska/WebM"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "AIFF"
    if head[:4] == b"caff":
        return "CAF"
    if head[:4] == b"\x30\x26\xb2\x75":
        return "WMA/ASF"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:
        return "AAC"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06:
        return "MP3"
    return None


_LIBSNDFILE_KINDS = {"WAV", "FLAC", "Ogg", "AIFF", "CAF"}


def _a(kind: str) -> str:
    return "an" if kind[0] in "AEIMOa" else "a"  # an AAC, an MP3, an Ogg, an audio; a FLAC, a WAV


def _short_of(got: int, declared: int) -> bool:
    """Decoded clearly less than the file declares (more than 1% and 0.1 s short)."""
    return declared > 0 and got < declared * 0.99 - SAMPLE_RATE // 10


# ---------------------------------------------------------------------------- the two decoders
@dataclass
class _Attempt:
    recognised: bool  # the decoder knew the format (it opened the file)
    container: str = ""
    decoded: DecodedAudio | None = None
    complete: bool = True  # False: decoding stopped early or skipped damaged parts
    detail: str = ""
    mostly_bad: bool = False  # some audio decoded, but more of the file's packets failed
    decoder: str = ""


def _decode_soundfile(path: Path, name: str) -> _Attempt:
    import soundfile

    try:
        f = soundfile.SoundFile(str(path))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        return _Attempt(False)
    with f:
        rate, channels, frames, container = f.samplerate, f.channels, f.frames, f.format
        if rate <= 0 or channels <= 0:
            return _Attempt(True, container=container, complete=False, detail="no sample rate or channels")
        expected = frames * SAMPLE_RATE // rate if 0 < frames < 1 << 40 else 0
        out = _Collector(name, expected)
        complete, detail = True, ""
        try:
            while True:
                block = f.read(BLOCK_FRAMES, dtype="float32", always_2d=True)
                if block.shape[0] == 0:
                    break
                out.add(_downmix(block), rate)
        except AudioError:
            raise
        except (soundfile.LibsndfileError, RuntimeError, ValueError) as exc:
            complete, detail = False, str(exc)
        samples = out.result()
        if complete and _short_of(samples.size, expected):  # an MP3's Xing header, a FLAC's STREAMINFO
            complete, detail = False, "shorter than its header says"
        if complete and any(line.startswith("data") and "should be" in line for line in f.extra_info.splitlines()):
            complete, detail = False, "its data chunk is shorter than its header says"  # a cut-off WAV
    return _Attempt(True, container, DecodedAudio(samples, rate, channels, "soundfile", container), complete, detail)


def _decode_pyav(path: Path, name: str) -> _Attempt:
    try:
        import av
    except ImportError:  # pragma: no cover - PyAV is a dependency
        return _Attempt(False)
    try:
        container = av.open(str(path), metadata_errors="ignore")
    except (av.FFmpegError, UnicodeDecodeError, OSError, ValueError):
        return _Attempt(False)
    with container:
        fmt = container.format.name
        if fmt == "tty":  # FFmpeg's ANSI-art "video" demuxer: really a text file
            raise AudioError(f"{name} is a text file, not audio or video.")
        if not container.streams.audio:
            if container.streams.video:
                raise AudioError(f"{name} has no audio track.")
            return _Attempt(True, fmt, detail="no streams")
        stream = container.streams.audio[0]
        try:
            codec = stream.codec_context
        except Exception:  # noqa: BLE001 - no decoder for this codec
            codec = None
        if codec is None:
            raise AudioError(f"{name} has an audio track in a codec Cadence cannot decode.")
        rate = codec.sample_rate or 0
        channels = codec.channels if hasattr(codec, "channels") else codec.layout.nb_channels
        declared = 0  # the audio stream's own length in 16 kHz samples, when the container says
        if stream.duration and stream.time_base and 0 < stream.duration * stream.time_base < 1e6:
            declared = int(stream.duration * stream.time_base * SAMPLE_RATE)
        guess = container.duration / 1_000_000 if container.duration and container.duration > 0 else 0
        guess = int(guess * SAMPLE_RATE) if guess < 1e6 else 0
        if not declared and len(container.streams) == 1:  # Matroska/WebM: only the file's length
            declared = guess
        out = _Collector(name, declared or guess)
        for other in container.streams:
            if other.index != stream.index:
                other.discard = av.stream.Discard.all  # the demuxer drops other streams' packets
        good = bad = 0
        pending: list[np.ndarray] = []
        pending_n, pending_rate = 0, None

        def drain():
            nonlocal pending, pending_n
            if pending:
                out.add(np.concatenate(pending) if len(pending) > 1 else pending[0], pending_rate)
            pending, pending_n = [], 0

        def take(frames):
            nonlocal good, pending_n, pending_rate
            for frame in frames:
                good += 1
                if frame.sample_rate != pending_rate:
                    drain()
                    pending_rate = frame.sample_rate
                mono = _frame_to_mono(frame)
                pending.append(mono)
                pending_n += mono.size
                if pending_n >= BLOCK_FRAMES:
                    drain()

        detail = ""
        try:
            for packet in container.demux(stream):
                try:
                    take(packet.decode())
                except av.FFmpegError as exc:  # a damaged packet: skip it, as FFmpeg's own tools do
                    bad += 1
                    detail = str(exc)
        except av.FFmpegError as exc:  # the demuxer gave up (a cut-off file): keep what was decoded
            bad += 1
            detail = str(exc)
            try:
                take(codec.decode(None))
            except av.FFmpegError:
                pass
        drain()
        samples = out.result()
        if bad and bad > good:  # mostly undecodable: not audio that happens to have a bad packet
            return _Attempt(True, fmt, None, False, detail, mostly_bad=good > 0)
        rate = rate or (pending_rate or 0)
        complete = bad == 0
        if complete and _short_of(samples.size, declared):
            complete, detail = False, "shorter than its container says"
        return _Attempt(True, fmt, DecodedAudio(samples, rate, channels or 1, "pyav", fmt), complete, detail)


# ---------------------------------------------------------------------------- public functions
def _check_path(path: Path) -> None:
    shown = str(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise AudioError(f"{shown} does not exist.") from None
    except PermissionError:
        raise AudioError(f"{shown} cannot be read (permission denied).") from None
    except OSError as exc:
        raise AudioError(f"{shown} cannot be opened ({exc.strerror or exc}).") from None
    if stat.S_ISDIR(st.st_mode):
        raise AudioError(f"{shown} is a folder, not an audio file.")
    if not stat.S_ISREG(st.st_mode):
        raise AudioError(f"{shown} is not a regular file.")
    if not os.access(path, os.R_OK):
        raise AudioError(f"{path.name} cannot be read (permission denied).")
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise AudioError(f"{path.name} cannot be read (permission denied).") from None
    except OSError as exc:
        raise AudioError(f"{path.name} cannot be opened ({exc.strerror or exc}).") from None
    if st.st_size == 0:
        raise AudioError(f"{path.name} is empty (0 bytes).")


def decode_audio(path: str | Path) -> DecodedAudio:
    """Decode ``path`` by its content into 16 kHz mono float32, with where it came from; AudioError
    with one sentence naming the file when there is no usable audio (see the module docstring)."""
    path = Path(path)
    _check_path(path)
    name = path.name
    try:
        return _decode(path, name)
    except AudioError:
        raise
    except FileNotFoundError:
        raise AudioError(f"{path} was removed while it was being read.") from None
    except MemoryError:
        raise AudioError(f"{name} is too long to decode in the memory available.") from None
    except OSError as exc:
        raise AudioError(f"{name} could not be read ({exc.strerror or exc}).") from None
    except Exception as exc:  # noqa: BLE001 - a decoder's surprise is still one sentence, not a traceback
        reason = (str(exc).splitlines() or [""])[0][:200].rstrip(".") or type(exc).__name__
        raise AudioError(f"{name} could not be decoded ({reason}).") from None


def _decode(path: Path, name: str) -> DecodedAudio:
    head = _head(path)
    if _looks_like_text(head):
        raise AudioError(f"{name} is a text file, not audio or video.")
    kind = _container_kind(head)
    # libsndfile first for what it reads best; FFmpeg first for MP3 and anything else. libsndfile's
    # mpg123 prints its complaints about common files (LAME MPEG-2 at 16 / 22.05 kHz, cut-off
    # files, junk named .mp3) on the process's stderr, so it only runs when FFmpeg could not
    # make sense of the file (and never on containers only FFmpeg reads).
    if kind in _LIBSNDFILE_KINDS:
        order = (_decode_soundfile, _decode_pyav)
    elif kind in (None, "MP3"):
        order = (_decode_pyav, _decode_soundfile)
    else:
        order = (_decode_pyav,)
    attempts: list[_Attempt] = []
    for decoder in order:
        if decoder is _decode_soundfile and any(
                a.decoded is not None and a.decoded.samples.size if kind == "MP3" else a.recognised for a in attempts):
            break  # FFmpeg knew the format (unknown kind) or decoded part of the MP3: mpg123 adds nothing
        attempt = decoder(path, name)
        attempt.decoder = "soundfile" if decoder is _decode_soundfile else "pyav"
        attempts.append(attempt)
        if attempt.complete and attempt.decoded is not None and attempt.decoded.samples.size:
            return attempt.decoded
    if not path.exists():  # gone since it was checked: the decoders' failures say nothing about it
        raise FileNotFoundError(path)
    candidates = [a for a in attempts if a.decoded is not None and a.decoded.samples.size]
    if candidates:  # a cut-off or damaged file: the decoder that got furthest
        chosen = max(candidates, key=lambda a: (a.decoded.samples.size, a.complete))
        result = chosen.decoded
        doubted = [a for a in candidates if not a.complete and a.decoded.samples.size * 1.01 >= result.samples.size]
        if doubted:  # the longest decode is no longer than one that knew the file was cut short
            result.note = (f"{name} is truncated or damaged; the {result.duration:.1f} s of audio "
                           f"that could be decoded are used.")
        return result
    if any(a.mostly_bad for a in attempts):
        raise AudioError(f"{name} is too damaged to use: most of its audio could not be decoded.")
    if any(a.recognised and a.complete and a.decoded is not None for a in attempts):
        raise AudioError(f"{name} contains no audio (it is zero seconds long).")
    sf_known = next((a.container for a in attempts if a.recognised and a.decoder == "soundfile"), None)
    if kind or sf_known:  # a real header (FFmpeg alone may guess a format from the file's name)
        kind = kind or sf_known
        raise AudioError(f"{name} looks like {_a(kind)} {kind} file but is damaged or incomplete: "
                         f"no audio could be decoded from it.")
    raise AudioError(f"{name} is not an audio or video file Cadence can read.")


def load_audio(path: str | Path) -> np.ndarray:
    """Samples at 16 kHz mono float32 in [-1, 1]; AudioError with one clear sentence when unusable.
    A truncated or damaged file gives what could be decoded (and a logged warning)."""
    decoded = decode_audio(path)
    if decoded.note:
        log.warning(decoded.note)
    return decoded.samples


def audio_files(folder: str | Path) -> list[Path]:
    """The audio and video files under ``folder``, recursively, sorted."""
    return sorted(f for f in Path(folder).rglob("*") if f.is_file() and f.suffix.lower() in AUDIO_EXTENSIONS)
