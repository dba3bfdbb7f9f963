"""engine.audio.load_audio on every input format and on bad input (issue 5, items 1 and 5).

Every file is made here from the espeak-ng "fox" clip: soundfile writes WAV / FLAC / Ogg / MP3,
PyAV (its own FFmpeg) encodes AAC, Opus, Vorbis and MP3 into M4A / MP4 / MOV / MKV / WEBM / ADTS.
"""

from __future__ import annotations

import os
import tracemalloc
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import soundfile

from engine.audio import SAMPLE_RATE, decode_audio, load_audio
from engine.errors import AudioError, CadenceError


# ---------------------------------------------------------------------------- making files
def _source(speech) -> np.ndarray:
    data, rate = soundfile.read(str(speech["fox"]), dtype="float32")
    assert rate == SAMPLE_RATE and data.ndim == 1
    return data


def _at(samples: np.ndarray, rate: int, channels: int) -> np.ndarray:
    """The 16 kHz mono source at ``rate`` Hz as [frames, channels] (channels differ a little)."""
    import soxr

    x = soxr.resample(samples, SAMPLE_RATE, rate, quality="HQ").astype(np.float32) if rate != SAMPLE_RATE else samples
    gains = np.linspace(0.9, 0.6, channels, dtype=np.float32)
    return np.ascontiguousarray(x[:, None] * gains[None, :])


def _pyav_write(path: Path, fmt: str, codec: str, audio: np.ndarray | None, rate: int, video: str | None = None,
                options: dict | None = None) -> Path:
    """Encode [frames, channels] float32 audio (and/or a few frames of video) with PyAV."""
    import av

    with av.open(str(path), "w", format=fmt) as out:
        vstream = None
        if video:
            vstream = out.add_stream(video, rate=5)
            vstream.width, vstream.height, vstream.pix_fmt = 64, 48, "yuv420p"
        astream = None
        if audio is not None:
            layout = {1: "mono", 2: "stereo"}[audio.shape[1]]
            astream = out.add_stream(codec, rate=rate, layout=layout)
            astream.bit_rate = 96000 * audio.shape[1]  # some encoders (WMA) have no default
            if options:
                astream.codec_context.options = options
        if vstream is not None:
            for i in range(10):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 20, np.uint8), format="rgb24")
                frame.pts, frame.time_base = i, Fraction(1, 5)
                for packet in vstream.encode(frame):
                    out.mux(packet)
            for packet in vstream.encode(None):
                out.mux(packet)
        if astream is not None:
            planar = np.ascontiguousarray(audio.T)  # [channels, frames]
            step = 4096
            for start in range(0, planar.shape[1], step):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planar[:, start:start + step]),
                                                   format="fltp", layout=astream.layout.name)
                frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
                for packet in astream.encode(frame):
                    out.mux(packet)
            for packet in astream.encode(None):
                out.mux(packet)
    return path


# name -> (file name, how to make it from the 16 kHz source; returns the path)
def _formats(src: np.ndarray, folder: Path) -> dict[str, Path]:
    def sf_write(name, rate, channels, **kw):
        path = folder / name
        soundfile.write(str(path), _at(src, rate, channels), rate, **kw)
        return path

    made = {
        "wav 16k mono": sf_write("a.wav", 16000, 1, subtype="PCM_16"),
        "wav 44.1k stereo float": sf_write("b.wav", 44100, 2, subtype="FLOAT"),
        "wav 8ch 192k": sf_write("c.wav", 192000, 8, subtype="PCM_24"),
        "flac 44.1k stereo": sf_write("d.flac", 44100, 2),
        "ogg vorbis 22.05k": sf_write("e.ogg", 22050, 1, format="OGG", subtype="VORBIS"),
        "ogg opus 48k stereo": sf_write("f.opus", 48000, 2, format="OGG", subtype="OPUS"),
        "mp3 44.1k stereo (soundfile)": sf_write("g.mp3", 44100, 2, format="MP3", subtype="MPEG_LAYER_III"),
        "aiff 8k": sf_write("h.aiff", 8000, 1, format="AIFF"),
    }
    a441, a48 = _at(src, 44100, 2), _at(src, 48000, 2)
    made.update({
        "mp3 (pyav)": _pyav_write(folder / "i.mp3", "mp3", "libmp3lame", _at(src, 22050, 1), 22050),
        "m4a aac": _pyav_write(folder / "j.m4a", "ipod", "aac", a441, 44100),
        "aac adts": _pyav_write(folder / "k.aac", "adts", "aac", _at(src, 32000, 1), 32000),
        "mp4 h264+aac": _pyav_write(folder / "l.mp4", "mp4", "aac", a48, 48000, video="libx264"),
        "mov mpeg4+aac": _pyav_write(folder / "m.mov", "mov", "aac", a441, 44100, video="mpeg4"),
        "mkv vorbis": _pyav_write(folder / "n.mkv", "matroska", "vorbis", a441, 44100,
                                  options={"strict": "experimental"}),  # FFmpeg's own Vorbis encoder
        "mkv flac": _pyav_write(folder / "o.mkv", "matroska", "flac", _at(src, 96000, 1), 96000),
        "webm vp8+opus": _pyav_write(folder / "p.webm", "webm", "libopus", a48, 48000, video="libvpx"),
        "wma": _pyav_write(folder / "q.wma", "asf", "wmav2", a441, 44100),
    })
    return made


@pytest.fixture(scope="module")
def source(speech) -> np.ndarray:
    return _source(speech)


@pytest.fixture(scope="module")
def formats(source, tmp_path_factory) -> dict[str, Path]:
    return _formats(source, tmp_path_factory.mktemp("formats"))


FORMAT_NAMES = [
    "wav 16k mono", "wav 44.1k stereo float", "wav 8ch 192k", "flac 44.1k stereo", "ogg vorbis 22.05k",
    "ogg opus 48k stereo", "mp3 44.1k stereo (soundfile)", "aiff 8k", "mp3 (pyav)", "m4a aac", "aac adts",
    "mp4 h264+aac", "mov mpeg4+aac", "mkv vorbis", "mkv flac", "webm vp8+opus", "wma",
]


# ---------------------------------------------------------------------------- good input
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_decodes_to_16k_mono_of_the_same_length(name, formats, source, capfd):
    capfd.readouterr()
    samples = load_audio(formats[name])
    assert capfd.readouterr().err == ""
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(samples.size - source.size) / SAMPLE_RATE < 0.1, (samples.size, source.size)
    assert 0.05 < np.abs(samples).max() <= 1.01  # real audio, not silence or garbage
    # the same sound, in time: the loudness envelope (10-ms frames) follows the source's, at most
    # 0.1 s early or late (codecs add a little delay, e.g. AAC in ADTS has no edit list to remove it)
    lag, corr = _best_alignment(samples, source)
    assert corr > 0.9 and abs(lag) <= 0.1, (lag, corr)


def _envelope(x: np.ndarray, hop: int = 160) -> np.ndarray:
    n = x.size // hop * hop
    return np.abs(x[:n]).reshape(-1, hop).mean(1)


def _best_alignment(samples: np.ndarray, source: np.ndarray) -> tuple[float, float]:
    """(seconds ``samples`` lag behind ``source``, correlation of their envelopes at that lag)."""
    a, b = _envelope(samples), _envelope(source)
    best = (0.0, -1.0)
    for shift in range(-20, 21):
        x, y = (a[shift:], b) if shift >= 0 else (a, b[-shift:])
        n = min(x.size, y.size)
        corr = float(np.corrcoef(x[:n], y[:n])[0, 1])
        if corr > best[1]:
            best = (shift / 100, corr)
    return best


def test_the_decoder_follows_the_content_not_the_extension(formats, source, tmp_path):
    for name, suffix in (("flac 44.1k stereo", ".mp4"), ("m4a aac", ".wav"), ("mp3 (pyav)", ".txt"),
                         ("webm vp8+opus", ".bin")):
        disguised = tmp_path / f"{name.replace(' ', '_')}{suffix}"
        disguised.write_bytes(formats[name].read_bytes())
        samples = load_audio(disguised)
        assert abs(samples.size - source.size) / SAMPLE_RATE < 0.1, (name, suffix)


def test_which_decoder_reads_what(formats, capfd):
    assert decode_audio(formats["flac 44.1k stereo"]).decoder == "soundfile"
    # MP3 goes to FFmpeg first: libsndfile's mpg123 would print to stderr on this (LAME, 22.05 kHz) file
    assert decode_audio(formats["mp3 (pyav)"]).decoder == "pyav"
    assert capfd.readouterr().err == ""
    got = decode_audio(formats["wav 8ch 192k"])
    assert (got.decoder, got.source_rate, got.channels) == ("soundfile", 192000, 8)
    got = decode_audio(formats["m4a aac"])
    assert (got.decoder, got.source_rate, got.channels, got.note) == ("pyav", 44100, 2, "")


@pytest.mark.parametrize("name", ["m4a aac", "webm vp8+opus", "mp3 (pyav)", "flac 44.1k stereo", "wav 8ch 192k"])
def test_a_real_transcription_of_each(name, formats, tiny):
    from engine.whisper.pipeline import transcribe_file
    from engine.whisper.reference import WhisperReference

    text = transcribe_file(WhisperReference(tiny), formats[name], language="en").text.lower()
    assert "fox" in text and "dog" in text, text


@pytest.mark.parametrize("suffix", [".flac", ".m4a"])
def test_channels_are_averaged(suffix, tmp_path):
    """Left 440 Hz, right 1000 Hz, at 48 kHz: mono holds both at half their level, resampled exactly."""
    rate, t = 48000, np.arange(48000 * 2) / 48000
    stereo = np.stack([0.6 * np.sin(2 * np.pi * 440 * t), 0.6 * np.sin(2 * np.pi * 1000 * t)], 1).astype(np.float32)
    path = tmp_path / f"two{suffix}"
    if suffix == ".flac":
        soundfile.write(str(path), stereo, rate)
    else:
        _pyav_write(path, "ipod", "aac", stereo, rate)
    mono = load_audio(path)
    spectrum = np.abs(np.fft.rfft(mono[4000:20000])) / 8000  # 1 s in the middle: 1-Hz bins
    for hz in (440, 1000):
        assert 0.25 < spectrum[hz] < 0.35, (hz, spectrum[hz])  # 0.6 / 2 each
    assert spectrum[1200:].max() < 0.01  # nothing folded or added above


def test_silence_decodes_to_zeros(tmp_path):
    path = tmp_path / "silence.flac"
    soundfile.write(str(path), np.zeros((48000 * 3, 2), np.float32), 48000)
    samples = load_audio(path)
    assert samples.size == 3 * SAMPLE_RATE and not samples.any()


def test_a_tenth_of_a_second_is_returned_as_it_is(tmp_path):
    path = tmp_path / "short.wav"
    soundfile.write(str(path), np.full(4410, 0.25, np.float32), 44100)
    samples = load_audio(path)
    assert abs(samples.size - SAMPLE_RATE // 10) <= 1


def test_long_files_decode_without_whole_file_float64_copies(tmp_path):
    """10 minutes of 44.1 kHz stereo: the peak is the 16 kHz result plus small blocks. (One float64
    copy of the input alone would be 424 MB; the float32 result is 38 MB.)"""
    path = tmp_path / "long.wav"
    rate, minutes = 44100, 10
    t = np.arange(rate * 10, dtype=np.float32) / rate
    ten_seconds = (0.3 * np.sin(2 * np.pi * 440 * t))[:, None].repeat(2, 1)
    with soundfile.SoundFile(str(path), "w", rate, 2, subtype="PCM_16") as f:
        for _ in range(minutes * 6):
            f.write(ten_seconds)
    tracemalloc.start()
    try:
        samples = load_audio(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert abs(samples.size - minutes * 60 * SAMPLE_RATE) < 100
    assert peak < samples.nbytes * 1.15 + 8 * 2**20, peak / 2**20


# ---------------------------------------------------------------------------- bad input
def _mp4_with_only_video(path: Path) -> Path:
    return _pyav_write(path, "mp4", "", None, 0, video="libx264")


def _expect(path, match: str) -> str:
    with pytest.raises(CadenceError, match=match) as info:
        load_audio(path)
    assert isinstance(info.value, AudioError)
    message = str(info.value)
    assert Path(path).name in message  # names the file
    assert message.endswith(".") and "\n" not in message and "Traceback" not in message
    return message


def _damage_adts(data: bytes, fraction: float) -> bytes:
    """AAC in ADTS with the payload of ``fraction`` of its frames replaced by random bytes (headers kept,
    so the demuxer still finds every packet and the decoder fails on the damaged ones)."""
    out, rng, i, k = bytearray(data), np.random.default_rng(1), 0, 0
    while i + 7 <= len(out):
        assert out[i] == 0xFF and out[i + 1] & 0xF6 == 0xF0, "not an ADTS frame header"
        length = ((out[i + 3] & 3) << 11) | (out[i + 4] << 3) | (out[i + 5] >> 5)
        if k % 10 < fraction * 10:
            out[i + 7:i + length] = rng.integers(0, 256, length - 7, dtype=np.uint8).tobytes()
        i, k = i + length, k + 1
    return bytes(out)


def test_a_partly_damaged_file_decodes_the_rest(formats, source, tmp_path):
    path = tmp_path / "scratched.aac"
    path.write_bytes(_damage_adts(formats["aac adts"].read_bytes(), 0.3))
    got = decode_audio(path)
    assert got.note.startswith("scratched.aac is truncated or damaged")
    assert 0.5 * source.size < got.samples.size <= source.size + SAMPLE_RATE // 10


def test_each_bad_input_gets_its_own_sentence(tmp_path, formats, capfd):
    rng = np.random.default_rng(0)
    sentences = {}

    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    sentences["empty"] = _expect(empty, "is empty \\(0 bytes\\)")

    zero = tmp_path / "zero.wav"
    soundfile.write(str(zero), np.zeros(0, np.float32), 16000)
    assert zero.stat().st_size > 0
    sentences["zero length"] = _expect(zero, "contains no audio \\(it is zero seconds long\\)")

    noise = tmp_path / "noise.wav"
    noise.write_bytes(rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    sentences["random bytes"] = _expect(noise, "is not an audio or video file Cadence can read")
    noise_mp3 = tmp_path / "noise.mp3"  # FFmpeg's MP3 demuxer takes the name at its word: decoding fails
    noise_mp3.write_bytes(rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    assert _expect(noise_mp3, "is not an audio or video file Cadence can read")

    text = tmp_path / "notes.txt"
    text.write_text("Meeting notes.\nBring the quarterly report.\n" * 200, encoding="utf-8")
    sentences["text"] = _expect(text, "is a text file, not audio or video")
    text_wav = tmp_path / "notes.wav"
    text_wav.write_text("Just a few words, named like a WAV file.\n", encoding="utf-8")
    assert _expect(text_wav, "is a text file, not audio or video")
    latin1 = tmp_path / "notes-latin1.txt"  # not UTF-8: FFmpeg's ANSI-art demuxer takes any .txt
    latin1.write_bytes("Café, crème brûlée and the résumé.\n".encode("latin-1") * 200)
    assert _expect(latin1, "is a text file, not audio or video")

    video = _mp4_with_only_video(tmp_path / "video.mp4")
    sentences["no audio track"] = _expect(video, "has no audio track")

    # an MP4/M4A keeps its index ("moov") at the end unless written for streaming: cut short, nothing
    # in it can be found, so it is refused with the container's name
    cut_m4a = tmp_path / "cut.m4a"
    data = formats["m4a aac"].read_bytes()
    cut_m4a.write_bytes(data[: int(len(data) * 0.4)])
    sentences["truncated m4a"] = _expect(cut_m4a, "looks like an MP4/M4A/MOV file but is damaged or incomplete")

    header_only = tmp_path / "header.flac"
    data = formats["flac 44.1k stereo"].read_bytes()
    header_only.write_bytes(data[:30])  # the FLAC signature and part of its first header, nothing else
    sentences["damaged flac"] = _expect(header_only, "looks like a FLAC file but is damaged or incomplete")

    mostly_bad = tmp_path / "mostly_bad.aac"
    mostly_bad.write_bytes(_damage_adts(formats["aac adts"].read_bytes(), 0.6))
    sentences["too damaged"] = _expect(mostly_bad, "is too damaged to use: most of its audio could not be decoded")

    nan = tmp_path / "nan.wav"
    soundfile.write(str(nan), np.array([0.0, np.nan, 0.1] * 1000, np.float32), 16000, subtype="FLOAT")
    sentences["non-finite"] = _expect(nan, "holds invalid \\(non-finite\\) samples")

    sentences["missing"] = _expect(tmp_path / "gone.wav", "does not exist")
    folder = tmp_path / "folder.wav"
    folder.mkdir()
    sentences["folder"] = _expect(folder, "is a folder, not an audio file")
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    sentences["not a regular file"] = _expect(fifo, "is not a regular file")

    assert len(set(sentences.values())) == len(sentences)  # each cause, its own sentence
    assert capfd.readouterr().err == ""  # and nothing from the decoders' C libraries on stderr
    patterns = {s.replace(n, "") for s, n in zip(sentences.values(), ["x"] * len(sentences))}
    assert len(patterns) == len(sentences)


def test_a_file_removed_while_it_is_read(tmp_path, monkeypatch):
    import engine.audio as audio

    path = tmp_path / "going.wav"
    soundfile.write(str(path), np.zeros(1600, np.float32), 16000)
    real = audio._head

    def head_then_remove(p, size=4096):
        data = real(p, size)
        p.unlink()
        return data

    monkeypatch.setattr(audio, "_head", head_then_remove)
    _expect(path, "was removed while it was being read")


def test_a_decoder_surprise_is_still_one_sentence(formats, monkeypatch):
    import engine.audio as audio

    def broken(frame):
        raise KeyError("s24")

    monkeypatch.setattr(audio, "_frame_to_mono", broken)
    _expect(formats["m4a aac"], r"could not be decoded \('s24'\)")


def test_a_file_without_read_permission(tmp_path, monkeypatch):
    """Root reads every file, so there the operating system's answer is simulated for this path."""
    import engine.audio as audio

    path = tmp_path / "secret.wav"
    soundfile.write(str(path), np.zeros(1600, np.float32), 16000)
    path.chmod(0)
    if os.geteuid() == 0:
        real_access = os.access
        monkeypatch.setattr(audio.os, "access", lambda p, mode: False if Path(p) == path else real_access(p, mode))
    try:
        _expect(path, "cannot be read \\(permission denied\\)")
    finally:
        path.chmod(0o644)


@pytest.mark.parametrize("name,suffix,noticed", [
    ("wav 44.1k stereo float", ".wav", True), ("flac 44.1k stereo", ".flac", True),
    ("mp3 44.1k stereo (soundfile)", ".mp3", True), ("mp3 (pyav)", ".mp3", True), ("aac adts", ".aac", True),
    ("mkv vorbis", ".mkv", True), ("ogg vorbis 22.05k", ".ogg", False)])
def test_a_truncated_file_decodes_what_is_there(name, suffix, noticed, formats, source, tmp_path, capfd):
    """The first 40% of a WAV, FLAC, MP3, ...: what is there decodes (a crash-cut recording still
    gives its text), with a note when the file shows it was cut (its header declares more; an Ogg
    file declares no length, so a cut one is just shorter)."""
    data = formats[name].read_bytes()
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: int(len(data) * 0.4)])
    got = decode_audio(path)
    seconds, full = got.duration, source.size / SAMPLE_RATE
    assert 0.25 * full < seconds < 0.55 * full, (seconds, full, got.decoder, got.note)
    assert np.abs(got.samples).max() > 0.05
    assert bool(got.note) == noticed, got.note
    if noticed:
        assert got.note.startswith(f"{path.name} is truncated or damaged")
    assert load_audio(path).size == got.samples.size
    assert capfd.readouterr().err == ""
